"""Heterogeneity-aware batching, torch-free: how a global batch is split over workers of unequal speed.

Hogbatch (PAPERS.md item 1) gives each worker a batch proportional to its
speed; DBS (item 3, `dbs`) re-sets those batches from measured throughput.
Both keep the global batch and its gradient exact: worker r's mean-loss
gradient is weighted by its share, b_r * workers / B, so the average the
collective (or the server) takes over workers is the mean over the B samples.

`split_batch` is the one split rule; the runtime (strategies/batching.py),
the estimators and the docs read it. `HeteroBatchKnobs` is the knob block
that `ddp` and the parameter-server strategies share.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Sequence

from pydantic import Field, field_validator

from ddlscope.specs.base import ConfigError
from ddlscope.specs.strategy import StrategySpec


def split_batch(total: int, speeds: Sequence[float]) -> list[int]:
    """`total` samples split in proportion to `speeds`, every worker at least one, summing to `total`.

    Largest remainder rounding, ties to the lower rank, so every rank computes the same split from
    the same speeds.
    """
    n = len(speeds)
    if n == 0 or total < n:
        raise ValueError(f"cannot split {total} samples over {n} workers with at least one each")
    if any(not math.isfinite(s) or s <= 0 for s in speeds):
        raise ValueError(f"speeds must be positive and finite, got {list(speeds)}")
    ideal = [total * s / sum(speeds) for s in speeds]
    sizes = [max(1, math.floor(x)) for x in ideal]
    while sum(sizes) < total:  # hand out the remainder: largest shortfall first
        r = max(range(n), key=lambda i: (ideal[i] - sizes[i], -i))
        sizes[r] += 1
    while sum(sizes) > total:  # the minimum of one took too much: from whoever is most over
        r = max((i for i in range(n) if sizes[i] > 1), key=lambda i: (sizes[i] - ideal[i], -i))
        sizes[r] -= 1
    return sizes


def balanced_split(total: int, overhead_s: Sequence[float], per_sample_s: Sequence[float]) -> list[int]:
    """The split that gives every worker the same compute time when worker r takes overhead_s[r] +
    per_sample_s[r] x b_r for b_r samples (at least one each), rounded by `split_batch`.

    With no overhead this is the throughput-proportional split of DBS (b_r ~ 1 / per_sample_s[r]); an
    overhead keeps a slow worker's share from collapsing when a smaller batch does not make it faster.
    """
    n = len(per_sample_s)
    if any(not math.isfinite(c) or c <= 0 for c in per_sample_s) or any(
            not math.isfinite(a) or a < 0 for a in overhead_s):
        raise ValueError(f"per-sample times must be positive and overheads >= 0, got {list(per_sample_s)}, "
                         f"{list(overhead_s)}")
    floor = [False] * n  # workers held at one sample: their time is above the common one
    while True:
        free = [r for r in range(n) if not floor[r]]
        left = total - (n - len(free))
        common_s = (left + sum(overhead_s[r] / per_sample_s[r] for r in free)) / sum(1 / per_sample_s[r] for r in free)
        ideal = [1.0 if floor[r] else (common_s - overhead_s[r]) / per_sample_s[r] for r in range(n)]
        below = [r for r in free if ideal[r] < 1.0]
        if not below:
            return split_batch(total, ideal)
        for r in below:
            floor[r] = True


def step_slowdowns(slowdowns: Sequence[float], speeds: Sequence[float] | None) -> list[float]:
    """Each worker's compute time per step relative to an equal split's homogeneous one, when it gets a
    share of the batch proportional to `speeds` (None: an equal share) and computes `slowdowns` times
    slower: workers x share x slowdown. The estimators price a split batch with these."""
    n = len(slowdowns)
    if speeds is None or len(speeds) != n:
        return list(slowdowns)
    return [n * v / sum(speeds) * s for v, s in zip(speeds, slowdowns)]


BatchSplit = Literal["equal", "declared", "cluster"]


MAX_WORKER_SPEED = 1e9


class HeteroBatchKnobs(StrategySpec):
    """Static heterogeneity-aware batching (Hogbatch): each worker's batch from a speed."""

    # -- heterogeneity-aware batching (specs/strategies/batching.py) -----------------------------
    batch_split: BatchSplit = Field(
        "equal", description="equal: batch_size / workers each; declared: in proportion to worker_speeds; "
                             "cluster: in proportion to 1 / cluster.slowdown (the declared straggler profile). "
                             "Gradients are weighted by each worker's share, so the global batch stays exact")
    worker_speeds: list[float] = Field(
        default_factory=list, description="relative speed of each worker (samples/s, any unit), one per worker; "
                                          "read with batch_split = declared")

    @field_validator("worker_speeds")
    @classmethod
    def _positive_speeds(cls, speeds: list[float]) -> list[float]:
        if any(not math.isfinite(s) or s <= 0 for s in speeds):
            raise ValueError(f"worker speeds must be positive, got {speeds}")
        # Relative speeds, so any unit; past 1e9 their sum (the split's denominator) can overflow, and no
        # worker processes a billion samples a second.
        if any(s > MAX_WORKER_SPEED for s in speeds):
            raise ValueError(f"worker speeds must be at most {MAX_WORKER_SPEED:g} (they are relative: scale them "
                             f"down), got {speeds}")
        return speeds

    def declared_speeds(self, slowdowns: Sequence[float]) -> list[float] | None:
        """The speeds the static split follows (None: an equal split), given the workers' slowdowns."""
        if self.batch_split == "declared":
            return list(self.worker_speeds)
        if self.batch_split == "cluster" and slowdowns:
            return [1.0 / s for s in slowdowns]
        return None

    def check_experiment(self, exp: Any) -> None:
        super().check_experiment(exp)
        workers = exp.cluster.world_size
        if self.batch_split != "declared" and self.worker_speeds:
            raise ConfigError(f"strategy.worker_speeds is read only with batch_split = \"declared\" "
                              f"(batch_split = {self.batch_split!r}); set batch_split = \"declared\" or drop it")
        if self.batch_split == "declared" and len(self.worker_speeds) != workers:
            raise ConfigError(f"strategy.worker_speeds has {len(self.worker_speeds)} entries: batch_split = "
                              f"\"declared\" needs one per worker ({workers})")
