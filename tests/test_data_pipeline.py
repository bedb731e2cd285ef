"""The Parquet data pipeline (runtime/parquet_data.py): shards, order, determinism, resume, cache, the loop's use.

In-process, on the digits split (1437 samples) written as 6 shards for 3 ranks; loader workers are real
worker processes (torch DataLoader).
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from ddlscope.runtime.parquet_data import (
    LocalCache, NaiveLoader, PipelineLoader, RankOrder, ShardSet, augment, rank_files, write_shards)
from ddlscope.workloads import WORKLOADS
from ddlscope.workloads.base import TensorDataset

RANKS, SHARDS, BATCH = 3, 6, 16


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> ShardSet:
    spec = WORKLOADS.get("cnn-digits").spec_class()
    task = WORKLOADS.get("cnn-digits").build(spec, 0)
    return write_shards(task.train, tmp_path_factory.mktemp("shards"), SHARDS)


def take(iterator, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:  # noqa: ANN001
    return [next(iterator) for _ in range(n)]


def same(a: list[tuple[torch.Tensor, torch.Tensor]], b: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, u) and torch.equal(y, v) for (x, y), (u, v) in zip(a, b))


def ids_of(shards: ShardSet, order: torch.Tensor) -> list[int]:
    """Sample ids of (file, row) pairs, from the shards' id column."""
    columns = [pq.read_table(shards.directory / f, columns=["id"]).column("id").to_pylist() for f in shards.files]
    return [columns[f][row] for f, row in order.tolist()]


def test_shards_round_trip_and_rank_shards_are_disjoint_and_cover(shards: ShardSet) -> None:
    assert shards.samples == 1437 and len(shards.files) == SHARDS and shards.input_shape == (1, 8, 8)
    assert sorted(f for r in range(RANKS) for f in rank_files(SHARDS, r, RANKS)) == list(range(SHARDS))
    per_rank = [set(ids_of(shards, RankOrder(shards, r, RANKS, 0, BATCH).epoch(0))) for r in range(RANKS)]
    assert all(not (per_rank[a] & per_rank[b]) for a in range(RANKS) for b in range(a + 1, RANKS))
    assert set().union(*per_rank) == set(range(1437))
    # the stored bytes decode to the split's own inputs (no augmentation)
    task = WORKLOADS.get("cnn-digits").build(WORKLOADS.get("cnn-digits").spec_class(), 0)
    order = RankOrder(shards, 1, RANKS, 0, BATCH)
    x, y = next(NaiveLoader(order, augmenting=False).batches(0))
    expected_x, expected_y = task.train.get(torch.tensor(ids_of(shards, order.batch_rows(order.epoch(0), 0))))
    assert torch.equal(x, expected_x) and torch.equal(y, expected_y)


def test_write_is_skipped_when_the_same_shards_exist(shards: ShardSet) -> None:
    before = {f: (shards.directory / f).stat().st_mtime_ns for f in shards.files}
    task = WORKLOADS.get("cnn-digits").build(WORKLOADS.get("cnn-digits").spec_class(), 0)
    again = write_shards(task.train, shards.directory, SHARDS)
    assert again == shards and before == {f: (shards.directory / f).stat().st_mtime_ns for f in shards.files}


def test_order_is_seeded_by_epoch_and_rank(shards: ShardSet) -> None:
    order = RankOrder(shards, 0, RANKS, 5, BATCH)
    assert torch.equal(order.epoch(1), RankOrder(shards, 0, RANKS, 5, BATCH).epoch(1))
    assert not torch.equal(order.epoch(0), order.epoch(1))
    assert not torch.equal(order.epoch(0), RankOrder(shards, 0, RANKS, 6, BATCH).epoch(0))
    assert order.batches_per_epoch == order.samples // BATCH


def test_two_runs_give_bit_identical_batches_and_a_resume_the_same_order(shards: ShardSet, tmp_path: Path) -> None:
    order = RankOrder(shards, 2, RANKS, 9, BATCH)
    per_epoch = order.batches_per_epoch  # 29: the resume below crosses into the second epoch
    steps = per_epoch + 4
    first = take(PipelineLoader(order, tmp_path / "a", workers=2).batches(0), steps)
    second = take(PipelineLoader(order, tmp_path / "b", workers=2).batches(0), steps)
    assert same(first, second)
    resumed = take(PipelineLoader(order, tmp_path / "a", workers=2).batches(per_epoch - 3), 7)
    assert same(resumed, first[per_epoch - 3:per_epoch + 4])
    # the naive loader drawing as two workers builds exactly the same batches
    assert same(take(NaiveLoader(order, as_workers=2).batches(0), steps), first)
    # augmentation really happens, and depends on the worker: one worker draws other flips
    plain = take(NaiveLoader(order, augmenting=False).batches(0), 4)
    assert not all(torch.equal(p[0], f[0]) for p, f in zip(plain, first[:4]))
    assert not same(take(PipelineLoader(order, None, workers=0).batches(0), 4), first[:4])
    # every batch's labels are those of its samples (augmentation flips pixels, not labels)
    assert all(torch.equal(p[1], f[1]) for p, f in zip(plain, first[:4]))


def test_flip_is_a_mirror_of_about_half_the_images() -> None:
    x = torch.arange(2 * 400 * 3 * 4, dtype=torch.float32).reshape(400, 2, 3, 4)
    out = augment(x, torch.Generator().manual_seed(0))
    flipped = torch.tensor([torch.equal(o, i.flip(-1)) for o, i in zip(out, x)])
    kept = torch.tensor([torch.equal(o, i) for o, i in zip(out, x)])
    assert bool((flipped ^ kept).all()) and 160 < int(flipped.sum()) < 240
    assert torch.equal(augment(x[:, 0, 0], torch.Generator()), x[:, 0, 0])  # no width: untouched


def test_local_cache_copies_each_shard_once(shards: ShardSet, tmp_path: Path) -> None:
    cache = LocalCache(tmp_path / "local")
    paths = [cache.local(shards.directory / f) for f in shards.files[:2]]
    again = [cache.local(shards.directory / f) for f in shards.files[:2]]
    assert paths == again and cache.misses == 2
    assert all(p.read_bytes() == (shards.directory / p.name).read_bytes() for p in paths)


def test_a_rank_with_less_than_one_batch_is_refused(tmp_path: Path) -> None:
    tiny = write_shards(TensorDataset(torch.zeros(10, 2), torch.zeros(10, dtype=torch.long)), tmp_path, 2)
    with pytest.raises(ValueError, match="fewer than one batch"):
        PipelineLoader(RankOrder(tiny, 0, 2, 0, 8), None)


def test_the_training_loop_reads_parquet_and_resumes_where_it_stopped(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from ddlscope.runtime.config import load_experiment
    from ddlscope.runtime.data import step_batches

    monkeypatch.setenv("DDLSCOPE_CACHE_DIR", str(tmp_path))
    exp = load_experiment(None, {"workload.name": "mlp-digits", "workload.data": "parquet", "workload.data_workers": 1,
                                 "workload.batch_size": 64, "cluster.world_size": 2, "strategy.name": "ddp"})
    task = WORKLOADS.get("mlp-digits").build(exp.workload, exp.seed)
    whole = take(step_batches(task, exp, 1, 2, 32, 0), 25)  # 718 samples per rank: 22 batches an epoch
    assert same(take(step_batches(task, exp, 1, 2, 32, 20), 5), whole[20:])
    assert len(list((tmp_path / "parquet").iterdir())) == 1
    memory = load_experiment(None, {"workload.name": "mlp-digits", "workload.batch_size": 64,
                                    "cluster.world_size": 2, "strategy.name": "ddp"})
    assert not same(take(step_batches(task, memory, 1, 2, 32, 0), 1), whole[:1])
