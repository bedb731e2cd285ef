"""What every estimator prices a data-parallel step with: the workload, the estimate, the mechanics.

A workload here is what one worker computes and communicates per step (its
parameter count, FLOPs per sample and activation memory; `image_workload`:
the main study's convnets). Each strategy's formula lives in its own
estimator (predict/estimators/<strategy>.py) and returns a
`StrategyEstimate`; this module holds only what they share: a worker's
compute, the straggler model and the parameter servers' description.

Straggler model: worker i computes for c x slowdown_i, plus random jitter
with coefficient of variation `jitter_cv`. A synchronous step waits for the
slowest; the expected maximum of W normal draws is mu + sigma sqrt(2 ln W).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ddlscope.predict.catalogue import Cluster
from ddlscope.specs import ConfigError


@dataclass(frozen=True)
class Workload:
    """What one worker computes and communicates per step.

    `flops_per_sample`: forward + backward (about 3x the forward).
    `dtype`: of weights and activations; "fp32" computes at the TF32 peak
    where the device has one (PyTorch runs cuDNN convolutions in TF32 by
    default). `achieved_fraction`: of that peak; convnets typically reach
    0.3-0.5.
    """

    name: str
    params: float
    flops_per_sample: float
    batch_per_worker: int
    activation_bytes_per_sample: float
    dtype: str = "fp32"
    grad_bytes_per_param: float = 4.0  # DDP reduces fp32 gradients unless a compression hook is set
    state_bytes_per_param: float = 16.0  # weights + gradients + Adam moments (fp32: 4 + 4 + 8; mixed: 2 + 2 + 12)
    achieved_fraction: float = 0.4
    layers: int = 50  # weight tensors (FSDP units; PowerSGD's matrices)
    # share of compute_s that gradient communication can hide behind: the backward (2/3 of a step
    # whose backward is twice its forward); with gradient accumulation only the last micro-batch's
    backward_fraction: float = 2.0 / 3.0

    @property
    def weight_bytes_per_param(self) -> float:
        return 4.0 if self.dtype == "fp32" else 2.0

    @property
    def compute_dtype(self) -> str:
        return "tf32" if self.dtype == "fp32" else self.dtype


def image_workload(name: str, batch_per_worker: int = 64, dtype: str = "fp32", resolution: int = 224) -> Workload:
    """Convnets of the main study (torchvision model cards: parameters, forward GFLOPs per 224x224 image).

    FLOPs and activations scale with the pixel count, so `resolution=32` is
    the CIFAR-10 setting (weights unchanged).
    """
    table = {  # params, forward GFLOPs (multiply-adds x 2), activation MB per image (fp16, rough)
        "resnet50": (25.6e6, 8.2, 100.0, 54),
        "resnet101": (44.5e6, 15.6, 150.0, 105),
        "inception_v3": (23.8e6, 11.5, 120.0, 96),
        "vgg16": (138.4e6, 31.0, 120.0, 16),
        "densenet121": (8.0e6, 5.7, 150.0, 121),
        "convnext_large": (197.8e6, 68.7, 250.0, 100),
    }
    if name not in table:
        raise ConfigError(f"workload = {name!r}: allowed: {', '.join(sorted(table))}")
    params, gflops_forward, act_mb, layers = table[name]
    pixels = (resolution / 224) ** 2
    act_scale = 2.0 if dtype == "fp32" else 1.0
    return Workload(name=name, params=params, flops_per_sample=3 * gflops_forward * 1e9 * pixels,
                    batch_per_worker=batch_per_worker, activation_bytes_per_sample=act_mb * 1e6 * pixels * act_scale,
                    dtype=dtype, layers=layers)


@dataclass
class StrategyEstimate:
    """One strategy's step. Throughput, speedup and scaling efficiency are derived from the fields, so
    an estimator that changes the step (a bucket plan, a straggler, a round of several models) changes
    only the step and what it is made of."""

    strategy: str
    workers: int
    step_s: float
    compute_s: float
    comm_s: float  # a worker's own exchange: time on the wire
    # what a step waits for communication beyond compute: the wire time not hidden behind it, and
    # for asynchronous servers also the queue for a busy server (so it can exceed comm_s)
    exposed_comm_s: float
    memory_bytes_per_gpu: float  # allocator peak (torch.cuda.max_memory_allocated's view: no CUDA context)
    samples_per_step: float  # samples all workers finish in step_s (asynchronous: one step of each)
    single_samples_per_s: float = 0.0  # one device training alone, what speedup compares with (0: unknown)
    mean_staleness_steps: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def samples_per_s(self) -> float:
        return self.samples_per_step / self.step_s

    @property
    def speedup_vs_single(self) -> float:
        return self.samples_per_s / self.single_samples_per_s if self.single_samples_per_s else 0.0

    @property
    def scaling_efficiency(self) -> float:
        return self.speedup_vs_single / self.workers


def compute_s(workload: Workload, cluster: Cluster) -> float:
    peaks = cluster.device.peak_flops
    peak = peaks.get(workload.compute_dtype) or cluster.device.peak(workload.dtype)
    return workload.batch_per_worker * workload.flops_per_sample / (peak * workload.achieved_fraction)


def straggler_wait_s(c: float, workers: int, jitter_cv: float, window_steps: int = 1) -> float:
    """Expected extra wait for the slowest of `workers` draws; averaging over a window shrinks it by sqrt."""
    if workers <= 1 or jitter_cv <= 0:
        return 0.0
    return c * jitter_cv * math.sqrt(2 * math.log(workers)) / math.sqrt(window_steps)


def worker_slowdowns(workers: int, slowdowns: Sequence[float] | None) -> np.ndarray:
    if not slowdowns:
        return np.ones(workers)
    if len(slowdowns) != workers:
        raise ConfigError(f"slowdowns has {len(slowdowns)} entries; give one per worker ({workers})")
    return np.asarray(slowdowns, dtype=float)


def single_samples_per_s(workload: Workload, cluster: Cluster) -> float:
    """What one device alone trains per second: a strategy's speedup is over this."""
    return workload.batch_per_worker / compute_s(workload, cluster)


@dataclass(frozen=True)
class ServerSpec:
    """Parameter servers: how many, their NIC, and how fast their CPUs sum gradients.

    `aggregate_gb_per_s`: gradient bytes per second one server's CPU can add
    into the model (memory-bandwidth-bound fp32 adds on a few cores: a few
    GB/s; "model aggregation without a CPU-bound parameter server" is about
    this term dominating).
    """

    servers: int = 1
    link_gb_per_s: float = 12.5
    aggregate_gb_per_s: float = 5.0
    alpha_s: float = 50e-6
    # the servers' optimizer step over the whole model (CPU memory-bound), once per update
    update_s: float = 0.0
