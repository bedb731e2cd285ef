"""Bucket plans applied to DDP: the measured inputs of MG-WFBP (specs/bucketing.py) and DDP's per-bucket caps.

A "layer" here is a module that owns parameters directly (a Linear, an
Embedding, a LayerNorm), in the order backward makes their gradients ready,
measured with post-accumulate-grad hooks on one real backward of a copy of the
model: each layer's backward time is the time from the previous layer's
gradients (or from the start of backward) to its own.

DDP takes the plan through torch's `bucket_cap_mb_list` (per-bucket size
limits): after its first step DDP rebuilds its buckets in the order the
gradients became ready, closing bucket i once it holds at least limit i
bytes, so limits equal to the plan's bucket bytes put the boundaries exactly
at the plan's layer boundaries (the first step still uses DDP's initial,
parameter-order assignment).
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ddlscope.specs.bucketing import AlphaBeta, Layer
from ddlscope.specs.wire import WIRE_FACTORS
from ddlscope.strategies.base import LossFn
from ddlscope.strategies.comm import LinkModel


def gradient_layers(model: nn.Module, loss_fn: LossFn, x: Tensor, y: Tensor, repeats: int = 3) -> list[Layer]:
    """Layers in gradient-ready order with their measured backward time (median of `repeats`) and grad bytes."""
    replica = copy.deepcopy(model)
    owner = {id(p): name or type(module).__name__ for name, module in replica.named_modules()
             for p in module.parameters(recurse=False) if p.requires_grad}
    params = [p for p in replica.parameters() if p.requires_grad]
    ready: dict[int, float] = {}

    def note_ready(p: Tensor) -> None:
        ready.setdefault(id(p), time.perf_counter())

    handles = [p.register_post_accumulate_grad_hook(note_ready) for p in params]
    runs: list[list[tuple[str, float, int]]] = []
    try:
        for _ in range(repeats):
            replica.zero_grad(set_to_none=True)
            ready.clear()
            loss = loss_fn(replica(x), y)
            began = time.perf_counter()
            loss.backward()
            runs.append(_layers_of_run(params, owner, ready, began))
    finally:
        for handle in handles:
            handle.remove()
    names = [name for name, _, _ in runs[0]]
    return [Layer(name, statistics.median(run[i][1] for run in runs), runs[0][i][2])
            for i, name in enumerate(names)]


def _layers_of_run(params: list[nn.Parameter], owner: dict[int, str], ready: dict[int, float],
                   began: float) -> list[tuple[str, float, int]]:
    """Group parameters by owning module in ready order: (name, time since the previous layer, bytes)."""
    layers: list[list[Any]] = []  # [name, ready_s, bytes]
    for p in sorted(params, key=lambda p: ready.get(id(p), float("inf"))):
        name = owner[id(p)]
        if layers and layers[-1][0] == name:
            layers[-1][1] = max(layers[-1][1], ready.get(id(p), layers[-1][1]))
            layers[-1][2] += p.numel() * p.element_size()
        else:
            layers.append([name, ready.get(id(p), began), p.numel() * p.element_size()])
    previous, out = began, []
    for name, ready_s, nbytes in layers:
        out.append((name, max(ready_s - previous, 0.0), nbytes))
        previous = max(previous, ready_s)
    return out


def link_alpha_beta(link: LinkModel, ranks: int) -> AlphaBeta:
    """The emulated link's all-reduce: alpha + wire bytes / bandwidth (what comm.py makes a message wait)."""
    return AlphaBeta(link.alpha_s, WIRE_FACTORS["all_reduce"](max(ranks, 2)) / link.bandwidth_bytes_per_s)


def probe_alpha_beta(group: Any = None, sizes_bytes: tuple[int, int] = (4096, 4 * 2**20),
                     repeats: int = 5) -> AlphaBeta:
    """Fit alpha-beta through the median all-reduce times of a small and a large payload (every rank calls it)."""
    medians = []
    for size in sizes_bytes:
        buffer = torch.zeros(size // 4)
        times = []
        for _ in range(repeats):
            dist.barrier(group=group)
            began = time.perf_counter()
            dist.all_reduce(buffer, group=group)
            times.append(time.perf_counter() - began)
        medians.append(statistics.median(times))
    beta = max(medians[1] - medians[0], 0.0) / (sizes_bytes[1] - sizes_bytes[0])
    return AlphaBeta(max(medians[0] - beta * sizes_bytes[0], 0.0), beta)


def bucket_caps_mb(bucket_bytes: list[int]) -> list[float]:
    """DDP's bucket_cap_mb_list for a plan: each bucket's exact bytes, in MiB (DDP multiplies by 2**20)."""
    return [b / 2**20 for b in bucket_bytes]


def same_on_every_rank(value: Any, group: Any = None) -> Any:
    """Rank 0's value everywhere: a plan from timings must not differ between ranks (DDP needs equal buckets)."""
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return box[0]
