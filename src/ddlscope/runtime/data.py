"""Deterministic data order shared by every rank.

The sample stream is the concatenation of per-epoch permutations seeded by
(seed, epoch); step k's global batch is the k-th run of `batch_size` ids in
that stream, and rank r takes its contiguous slice. Any rank can compute any
step's batch without communication, which makes runs reproducible and
resumable mid-epoch, and makes `single` with batch 2b see exactly the samples
of two DDP ranks with batch b.
"""

from __future__ import annotations

import torch


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
