"""Which network a run emulates, resolved once in the launcher for all ranks."""

from __future__ import annotations

import functools
import time
from typing import Any

import torch

from ddlscope.specs import NetworkSpec
from ddlscope.strategies.comm import LinkModel


@functools.lru_cache(maxsize=None)
def measure_matmul_flops(threads: int, size: int = 384, repeats: int = 8) -> float:
    """This machine's achieved fp32 matmul FLOP/s with one rank's thread count.

    A mid-sized square matmul stands for the GEMMs of the small workloads;
    the best of several repeats discounts scheduler noise. Measured once per
    process, so every cell of a study uses the same scale.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        a @ b  # warm-up: allocation, kernel selection
        best_s = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            best_s = min(best_s, time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    return 2 * size**3 / best_s


def resolve_link(network: NetworkSpec, threads: int) -> tuple[LinkModel | None, dict[str, Any]]:
    """The emulated link (or None for the real network) and what the run records about it.

    In `shaped` mode the returned link has infinite bandwidth (only alpha is
    waited out in software) and the record's `shaped_bandwidth_bytes_per_s`
    is the rate tc must enforce, after `scaled` division like any bandwidth.
    """
    link = network.link()
    if link is None:
        return None, {"profile": "local", "mode": "real", "emulated": False}
    alpha_s, bandwidth = link
    record: dict[str, Any] = {"profile": network.profile, "mode": network.mode, "emulated": True,
                              "alpha_s": alpha_s, "profile_bandwidth_bytes_per_s": bandwidth, "scaled": network.scaled}
    if network.scaled:
        local_flops = measure_matmul_flops(threads)
        slowdown = network.target_flops() / local_flops
        bandwidth /= slowdown
        record.update(local_matmul_flops=local_flops, target_flops=network.target_flops(), scale_factor=slowdown)
    record["bandwidth_bytes_per_s"] = bandwidth
    if network.mode == "shaped":
        # tc enforces the bandwidth on real links (runtime/netns.py); software keeps only the latency.
        record.update(shaped_bandwidth_bytes_per_s=bandwidth, software_bandwidth_bytes_per_s=None,
                      latency="emulated in software (this kernel has no netem)")
        return LinkModel(alpha_s, float("inf")), record
    return LinkModel(alpha_s, bandwidth), record
