"""Pipeline arithmetic: the schedules' bubble and in-flight micro-batches, and an exact partitioner.

Torch-free. A model is a sequence of layers, each with a measured (or
modelled) forward and backward time per micro-batch, parameter bytes and
activation bytes per micro-batch (the step profiler's per-layer profile,
runtime/profiler.py). A plan cuts the sequence into p contiguous stages and
chooses, per stage, whether to recompute its activations in backward.

Per stage s, one micro-batch (REFERENCE.md, Korthikanti et al. 2022):

    time_s(s)    = sum forward + sum backward (+ sum forward again if recomputed)
    memory(s)    = parameter bytes x state_factor (weights, gradients, optimizer state)
                   + in_flight(s) x activations(s)  (recomputed: only the stage's input is kept
                   per micro-batch in flight, plus one micro-batch's activations while it backs up)

where in_flight(s) = m for GPipe and min(m, p - s) for 1F1B (stage s starts
p - s forwards before its first backward). The search minimises the slowest
stage's time subject to every stage fitting its memory limit, exactly: a
dynamic program over (layers placed, stages used) keeps, for each prefix,
the smallest possible slowest-stage time; the choice for a stage depends only
on its own layers, its index and the option, so the DP is exact (checked
against brute force in tests/test_partition.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

# Qi et al. 2024 (zero bubble, ZB-H1): splitting backward into its input and weight halves fills
# about two thirds of 1F1B's bubble when forward, input-backward and weight-backward take equal time.
ZERO_BUBBLE_SHARE = 1.0 / 3.0


def bubble_fraction(stages: int, micro_batches: int, chunks: int = 1, schedule: str = "1f1b") -> float:
    """Idle time over compute time of a balanced pipeline (REFERENCE.md): GPipe and 1F1B (p - 1) / m;
    interleaved 1F1B with v chunks per stage (p - 1) / (m v); zero-bubble a third of interleaved's."""
    fraction = (stages - 1) / (micro_batches * chunks)
    return fraction * ZERO_BUBBLE_SHARE if schedule == "zero-bubble" else fraction


def stage_bubbles(schedule: str, forward_s: Sequence[float], backward_s: Sequence[float], micro_batches: int,
                  waits: int = 0, per_wait_s: float = 0.0) -> list[float]:
    """Each rank's idle over compute for one stage per rank (GPipe, 1F1B) from its measured times.

    (p - 1)/m holds for equal stages. Given each rank's forward and backward seconds per step (the
    last stage's forward includes the loss), this plays torch's action order out with those times
    per micro-batch (predict/schedule_sim.py): a faster stage waits for a slower one at every
    micro-batch, so its idle grows with m by m x the difference, on top of the fill and drain. Each
    rank also pays `waits` blocking waits a step at `per_wait_s` each (a measured transfer), 0 by default.
    """
    from ddlscope.predict.schedule_sim import simulate, single_stage_orders

    p, m = len(forward_s), micro_batches
    per_action = {"F": [f / m for f in forward_s], "B": [b / m for b in backward_s]}
    timeline = simulate(single_stage_orders(schedule, p, m), lambda a: per_action[a[0]][a[1]], p)
    return [(timeline.makespan_s - timeline.busy_s[r] + waits * per_wait_s) / timeline.busy_s[r] for r in range(p)]


def in_flight(stage: int, stages: int, micro_batches: int, schedule: str = "1f1b") -> int:
    """Micro-batches whose activations stage `stage` (0-based) holds at its peak, one chunk per rank:
    GPipe all m; 1F1B the p - stage it forwards before its first backward (REFERENCE.md)."""
    if schedule == "gpipe":
        return micro_batches
    return min(micro_batches, stages - stage)


@dataclass(frozen=True)
class Layer:
    """One layer's cost for one micro-batch."""

    forward_s: float
    backward_s: float
    param_bytes: float
    activation_bytes: float  # saved for backward, one micro-batch
    input_bytes: float = 0.0  # the layer's input (what a recomputed stage keeps per micro-batch)
    name: str = ""


@dataclass(frozen=True)
class StagePlan:
    start: int
    stop: int  # exclusive
    recompute: bool
    time_s: float
    memory_bytes: float


@dataclass(frozen=True)
class Plan:
    stages: list[StagePlan] = field(default_factory=list)

    @property
    def cuts(self) -> list[int]:
        return [s.start for s in self.stages[1:]]

    @property
    def slowest_s(self) -> float:
        return max(s.time_s for s in self.stages)

    @property
    def fullest_bytes(self) -> float:
        return max(s.memory_bytes for s in self.stages)


def stage_cost(layers: Sequence[Layer], start: int, stop: int, index: int, stages: int, micro_batches: int,
               recompute: bool, schedule: str = "1f1b", state_bytes_per_param_byte: float = 3.0) -> StagePlan:
    """Time per micro-batch and peak memory of layers[start:stop] as stage `index` of `stages`.

    `state_bytes_per_param_byte`: weights + gradients + optimizer state per weight byte (SGD 2,
    momentum 3, Adam 4)."""
    part = layers[start:stop]
    forward = sum(l.forward_s for l in part)
    backward = sum(l.backward_s for l in part)
    acts = sum(l.activation_bytes for l in part)
    held = in_flight(index, stages, micro_batches, schedule)
    if recompute:
        # the stage's input per micro-batch in flight, and one micro-batch rebuilt during its backward
        activations = held * part[0].input_bytes + acts
        time_s = 2 * forward + backward
    else:
        activations = held * acts
        time_s = forward + backward
    params = sum(l.param_bytes for l in part) * state_bytes_per_param_byte
    return StagePlan(start, stop, recompute, time_s, params + activations)


def partition(layers: Sequence[Layer], stages: int, micro_batches: int, memory_limit_bytes: float,
              schedule: str = "1f1b", allow_recompute: bool = True,
              state_bytes_per_param_byte: float = 3.0) -> Plan | None:
    """The plan with the smallest slowest-stage time whose every stage fits `memory_limit_bytes`
    (ties: the smaller fullest stage), or None when none fits.

    best[k][i]: the best (slowest time, fullest memory, plan) placing layers[:i] on stages 0..k-1.
    O(stages x layers^2 x options) stage costs.
    """
    n = len(layers)
    if stages < 1 or stages > n:
        return None
    options = (False, True) if allow_recompute else (False,)
    inf = (math.inf, math.inf)
    best: list[list[tuple[float, float]]] = [[inf] * (n + 1) for _ in range(stages + 1)]
    choice: list[list[StagePlan | None]] = [[None] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, stages + 1):
        # stage k-1 ends at i; at least one layer per stage, and enough layers left for the rest
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                before = best[k - 1][j]
                if before[0] == math.inf:
                    continue
                for recompute in options:
                    cost = stage_cost(layers, j, i, k - 1, stages, micro_batches, recompute, schedule,
                                      state_bytes_per_param_byte)
                    if cost.memory_bytes > memory_limit_bytes:
                        continue
                    value = (max(before[0], cost.time_s), max(before[1], cost.memory_bytes))
                    if value < best[k][i]:
                        best[k][i], choice[k][i] = value, cost
    if best[stages][n][0] == math.inf:
        return None
    plan: list[StagePlan] = []
    i = n
    for k in range(stages, 0, -1):
        stage = choice[k][i]
        assert stage is not None
        plan.append(stage)
        i = stage.start
    return Plan(plan[::-1])


def plan_of_cuts(layers: Sequence[Layer], cuts: Sequence[int], micro_batches: int, schedule: str = "1f1b",
                 recompute: Sequence[bool] | None = None, state_bytes_per_param_byte: float = 3.0) -> Plan:
    """A given partition (cut points where stages 1.. start), priced the same way."""
    bounds = [0, *cuts, len(layers)]
    stages = len(bounds) - 1
    flags = list(recompute) if recompute is not None else [False] * stages
    return Plan([stage_cost(layers, a, b, k, stages, micro_batches, flags[k], schedule, state_bytes_per_param_byte)
                 for k, (a, b) in enumerate(zip(bounds, bounds[1:]))])


def pipeline_step_s(rank_times_s: Sequence[float], micro_batches: int, chunks: int = 1,
                    schedule: str = "1f1b") -> float:
    """Step time of the schedule given each rank's compute per micro-batch (its chunks together): the
    slowest rank's m micro-batches plus the bubble, (m + (p - 1) / v) t (predict/model.py's pipeline term)."""
    slowest = max(rank_times_s)
    return micro_batches * slowest * (1 + bubble_fraction(len(rank_times_s), micro_batches, chunks, schedule))
