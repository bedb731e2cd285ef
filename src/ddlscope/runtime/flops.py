"""Model FLOPs of one training step on one rank, and the peak FLOP/s that MFU divides by.

Counted once per rank before training, on the plain (not yet wrapped) model,
by the step profiler (runtime/profiler.py): one forward + backward on one
per-rank batch under torch.utils.flop_counter.FlopCounterMode, on a copy of
the model on the meta device, so training is unaffected.

Model FLOPs are what the algorithm needs; hardware FLOPs add what the
implementation recomputes (activation checkpointing: `workload.recompute`,
counted as the step runs it). Without recompute they are equal; both are
recorded so the distinction stays explicit. (A pipeline's per-stage
`strategy.recompute` is applied after the count and not in it.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ddlscope.runtime.profiler import StepProfile, profile_step
from ddlscope.workloads.base import LossFn


@dataclass(frozen=True)
class StepFlops:
    model_flops: int  # forward + backward of one per-rank batch
    hardware_flops: int  # model FLOPs + recomputation (workload.recompute)
    per_rank_batch: int
    counted_on: str  # "meta" or the device the copy ran on

    @classmethod
    def from_profile(cls, profile: StepProfile) -> "StepFlops":
        return cls(model_flops=profile.flops, hardware_flops=profile.hardware_flops, per_rank_batch=profile.batch,
                   counted_on=profile.counted_on)


def count_step_flops(model: nn.Module, loss_fn: LossFn, x: Tensor, y: Tensor) -> StepFlops:
    """FLOPs of forward + backward of `model` on (x, y), counted on a copy; `model` is left untouched."""
    return StepFlops.from_profile(profile_step(model, loss_fn, x, y))


def peak_flops(device: torch.device, threads: int) -> tuple[float, str]:
    """The FLOP/s one rank could at best achieve, and how it was obtained.

    CPU: this machine's best achieved fp32 matmul FLOP/s with the rank's
    threads, over a mid-sized and a large square matmul (the larger GEMM is
    usually the faster; taking the best of both keeps MFU's denominator a
    real upper bound for the workloads' GEMMs). CUDA: a large bf16 matmul.
    """
    if device.type == "cuda":
        return _cuda_matmul_flops(device), "measured bf16 matmul 8192^3"
    from ddlscope.runtime.emulation import measure_matmul_flops

    best = max(measure_matmul_flops(threads), measure_matmul_flops(threads, size=1024, repeats=4))
    return best, f"measured fp32 matmul (best of 384^3, 1024^3), {threads} thread(s)"


def _cuda_matmul_flops(device: torch.device, size: int = 8192, repeats: int = 10) -> float:
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    best_s = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        torch.cuda.synchronize(device)
        best_s = min(best_s, time.perf_counter() - start)
    del a, b
    torch.cuda.empty_cache()
    return 2 * size**3 / best_s


def flops_message(step: StepFlops, peak: float, peak_source: str) -> str:
    return (f"model_flops_per_step={step.model_flops} hardware_flops_per_step={step.hardware_flops} "
            f"per_rank_batch={step.per_rank_batch} peak_flops_per_s={peak:.6g} counted_on={step.counted_on} "
            f"peak_source={peak_source.replace(' ', '_')}")


def parse_flops_message(message: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in message.split() if "=" in part)


def gpt_closed_form_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Narayanan et al. (2021): FLOPs of forward + backward of a GPT, no recomputation."""
    return 72 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
