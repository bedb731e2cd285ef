"""Heterogeneity-aware batching at run time: a worker's slice of the global batch, and its gradient weight.

The split rule and the knobs are torch-free (specs/strategies/batching.py).
A strategy that mixes `SplitBatch` in takes `sizes[rank]` samples of each
step's global batch (runtime/data.py: the ranks' slices are contiguous and
cover the global batch exactly, from (seed, step) alone) and multiplies its
mean loss by sizes[rank] * workers / batch before backward. The collective or
the server then averages over workers as usual, and the result is the mean
gradient over the global batch: the same update as one process on it.
"""

from __future__ import annotations

from typing import Any

import torch

from ddlscope.specs.strategies.batching import HeteroBatchKnobs, split_batch
from ddlscope.strategies.base import RunContext, Strategy


class SplitBatch(Strategy):
    """Static split from declared speeds (Hogbatch); `current_split` may change it (dbs)."""

    spec: HeteroBatchKnobs

    def __init__(self, spec: HeteroBatchKnobs, ctx: RunContext):
        super().__init__(spec, ctx)
        exp = ctx.experiment
        speeds = spec.declared_speeds(exp.cluster.slowdown)
        # None: the equal split every data-parallel strategy takes (and loss weight 1).
        self.batch_sizes: list[int] | None = split_batch(exp.workload.batch_size, speeds) if speeds else None
        self._weight = 1.0

    def current_split(self, step: int, dataset_len: int) -> list[int] | None:
        """Every worker's batch at `step` (None: equal); called by every worker at every step, in order."""
        return self.batch_sizes

    def picks_samples(self) -> bool:
        return self.batch_sizes is not None  # equal speeds: the plain slice, any data pipeline

    def batch_indices(self, sampler: Any, step: int, rank: int, per_rank: int) -> torch.Tensor:
        sizes = self.current_split(step, sampler.n)
        if sizes is None:
            self._weight = 1.0
            return super().batch_indices(sampler, step, rank, per_rank)
        self._weight = sizes[rank] * len(sizes) / sum(sizes)
        return sampler.sized_rank_batch(step, rank, sizes)

    def loss_weight(self) -> float:
        return self._weight
