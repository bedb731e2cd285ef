"""A reproducible, sharded data pipeline on Parquet (PAPERS.md item 6).

    write_shards      a workload's training split as `shards` Parquet files (pyarrow): one row per
                      sample: id, label, the input tensor's float32 bytes zlib-compressed (what a
                      loader must decode), the shape in the schema's metadata
    rank_files        rank r of R reads files r, r + R, ...: disjoint, and together every file
    LocalCache        a shard is copied from its source folder to a local folder on first use and
                      read from there afterwards (the source stands for remote storage)
    ShardBatches      the batches of one (epoch, rank): the rank's rows in an order seeded by
                      (seed, epoch, rank), cut into batches; a loader worker takes every W-th batch,
                      reads only the columns it needs (projection pushdown), decodes and augments it
                      itself (work pushed down to the workers), with a generator seeded by
                      (seed, epoch, rank, worker, batch)
    PipelineLoader    torch.utils.data.DataLoader over ShardBatches, which fetches from its workers
                      round-robin, so batch b comes b-th whatever the workers' speeds; `batches(step)`
                      starts at any step: a restart mid-epoch yields exactly the same samples, in the
                      same order, with the same augmentation, as the run that did not stop
    NaiveLoader       the straightforward loader, for the benchmark: in the training process, no
                      workers, no cache, each batch reads its shards whole from the source

A batch never crosses an epoch: each epoch has len(rank's rows) // batch full batches, the rest of
the epoch's order is dropped (a different rest each epoch). The training loop uses it when
`workload.data = "parquet"` (runtime/loop.py); the data phase of the step breakdown is then the
time a step waited for the loader, the stall.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ddlscope.workloads.base import Dataset

MANIFEST = "manifest.json"
COMPRESSION_LEVEL = 1
DECODE_COLUMNS = ["label", "input"]  # what a loader reads: not the id (projection pushdown)


# --- writing ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardSet:
    """Parquet shards of one dataset on storage."""

    directory: Path
    files: tuple[str, ...]
    rows: tuple[int, ...]  # per file
    input_shape: tuple[int, ...]

    @classmethod
    def open(cls, directory: Path) -> "ShardSet":
        manifest = json.loads((directory / MANIFEST).read_text())
        return cls(directory, tuple(manifest["files"]), tuple(manifest["rows"]), tuple(manifest["input_shape"]))

    @property
    def samples(self) -> int:
        return sum(self.rows)


def write_shards(dataset: Dataset, directory: Path, shards: int) -> ShardSet:
    """Write `dataset` as `shards` Parquet files of contiguous sample ids (skipped when the folder
    already holds the same shards: the manifest, written last, records the content's digest)."""
    ids = torch.arange(len(dataset))
    inputs, labels = dataset.get(ids)
    digest = hashlib.sha256(inputs.float().numpy().tobytes() + labels.numpy().tobytes()).hexdigest()[:16]
    if (directory / MANIFEST).exists():
        existing = json.loads((directory / MANIFEST).read_text())
        if existing.get("digest") == digest and len(existing["files"]) == shards:
            return ShardSet.open(directory)
    directory.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, len(ids), shards + 1).astype(int)
    files, rows = [], []
    for index, (start, end) in enumerate(zip(bounds, bounds[1:])):
        name = f"shard-{index:05d}.parquet"
        encoded = [zlib.compress(x.float().numpy().tobytes(), COMPRESSION_LEVEL) for x in inputs[start:end]]
        table = pa.table({"id": pa.array(ids[start:end].numpy()), "label": pa.array(labels[start:end].numpy()),
                          "input": pa.array(encoded, type=pa.binary())})
        _atomic_write_table(table, directory / name)
        files.append(name)
        rows.append(int(end - start))
    manifest = {"files": files, "rows": rows, "input_shape": list(inputs.shape[1:]), "digest": digest}
    tmp = directory / f"{MANIFEST}.tmp{os.getpid()}"
    tmp.write_text(json.dumps(manifest))
    os.replace(tmp, directory / MANIFEST)
    return ShardSet.open(directory)


def _atomic_write_table(table: pa.Table, path: Path) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


# --- which rows, in which order ----------------------------------------------------------


def rank_files(files: int, rank: int, ranks: int) -> list[int]:
    """The shard files rank `rank` of `ranks` reads: every ranks-th, from its own index."""
    return list(range(rank, files, ranks))


def _generator(*key: int) -> torch.Generator:
    """A generator seeded from a tuple of integers (seed, epoch, rank, ...), the same on every run."""
    digest = hashlib.sha256(repr(key).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


@dataclass(frozen=True)
class RankOrder:
    """The order rank `rank` visits its rows: (file, row) pairs, a fresh permutation each epoch."""

    shards: ShardSet
    rank: int
    ranks: int
    seed: int
    batch_size: int

    @property
    def files(self) -> list[int]:
        return rank_files(len(self.shards.files), self.rank, self.ranks)

    @property
    def samples(self) -> int:
        return sum(self.shards.rows[f] for f in self.files)

    @property
    def batches_per_epoch(self) -> int:
        return self.samples // self.batch_size

    def epoch(self, epoch: int) -> Tensor:
        """(samples, 2) int64: file index and row within it, in this epoch's order."""
        pairs = torch.cat([torch.stack([torch.full((self.shards.rows[f],), f), torch.arange(self.shards.rows[f])], 1)
                           for f in self.files])
        return pairs[torch.randperm(len(pairs), generator=_generator(self.seed, epoch, self.rank))]

    def batch_rows(self, order: Tensor, batch: int) -> Tensor:
        return order[batch * self.batch_size:(batch + 1) * self.batch_size]


# --- reading ---------------------------------------------------------------------------


class LocalCache:
    """Shards copied from their source folder to `directory` on first use; later reads are local."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.misses = 0

    def local(self, source: Path) -> Path:
        path = self.directory / source.name
        if not path.exists():
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            shutil.copyfile(source, tmp)
            os.replace(tmp, path)  # atomic: a reader in another worker never sees half a file
            self.misses += 1
        return path


def decode(encoded: list[bytes], shape: tuple[int, ...]) -> Tensor:
    """zlib-compressed float32 bytes -> a (len, *shape) float32 tensor."""
    return torch.from_numpy(np.stack([np.frombuffer(zlib.decompress(b), dtype=np.float32) for b in encoded])
                            .reshape(len(encoded), *shape))


def augment(x: Tensor, gen: torch.Generator) -> Tensor:
    """Flip each image (inputs with a width: (C, H, W)) left-right with probability 1/2; others as they are."""
    if x.dim() < 4:
        return x
    flip = torch.rand(len(x), generator=gen) < 0.5
    return torch.where(flip[:, None, None, None], x.flip(-1), x)


class ShardBatches(IterableDataset):
    """One (epoch, rank)'s batches from `start_batch` on; worker w of W yields batches w, w + W, ..."""

    def __init__(self, order: RankOrder, epoch: int, start_batch: int, cache_dir: Path | None, augmenting: bool):
        self.order, self.epoch, self.start_batch = order, epoch, start_batch
        self.cache_dir, self.augmenting = cache_dir, augmenting

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        rows = self.order.epoch(self.epoch)
        cache = LocalCache(self.cache_dir) if self.cache_dir else None
        tables: dict[int, pa.Table] = {}  # this worker's shards, read once per epoch
        for batch in range(self.start_batch, self.order.batches_per_epoch):
            if batch % workers == worker:
                yield self._batch(self.order.batch_rows(rows, batch), batch, worker, tables, cache)

    def _batch(self, pairs: Tensor, batch: int, worker: int, tables: dict[int, pa.Table],
               cache: LocalCache | None, columns: list[str] | None = DECODE_COLUMNS) -> tuple[Tensor, Tensor]:
        shards = self.order.shards
        encoded: list[bytes] = [b""] * len(pairs)
        labels = torch.empty(len(pairs), dtype=torch.int64)
        for f in torch.unique(pairs[:, 0]).tolist():
            if f not in tables:
                source = shards.directory / shards.files[f]
                tables[f] = pq.read_table(cache.local(source) if cache else source, columns=columns)
            where = torch.nonzero(pairs[:, 0] == f).flatten()
            picked = tables[f].take(pa.array(pairs[where, 1].numpy()))
            labels[where] = torch.tensor(picked.column("label").to_numpy())
            for position, blob in zip(where.tolist(), picked.column("input").to_pylist()):
                encoded[position] = blob
        x = decode(encoded, shards.input_shape)
        if self.augmenting:
            x = augment(x, _generator(self.order.seed, self.epoch, self.order.rank, worker, batch))
        return x, labels


class PipelineLoader:
    """A rank's batches for every step, from any step on (see the module's docstring)."""

    def __init__(self, order: RankOrder, cache_dir: Path | None, workers: int = 2, prefetch_batches: int = 4,
                 augmenting: bool = True):
        if order.batches_per_epoch < 1:
            raise ValueError(f"rank {order.rank} has {order.samples} samples, fewer than one batch "
                             f"({order.batch_size}): use fewer ranks or a smaller batch")
        self.order, self.cache_dir, self.workers = order, cache_dir, workers
        self.prefetch_batches, self.augmenting = prefetch_batches, augmenting

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, batch within it) of a step: the whole resumable state is the step."""
        return divmod(step, self.order.batches_per_epoch)

    def batches(self, first_step: int = 0) -> Iterator[tuple[Tensor, Tensor]]:
        """Batches of steps first_step, first_step + 1, ... (endless; one DataLoader per epoch)."""
        epoch, start = self.position(first_step)
        while True:
            source = ShardBatches(self.order, epoch, start, self.cache_dir, self.augmenting)
            if self.workers:
                yield from DataLoader(source, batch_size=None, num_workers=self.workers,
                                      prefetch_factor=max(1, self.prefetch_batches // self.workers))
            else:
                yield from source
            epoch, start = epoch + 1, 0


class NaiveLoader:
    """The loader the pipeline is measured against: the same batches built in the training process
    on demand, each from its shards read whole (every column) from the source: no workers, no
    prefetch, no cache. `as_workers`: draw the augmentation as a pipeline with that many workers
    does, so both yield identical batches."""

    def __init__(self, order: RankOrder, augmenting: bool = True, as_workers: int = 1):
        self.order, self.augmenting, self.as_workers = order, augmenting, max(as_workers, 1)

    def batches(self, first_step: int = 0) -> Iterator[tuple[Tensor, Tensor]]:
        step, epoch_rows = first_step, (-1, torch.empty(0))
        while True:
            epoch, batch = divmod(step, self.order.batches_per_epoch)
            if epoch_rows[0] != epoch:
                epoch_rows = (epoch, self.order.epoch(epoch))
            one = ShardBatches(self.order, epoch, batch, None, self.augmenting)
            yield one._batch(self.order.batch_rows(epoch_rows[1], batch), batch, batch % self.as_workers, {}, None,
                             columns=None)
            step += 1
