"""Data-parallel strategy models for any workload: DDP, FSDP/ZeRO, parameter servers
(sync / async / SSP), local SGD and its overlapped variant (CoCoD), gradient compression.

The transformer 3D-parallel model lives in `model.py`; this module covers the
strategies of the main study (DDP vs FSDP vs PS on fast and slow clusters),
where a workload is just its parameter count, FLOPs per sample and
activation memory. Every function returns a `StrategyEstimate`.

Straggler model: worker i computes for c x slowdown_i, plus random jitter
with coefficient of variation `jitter_cv`. A synchronous step waits for the
slowest; the expected maximum of W normal draws is mu + sigma sqrt(2 ln W).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Sequence

import numpy as np

from ddlscope.predict import collectives as coll
from ddlscope.predict.catalogue import Cluster
from ddlscope.specs import ConfigError
from ddlscope.specs.strategies.ddp import QSGD_CHUNK, qsgd_code_bits


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


def _straggler_wait_s(c: float, workers: int, jitter_cv: float, window_steps: int = 1) -> float:
    """Expected extra wait for the slowest of `workers` draws; averaging over a window shrinks it by sqrt."""
    if workers <= 1 or jitter_cv <= 0:
        return 0.0
    return c * jitter_cv * math.sqrt(2 * math.log(workers)) / math.sqrt(window_steps)


def _slowdowns(workers: int, slowdowns: Sequence[float] | None) -> np.ndarray:
    if not slowdowns:
        return np.ones(workers)
    if len(slowdowns) != workers:
        raise ConfigError(f"slowdowns has {len(slowdowns)} entries; give one per worker ({workers})")
    return np.asarray(slowdowns, dtype=float)


def single_samples_per_s(workload: Workload, cluster: Cluster) -> float:
    """What one device alone trains per second: a strategy's speedup is over this."""
    return workload.batch_per_worker / compute_s(workload, cluster)


def single(workload: Workload, cluster: Cluster) -> StrategyEstimate:
    c = compute_s(workload, cluster)
    mem = (workload.params * workload.state_bytes_per_param
           + workload.activation_bytes_per_sample * workload.batch_per_worker)
    return StrategyEstimate("single", 1, c, c, 0.0, 0.0, mem, workload.batch_per_worker,
                            single_samples_per_s(workload, cluster))


def ddp(workload: Workload, cluster: Cluster, bucket_mb: float = 25.0, algorithm: coll.Algorithm = "auto",
        jitter_cv: float = 0.0, slowdowns: Sequence[float] | None = None,
        grad_bytes_per_param: float | None = None, extra_compute_s: float = 0.0,
        name: str = "ddp") -> StrategyEstimate:
    """Bucketed all-reduce of the gradients, each bucket launched as backward fills it (PyTorch DDP)."""
    n, g = cluster.n_gpus, cluster.gpus_per_node
    c = compute_s(workload, cluster) * float(_slowdowns(n, slowdowns).max())
    backward = workload.backward_fraction * c
    grad_bytes = workload.params * (grad_bytes_per_param or workload.grad_bytes_per_param)
    total = float(coll.all_reduce_s(grad_bytes, n, min(n, g), cluster.node, algorithm))
    latency = float(coll.all_reduce_s(0.0, n, min(n, g), cluster.node, algorithm))
    buckets = max(1, math.ceil(grad_bytes / (bucket_mb * 1e6)))
    exposed = float(coll.bucketed_overlap_exposed_s(total, latency, buckets, backward))
    wait = _straggler_wait_s(c, n, jitter_cv)
    step = c + extra_compute_s + exposed + wait
    mem = (workload.params * workload.state_bytes_per_param + 2 * bucket_mb * 1e6
           + workload.activation_bytes_per_sample * workload.batch_per_worker)
    return StrategyEstimate(name, n, step, c + extra_compute_s, total, exposed, mem, n * workload.batch_per_worker,
                            single_samples_per_s(workload, cluster))


def fsdp(workload: Workload, cluster: Cluster, zero_stage: int = 3, jitter_cv: float = 0.0,
         prefetch: bool = True) -> StrategyEstimate:
    """ZeRO / FSDP: parameters gathered before use (stage 3), gradients reduce-scattered, states sharded.

    Stage 3 gathers the weights for forward and again for backward, and
    reduce-scatters gradients (3 collectives of the 16-bit weights per step);
    with prefetch each overlaps the compute of the previous unit, so only
    what exceeds the compute shows.
    """
    if zero_stage not in (1, 2, 3):
        raise ConfigError(f"zero_stage = {zero_stage}: allowed: 1, 2, 3")
    n, g = cluster.n_gpus, cluster.gpus_per_node
    c = compute_s(workload, cluster)
    backward = workload.backward_fraction * c
    forward = c - backward
    units = max(workload.layers, 1)
    weight_bytes = workload.weight_bytes_per_param * workload.params
    # one collective per unit (layer): each pays its own latency
    gather = units * float(coll.all_gather_s(weight_bytes / units, n, min(n, g), cluster.node))
    scatter = units * float(coll.reduce_scatter_s(weight_bytes / units, n, min(n, g), cluster.node))
    if zero_stage == 3:
        comm = 2 * gather + scatter
        if prefetch:
            exposed = max(gather - forward, 0.0) + max(gather + scatter - backward, 0.0) + gather / units
        else:
            exposed = comm
    else:  # stages 1-2: reduce-scatter behind backward, all-gather of updated weights after the step
        comm = scatter + gather
        exposed = max(scatter - backward, 0.0) + gather
    step = c + exposed + _straggler_wait_s(c, n, jitter_cv)
    p, wb = workload.params, workload.weight_bytes_per_param
    optimizer = workload.state_bytes_per_param - 2 * wb
    states = {1: wb * p + wb * p + optimizer * p / n, 2: wb * p + (wb + optimizer) * p / n,
              3: workload.state_bytes_per_param * p / n}[zero_stage]
    buffers = 2 * weight_bytes / units if zero_stage == 3 else 0.0  # gathered units in flight
    mem = (states + buffers + workload.activation_bytes_per_sample * workload.batch_per_worker
          )
    return StrategyEstimate(f"fsdp-zero{zero_stage}", n, step, c, comm, exposed, mem, n * workload.batch_per_worker,
                            single_samples_per_s(workload, cluster))


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


def ps_exchange_s(workload: Workload, cluster: Cluster, server: ServerSpec, concurrent: float,
                  nbytes: float | None = None, servers: int | None = None, updates: float = 1.0) -> float:
    """One push and one pull of `nbytes` (default: the whole gradient) with `concurrent` clients on `servers`
    servers' links (default: all of them), plus the servers' `updates` optimizer steps over what they received
    (parameter_server's clients are workers; omnivore's, group leaders)."""
    grad_bytes = workload.params * workload.grad_bytes_per_param
    nbytes = grad_bytes if nbytes is None else nbytes
    servers = server.servers if servers is None else servers
    worker_bw = cluster.inter_bytes_per_s_per_gpu if cluster.nodes > 1 else cluster.intra_bytes_per_s
    server_bw, agg = server.link_gb_per_s * 1e9, server.aggregate_gb_per_s * 1e9
    push = coll.ps_push_s(nbytes, concurrent, servers, server_bw, agg, worker_bw, server.alpha_s)
    pull = coll.ps_pull_s(nbytes, concurrent, servers, server_bw, worker_bw, server.alpha_s)
    if not server.update_s:
        return float(push + pull)
    # each update steps the bytes it received; `servers` servers step their shares side by side
    return float(push + pull + updates * server.update_s * nbytes / grad_bytes / servers)


def parameter_server(workload: Workload, cluster: Cluster, mode: Literal["sync", "async", "ssp"] = "sync",
                     server: ServerSpec = ServerSpec(), staleness: int = 3, jitter_cv: float = 0.0,
                     slowdowns: Sequence[float] | None = None, block_cyclic: bool = False) -> StrategyEstimate:
    """Workers push gradients and pull weights through the servers' links and CPUs.

    sync: every step waits for the slowest worker, then all push and pull
    through the shared servers. async: each worker cycles on its own; the
    servers cap the total update rate. ssp: async bounded by `staleness`
    steps, so in the long run every worker runs at the slowest one's pace,
    but random jitter is absorbed over a window of staleness + 1 steps.
    block_cyclic (async only): each update exchanges one server's block
    (1/servers of the bytes) with that server alone; the servers share the
    updates, each hearing from workers / servers of them at a time.
    """
    if mode not in ("sync", "async", "ssp"):
        raise ConfigError(f"mode = {mode!r}: allowed: sync, async, ssp")
    if block_cyclic and mode != "async":
        raise ConfigError(f"block_cyclic is a ps-async knob, not for mode {mode!r}")
    w = cluster.n_gpus
    c_each = compute_s(workload, cluster) * _slowdowns(w, slowdowns)
    grad_bytes = workload.params * workload.grad_bytes_per_param

    def exchange_s(concurrent: float, nbytes: float = grad_bytes, servers: int = server.servers,
                   updates: float = 1.0) -> float:
        return ps_exchange_s(workload, cluster, server, concurrent, nbytes, servers, updates)

    mem = (workload.params * (workload.state_bytes_per_param - 8.0)  # optimizer moments live on the servers
           + workload.activation_bytes_per_sample * workload.batch_per_worker)
    if mode == "sync":
        c = float(c_each.max())
        comm = exchange_s(w)
        step = c + comm + _straggler_wait_s(c, w, jitter_cv)
        return StrategyEstimate("ps-sync", w, step, c, comm, comm, mem, w * workload.batch_per_worker,
                                single_samples_per_s(workload, cluster))
    if block_cyclic:
        block, per_server = grad_bytes / server.servers, max(w / server.servers, 1.0)
        alone = exchange_s(1, block, 1)
        capacity = server.servers / (exchange_s(per_server, block, 1, per_server) / per_server)
    else:
        alone = exchange_s(1)
        # the servers move push + pull of every update, sum every push and step every update
        capacity = 1.0 / (exchange_s(w, updates=w) / w)
    jitter = _straggler_wait_s(float(c_each.mean()), w, jitter_cv, window_steps=staleness + 1) if mode == "ssp" else 0.0
    cycles = c_each + alone
    if mode == "ssp":  # nobody gets more than `staleness` steps ahead: the slowest sets the pace
        cycles = np.full(w, float(cycles.max()) + jitter)
    rate = min(float(np.sum(1.0 / cycles)), capacity)
    step = w / rate  # mean time for every worker to finish one step
    staleness_steps = float(rate * np.mean(cycles) - 1.0)
    if mode == "ssp":
        staleness_steps = min(staleness_steps, float(staleness))
    est = StrategyEstimate(f"ps-{mode}", w, step, float(c_each.mean()), alone, max(step - float(c_each.mean()), 0.0),
                           mem, w * workload.batch_per_worker, single_samples_per_s(workload, cluster),
                           mean_staleness_steps=max(staleness_steps, 0.0))
    if rate >= capacity:
        est.notes.append("server-bound: the servers' links or CPUs cap the update rate")
    return est


def local_sgd(workload: Workload, cluster: Cluster, period: int = 8, overlap: bool = False,
              algorithm: coll.Algorithm = "auto") -> StrategyEstimate:
    """Average the weights every `period` local steps (local SGD / periodic averaging).

    overlap=True is CoCoD-SGD: the average runs while the next period's
    local steps compute, so only what exceeds `period` steps of compute shows.
    """
    if period < 1:
        raise ConfigError(f"period = {period}: must be >= 1")
    n, g = cluster.n_gpus, cluster.gpus_per_node
    c = compute_s(workload, cluster)
    average = float(coll.all_reduce_s(workload.params * 4.0, n, min(n, g), cluster.node, algorithm))
    exposed_per_period = max(average - period * c, 0.0) if overlap else average
    step = c + exposed_per_period / period
    mem = (workload.params * (workload.state_bytes_per_param + 4.0)  # + the copy being averaged
           + workload.activation_bytes_per_sample * workload.batch_per_worker)
    return StrategyEstimate("cocod" if overlap else "local-sgd", n, step, c, average / period,
                            exposed_per_period / period, mem, n * workload.batch_per_worker,
                            single_samples_per_s(workload, cluster))


def compressed_ddp(workload: Workload, cluster: Cluster, method: str = "fp16", ratio: float = 0.01, rank: int = 4,
                   bucket_mb: float = 25.0, levels: int = 4) -> StrategyEstimate:
    """DDP with gradient compression: fewer bytes on the wire, some compute to encode/decode.

    fp16 / bf16: half the bytes, one pass over the gradients. top-k (ratio k/n):
    values + int32 indices, all-gathered (sparse sums do not add up in place),
    selection costs a few passes. PowerSGD (rank r, Vogels et al. 2019): each
    d x d gradient becomes two d x r factors, all-reduced, at 4 d^2 r FLOPs
    per matrix. qsgd (s levels) and minmax8 (ByteGrad): codes of 2-8 bits per
    entry, all-gathered, and every rank decodes all n messages (n passes over
    the gradient): cheap on the wire, costly to decode at large n.
    """
    n, g = cluster.n_gpus, cluster.gpus_per_node
    dev = cluster.device
    mem_bw = dev.memory_bandwidth_bytes_per_s * dev.efficiency.memory_fraction
    p = workload.params
    if method in ("fp16", "bf16"):
        return ddp(workload, cluster, bucket_mb, grad_bytes_per_param=2.0, extra_compute_s=2 * 4 * p / mem_bw,
                   name=f"ddp-{method}")
    if method in ("topk", "qsgd", "minmax8"):
        if method == "topk" and not 0 < ratio <= 1:
            raise ConfigError(f"ratio = {ratio}: must be in (0, 1]")
        if method == "qsgd" and not 1 <= levels <= 127:
            raise ConfigError(f"levels = {levels}: must be in 1..127")
        bytes_per_param = {"topk": ratio * 8.0, "qsgd": qsgd_code_bits(levels) / 8 + 4 / QSGD_CHUNK,
                           "minmax8": 1.0}[method]
        encode_passes = {"topk": 4, "qsgd": 6, "minmax8": 4}[method]
        base = ddp(workload, cluster, bucket_mb, grad_bytes_per_param=1e-12, name=f"ddp-{method}")
        gathered = n * bytes_per_param * p  # every rank ends with everyone's messages
        comm = float(coll.all_gather_s(gathered, n, min(n, g), cluster.node))
        # encode: a few passes over the fp32 gradient; decode: every rank reads all n messages and adds them
        codec = encode_passes * 4 * p / mem_bw + n * (bytes_per_param + 8.0) * p / mem_bw
        step = base.compute_s + codec + comm  # the encoders need whole buckets: modelled as not overlapping
        return StrategyEstimate(f"ddp-{method}", n, step, base.compute_s + codec, comm, comm,
                                base.memory_bytes_per_gpu + 4 * p, n * workload.batch_per_worker,
                                single_samples_per_s(workload, cluster))
    if method == "powersgd":
        if rank < 1:
            raise ConfigError(f"rank = {rank}: must be >= 1")
        side = math.sqrt(p / workload.layers)
        factor_bytes_per_param = 4.0 * 2 * side * rank / (side * side)
        extra = 4 * side * side * rank * workload.layers / (dev.peak("fp32") * 0.5)
        return ddp(workload, cluster, bucket_mb, grad_bytes_per_param=factor_bytes_per_param, extra_compute_s=extra,
                   name=f"ddp-powersgd{rank}")
    raise ConfigError(f"method = {method!r}: allowed: fp16, bf16, topk, qsgd, minmax8, powersgd")

