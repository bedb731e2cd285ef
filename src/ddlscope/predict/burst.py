"""Burst parallelism (DeepPool, PAPERS.md item 8): a data-parallel degree per unit of a CNN.

Uniform data parallelism runs every layer on all N GPUs. Layers differ in how
they scale: a convolution with a large activation keeps N GPUs busy, a fully
connected layer with many parameters and little compute spends more on its
gradient all-reduce than it saves in compute. Burst parallelism gives each
unit (`cnn.Layer.unit`: a residual block, a dense layer, a conv, the
classifier) its own degree d_l: the global batch B is split over d_l GPUs
while that unit runs, and the other N - d_l GPUs are free for a background
job (DeepPool multiplexes one onto them).

From the predictor's per-unit costs (`cnn.unit_times_s`, the same kernel model
as `predict`), for a unit on d GPUs:

    t_l(d)       = forward_l(B / d) + backward_l(B / d) + all-reduce of its fp32 gradients over d GPUs
    switch(d, d') = 2 p2p(B / min(d, d') x (1 - min(d, d') / max(d, d')) x the previous unit's output bytes)
                   (activations re-split forward, their gradients backward; nothing when d = d')
    step          = sum_l t_l(d_l) + sum_l switch(d_{l-1}, d_l)
    busy          = sum_l d_l t_l(d_l) + sum_l max(d_{l-1}, d_l) switch(d_{l-1}, d_l)   (GPU-seconds)

The all-reduces are priced exposed (after the unit's backward, as DeepPool's
layer-wise model does), for uniform and burst alike; DDP's overlapped step is
reported beside them (`ddp_step_s`). Degrees are the divisors of N that divide B,
GPUs of one group adjacent (inside a node when d <= GPUs per node).

The search is exact: dynamic programming over the units (the state is the
previous unit's degree) minimising step + w busy / N, for weights w on a grid;
w = 0 is the fastest plan, larger w trade step time for freed GPUs. Cluster
throughput, normalised so that uniform data parallelism is 1: the job's
throughput relative to uniform, plus the background job's work on the freed
GPU-seconds as a fraction of the whole cluster, at `background_efficiency`
(1: the background job uses a freed GPU-second fully; DeepPool's multiplexing
loses some).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ddlscope.predict import cnn
from ddlscope.predict import collectives as coll
from ddlscope.predict.catalogue import Cluster
from ddlscope.predict.cnn import CNNSpec
from ddlscope.specs import ConfigError
from ddlscope.specs.strategies.ddp import DDPSpec

GRAD_BYTES_PER_PARAM = 4.0  # fp32 gradients (AMP keeps them fp32)
# Weights of busy GPU-seconds against step time tried by the search (0: the fastest plan).
BUSY_WEIGHTS = (0.0, *np.geomspace(0.01, 10.0, 31).tolist())


@dataclass(frozen=True)
class BurstCosts:
    """Per unit and degree: its time (`unit_s[l, j]` on `degrees[j]` GPUs) and the switch into it from
    the previous unit's degree (`switch_s[l, i, j]`; the first unit's row is zero: the input loads there)."""

    degrees: np.ndarray
    unit_s: np.ndarray
    switch_s: np.ndarray
    gpus: int

    def step_and_busy(self, choice: np.ndarray) -> tuple[float, float]:
        """(step seconds, busy GPU-seconds) of a plan given as one degree index per unit."""
        d = self.degrees[choice]
        units = np.arange(len(choice))
        times = self.unit_s[units, choice]
        switches = self.switch_s[units[1:], choice[:-1], choice[1:]]
        step = float(times.sum() + switches.sum())
        busy = float((d * times).sum() + (np.maximum(d[:-1], d[1:]) * switches).sum())
        return step, busy


def degrees_for(gpus: int, global_batch: int) -> np.ndarray:
    """The data-parallel degrees a unit may take: divisors of the GPU count that divide the batch."""
    return np.array([d for d in range(1, gpus + 1) if gpus % d == 0 and global_batch % d == 0])


def burst_costs(spec: CNNSpec, cluster: Cluster) -> BurstCosts:
    """Every unit's time on every degree, and every switch between degrees, from the CNN model."""
    n, g, node = cluster.n_gpus, cluster.gpus_per_node, cluster.node
    degrees = degrees_for(n, spec.global_batch)
    forward, backward = cnn.unit_times_s(spec, spec.global_batch / degrees, cluster.device)
    grad_bytes = cnn.unit_params(spec)[:, None] * GRAD_BYTES_PER_PARAM
    per_node = np.minimum(degrees, g)
    sync = np.where(degrees > 1, coll.all_reduce_s(grad_bytes, degrees, per_node, node), 0.0)
    unit_s = forward + backward + sync
    out_bytes = cnn.unit_output_elements(spec) * spec.activation_bytes  # per sample
    low, high = np.minimum.outer(degrees, degrees), np.maximum.outer(degrees, degrees)
    moved_samples = spec.global_batch / low * (1.0 - low / high)  # what the busiest GPU sends or receives
    across = high > g
    switch = np.zeros((len(unit_s), len(degrees), len(degrees)))
    for l in range(1, len(unit_s)):
        one_way = coll.p2p_s(moved_samples * out_bytes[l - 1], across, node)
        switch[l] = np.where(low == high, 0.0, 2.0 * one_way)
    return BurstCosts(degrees, unit_s, switch, n)


def best_plan(costs: BurstCosts, busy_weight: float = 0.0) -> np.ndarray:
    """The degree index per unit minimising step + busy_weight x busy / N, exactly (dynamic programming
    over the units; the state is the previous unit's degree)."""
    d = costs.degrees.astype(float)
    scale = busy_weight / costs.gpus
    unit = costs.unit_s * (1.0 + scale * d[None, :])
    switch = costs.switch_s * (1.0 + scale * np.maximum.outer(d, d))[None, :, :]
    best = unit[0].copy()
    came_from = np.zeros(costs.unit_s.shape, dtype=int)
    for l in range(1, len(unit)):
        through = best[:, None] + switch[l]  # [previous degree, this degree]
        came_from[l] = np.argmin(through, axis=0)
        best = through[came_from[l], np.arange(len(d))] + unit[l]
    choice = np.zeros(len(unit), dtype=int)
    choice[-1] = int(np.argmin(best))
    for l in range(len(unit) - 1, 0, -1):
        choice[l - 1] = came_from[l, choice[l]]
    return choice


@dataclass
class BurstPlan:
    label: str
    degrees: list[int]  # per unit
    step_s: float
    busy_gpu_s: float
    speedup_vs_uniform: float = 1.0
    freed_fraction: float = 0.0  # of the cluster's GPU-seconds in a step
    cluster_throughput: float = 1.0  # normalised: uniform data parallelism = 1


@dataclass
class BurstResult:
    model: str
    cluster: str
    global_batch: int
    units: int
    background_efficiency: float
    uniform: BurstPlan
    fastest: BurstPlan
    best_cluster: BurstPlan  # the plan of highest cluster throughput among the searched weights (within max_slowdown)
    max_slowdown: float = 1.0
    ddp_step_s: float | None = None  # `predict`'s DDP step (gradient all-reduce overlapped), for scale
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        from dataclasses import asdict
        return asdict(self)


def _plan(label: str, costs: BurstCosts, choice: np.ndarray, uniform_step_s: float, efficiency: float) -> BurstPlan:
    step, busy = costs.step_and_busy(choice)
    freed = 1.0 - busy / (costs.gpus * step)
    return BurstPlan(label, [int(x) for x in costs.degrees[choice]], step, busy, uniform_step_s / step, freed,
                     uniform_step_s / step + efficiency * freed)


def burst(spec: CNNSpec, cluster: Cluster, background_efficiency: float = 1.0,
          max_slowdown: float = 1.0) -> BurstResult:
    """Uniform data parallelism, the fastest burst plan, and the plan of highest cluster throughput among
    those whose step is at most `max_slowdown` x uniform's (1: the job itself must not slow down)."""
    if not 0 <= background_efficiency <= 1:
        raise ConfigError(f"background_efficiency = {background_efficiency}: must be between 0 and 1")
    if not 1 <= max_slowdown <= 100:
        raise ConfigError(f"max_slowdown = {max_slowdown}: must be between 1 and 100")
    cnn.validate_cnn(spec)
    if spec.global_batch % cluster.n_gpus:
        raise ConfigError(f"global_batch = {spec.global_batch}: must be divisible by the cluster's "
                          f"{cluster.n_gpus} GPUs (uniform data parallelism is the reference)")
    costs = burst_costs(spec, cluster)
    uniform_choice = np.full(costs.unit_s.shape[0], len(costs.degrees) - 1)
    uniform_step, _ = costs.step_and_busy(uniform_choice)
    uniform = _plan("uniform", costs, uniform_choice, uniform_step, background_efficiency)
    plans = [_plan(f"burst (w={w:.3g})", costs, best_plan(costs, w), uniform_step, background_efficiency)
             for w in BUSY_WEIGHTS]
    fastest = plans[0]
    fastest.label = "burst, fastest"
    allowed = [p for p in plans if p.step_s <= uniform_step * max_slowdown * (1 + 1e-9)] or [fastest]
    best_cluster = max(allowed, key=lambda p: p.cluster_throughput)
    result = BurstResult(spec.name, str(cluster), spec.global_batch, len(uniform.degrees), background_efficiency,
                         uniform, fastest, best_cluster, max_slowdown)
    result.ddp_step_s = _ddp_step_s(spec, cluster)
    result.notes.append("gradient all-reduces priced exposed, after each unit's backward, for uniform and burst "
                        "alike; DDP overlaps them with backward (ddp_step_s)")
    result.notes.append("activations of a unit on fewer GPUs grow by N / d per GPU: memory is not checked here")
    return result


def _ddp_step_s(spec: CNNSpec, cluster: Cluster) -> float | None:
    """`predict`'s DDP step on the whole cluster at one micro-batch per GPU (None when it does not apply)."""
    from ddlscope.predict.cnn_predict import predict_cnn
    from ddlscope.predict.specs import ParallelSpec

    n = cluster.n_gpus
    try:
        return predict_cnn(spec, ParallelSpec(dp=n, micro_batch=spec.global_batch // n), cluster,
                           DDPSpec.registered_name).step_time_s
    except ConfigError:
        return None


def degree_runs(degrees: list[int]) -> str:
    """Per-unit degrees as runs: `units 0-12: 16, unit 13: 8, units 14-15: 1`."""
    runs: list[tuple[int, int, int]] = []
    for unit, d in enumerate(degrees):
        if runs and runs[-1][2] == d:
            runs[-1] = (runs[-1][0], unit, d)
        else:
            runs.append((unit, unit, d))
    return ", ".join(f"units {a}-{b}: {d}" if b > a else f"unit {a}: {d}" for a, b, d in runs)
