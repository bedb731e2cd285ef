"""Deterministic data order shared by every rank.

The sample stream is the concatenation of per-epoch permutations seeded by
(seed, epoch); step k's global batch is the k-th run of `batch_size` ids in
that stream, and rank r takes its contiguous slice. Any rank can compute any
step's batch without communication, which makes runs reproducible and
resumable mid-epoch, and makes `single` with batch 2b see exactly the samples
of two DDP ranks with batch b.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from typing import Callable, Iterator

import torch

from ddlscope.specs import Experiment
from ddlscope.workloads.base import Task

PARQUET_SHARDS = 8  # at least; a multiple of the ranks that read them
TRAINING_ONLY_FIELDS = {"batch_size", "steps", "eval_every", "eval_batches", "optimizer", "lr", "momentum",
                        "weight_decay", "data", "data_workers"}


class GlobalBatchSampler:
    def __init__(self, dataset_len: int, batch_size: int, seed: int):
        if dataset_len < 1:
            raise ValueError("dataset is empty")
        self.n = dataset_len
        self.batch_size = batch_size
        self.seed = seed
        self._epoch_cache: dict[int, torch.Tensor] = {}

    def _epoch(self, epoch: int) -> torch.Tensor:
        if epoch not in self._epoch_cache:
            self._epoch_cache = {epoch: self._permutation(epoch)}  # keep only the current epoch
        return self._epoch_cache[epoch]

    def _permutation(self, epoch: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.n, generator=gen)

    def global_batch(self, step: int) -> torch.Tensor:
        start = step * self.batch_size
        parts, remaining = [], self.batch_size
        while remaining:
            epoch, offset = divmod(start, self.n)
            take = min(remaining, self.n - offset)
            parts.append(self._epoch(epoch)[offset:offset + take])
            start += take
            remaining -= take
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def rank_batch(self, step: int, rank: int, per_rank: int) -> torch.Tensor:
        return self.global_batch(step)[rank * per_rank:(rank + 1) * per_rank]

    def sized_rank_batch(self, step: int, rank: int, sizes: list[int]) -> torch.Tensor:
        """Rank r's slice of step k's global batch when ranks take `sizes` samples each (sum: the batch)."""
        if sum(sizes) != self.batch_size:
            raise ValueError(f"per-rank batches {sizes} do not add up to the global batch {self.batch_size}")
        start = sum(sizes[:rank])
        return self.global_batch(step)[start:start + sizes[rank]]


# (sampler, step, rank, per_rank) -> the sample ids the rank reads at the step: Strategy.batch_indices.
ChooseIds = Callable[[GlobalBatchSampler, int, int, int], torch.Tensor]


def step_batches(task: Task, exp: Experiment, rank: int, ranks: int, per_rank: int, first_step: int,
                 choose: ChooseIds | None = None
                 ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's (inputs, targets) for steps first_step, first_step + 1, ...: from the in-memory split
    (the global batch's slice, GlobalBatchSampler) or, with workload.data = parquet, from the rank's
    Parquet shards through the loader workers (runtime/parquet_data.py). Both are functions of the step,
    so a run resumed at any step reads what the uninterrupted run read. `choose(sampler, step, rank,
    per_rank)` lets a strategy pick its own samples of the in-memory split (a federated client reads its
    partition; a speed-aware split takes an unequal slice of the global batch)."""
    spec = exp.workload
    if spec.data == "memory":
        sampler = GlobalBatchSampler(len(task.train), spec.batch_size, exp.seed)
        pick = choose or GlobalBatchSampler.rank_batch
        return (task.train.get(pick(sampler, step, rank, per_rank))
                for step in itertools.count(first_step))
    if choose is not None:
        raise ValueError(f"strategy {exp.strategy.name!r} picks its own samples; it reads workload.data = memory only")
    from ddlscope.runtime.parquet_data import PipelineLoader, RankOrder, write_shards
    from ddlscope.workloads.vision import _cache_dir  # the package's data cache (DDLSCOPE_CACHE_DIR)

    data_knobs = spec.model_dump_json(exclude=TRAINING_ONLY_FIELDS)  # one folder per data, not per training setup
    key = hashlib.sha256(f"{data_knobs}|{exp.seed}".encode()).hexdigest()[:16]
    shards = write_shards(task.train, _cache_dir() / "parquet" / f"{spec.name}-{key}",
                          ranks * math.ceil(PARQUET_SHARDS / ranks))
    order = RankOrder(shards, rank, ranks, exp.seed, per_rank)
    local = _cache_dir() / "parquet-local" / f"{spec.name}-{key}" / f"rank{rank}"
    return PipelineLoader(order, local, workers=spec.data_workers).batches(first_step)
