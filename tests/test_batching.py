"""Heterogeneity-aware batching: `dbs` and the static split (batch_split) of ddp and the parameter servers.

The split rule, the knobs and the estimators are checked in-process. One launch of two ranks
(launch_processes, the real training loop) trains ddp, dbs with equal and with unequal speeds, ddp
with a declared uneven split, and (rank 0 alone) `single` on the global batch; two CLI runs cover
the parameter servers (a declared split through ps-sync, a Hogbatch ps-async with lock-free updates).
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from ddlscope.specs import ConfigError
from ddlscope.specs.strategies.batching import balanced_split, split_batch, step_slowdowns
from phase_checks import assert_step_phases

STEPS = 11
RESPLIT = 5  # re-splits at steps 5 and 10; steps 0-1 are not measured (one-off costs)
BATCH = 32
COMMON = {"workload.name": "mlp-digits", "workload.steps": STEPS, "workload.batch_size": BATCH,
          "workload.lr": 0.2, "workload.momentum": 0.5, "workload.eval_batches": 1, "seed": 3}
CONFIGS: dict[str, dict[str, Any]] = {
    "ddp": {"strategy.name": "ddp"},
    # equal speeds: the measured throughputs differ only by noise
    "dbs-equal": {"strategy.name": "dbs", "strategy.resplit_every_steps": RESPLIT},
    # rank 1 three times slower: its batch must shrink after the first re-split
    "dbs-straggler": {"strategy.name": "dbs", "strategy.resplit_every_steps": RESPLIT, "cluster.slowdown": [1, 3]},
    "ddp-declared": {"strategy.name": "ddp", "strategy.batch_split": "declared", "strategy.worker_speeds": [3, 1]},
}


# -- the split rule -----------------------------------------------------------------------------
@pytest.mark.parametrize("total, speeds, expected", [
    (32, [3, 1], [24, 8]),
    (256, [1, 0.5], [171, 85]),       # 170.67 / 85.33: the larger remainder gets the extra sample
    (7, [1, 1], [4, 3]),              # a tie goes to the lower rank
    (3, [100, 1, 1], [1, 1, 1]),      # everyone keeps at least one sample
    (10, [1, 1, 1], [4, 3, 3]),
])
def test_split_batch_is_proportional_exact_and_keeps_one_each(total, speeds, expected):
    assert split_batch(total, speeds) == expected


def test_split_batch_refuses_what_it_cannot_split():
    with pytest.raises(ValueError, match="at least one"):
        split_batch(1, [1, 1])
    with pytest.raises(ValueError, match="positive"):
        split_batch(8, [1, 0])


def test_balanced_split_equalises_time_and_reduces_to_dbs_without_overhead():
    assert balanced_split(256, [0, 0], [1, 2]) == split_batch(256, [1, 0.5]) == [171, 85]
    sizes = balanced_split(256, [10, 20], [1, 2])  # 10 + b0 = 20 + 2 b1, b0 + b1 = 256
    assert sizes == [174, 82]
    # a straggler whose overhead alone exceeds the other's whole step keeps one sample
    assert balanced_split(32, [1, 30], [0.01, 0.03]) == [31, 1]
    with pytest.raises(ValueError, match="positive"):
        balanced_split(32, [0, 0], [1, 0])


def test_step_slowdowns_balance_a_straggler():
    # speeds 1/slowdown: every worker takes the same time, workers / sum(1 / s) = 2 / 1.5 of a homogeneous step
    assert step_slowdowns([1, 2], [1, 0.5]) == pytest.approx([4 / 3, 4 / 3])
    assert step_slowdowns([1, 2], None) == [1, 2]  # an equal split: the straggler's 2x
    assert step_slowdowns([1, 1], [3, 1]) == pytest.approx([1.5, 0.5])  # an uneven split of equal workers


def test_sized_rank_batches_cover_the_global_batch_exactly():
    from ddlscope.runtime.data import GlobalBatchSampler

    sampler = GlobalBatchSampler(100, 32, seed=4)
    for step in (0, 3, 5):  # step 3 wraps into the second epoch
        parts = [sampler.sized_rank_batch(step, r, [20, 5, 7]) for r in range(3)]
        assert [len(p) for p in parts] == [20, 5, 7]
        assert torch.equal(torch.cat(parts), sampler.global_batch(step))
    with pytest.raises(ValueError, match="do not add up"):
        sampler.sized_rank_batch(0, 0, [20, 5])


# -- bad knobs ------------------------------------------------------------------------------------
def _experiment(**overrides: Any):
    from ddlscope.runtime.config import load_experiment

    return load_experiment(None, {**COMMON, "cluster.world_size": 2, **overrides})


@pytest.mark.parametrize("overrides, message", [
    ({"strategy.name": "ddp", "strategy.batch_split": "declared", "strategy.worker_speeds": [1, 2, 3]},
     "worker_speeds has 3 entries"),
    ({"strategy.name": "ddp", "strategy.batch_split": "declared"}, "worker_speeds has 0 entries"),
    ({"strategy.name": "ps-sync", "strategy.worker_speeds": [1, 2]}, "read only with batch_split"),
    ({"strategy.name": "ps-async", "strategy.lock_free": True, "checkpoint_every": 2}, "lock_free cannot"),
])
def test_bad_knobs_are_refused_with_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as caught:
        _experiment(**overrides)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("overrides, field", [
    ({"strategy.name": "ddp", "strategy.batch_split": "fastest"}, "batch_split"),
    ({"strategy.name": "ddp", "strategy.batch_split": "declared", "strategy.worker_speeds": [1, -2]}, "worker_speeds"),
    ({"strategy.name": "dbs", "strategy.resplit_every_steps": -1}, "resplit_every_steps"),
    ({"strategy.name": "ps-sync", "strategy.lock_free": True}, "lock_free"),  # a ps-async knob only
])
def test_bad_knob_values_name_the_field(overrides, field):
    with pytest.raises((ConfigError, ValidationError)) as caught:
        _experiment(**overrides)
    assert field in str(caught.value)


# -- estimators and advise ------------------------------------------------------------------------
def _case(slowdowns: list[float] | None):
    from ddlscope.predict.catalogue import parse_cluster
    from ddlscope.predict.estimators import ClusterCase
    from ddlscope.predict.strategies import ServerSpec, image_workload

    cluster = parse_cluster("a100-80gb:1x2")
    return ClusterCase(workload=image_workload("resnet50"), cluster=cluster,
                       stragglers=max(slowdowns or [1.0]), slowdowns=slowdowns, server=ServerSpec(),
                       activation_bytes=1e9, weight_bytes_per_param=4, optimizer_bytes_per_param=8)


def test_estimators_price_the_split_batch():
    from ddlscope.predict.estimators import estimator_for
    from ddlscope.specs.strategies.dbs import DBSSpec
    from ddlscope.specs.strategies.ddp import DDPSpec

    def step_s(spec, slowdowns):
        return estimator_for(spec).cluster(spec, _case(slowdowns)).step_s

    homogeneous = step_s(DDPSpec(), None)
    straggler = step_s(DDPSpec(), [1.0, 2.0])
    assert step_s(DBSSpec(), None) == pytest.approx(homogeneous, rel=1e-9)  # equal speeds: ddp
    dbs = step_s(DBSSpec(), [1.0, 2.0])
    static = step_s(DDPSpec(batch_split="cluster"), [1.0, 2.0])
    assert dbs == pytest.approx(static, rel=1e-9)
    # compute 4/3 of the homogeneous step instead of 2x: a third of the way back, not more, not less
    assert homogeneous < dbs < straggler
    compute = estimator_for(DDPSpec()).cluster(DDPSpec(), _case(None)).compute_s
    assert (straggler - dbs) == pytest.approx(compute * (2 - 4 / 3), rel=0.05)


def test_advise_considers_dbs_when_workers_differ():
    from ddlscope.advise import advise

    exp = _experiment(**{"strategy.name": "ddp"})
    rank = {}
    for stragglers in (1.0, 2.0):
        rows = advise(exp, "a10g:1x2", stragglers=stragglers, db=None).strategies
        rank[stragglers] = {s.strategy: s.rank for s in rows}
    assert rank[1.0]["ddp"] < rank[1.0]["dbs"]  # equal workers: a tie, and ddp is the simpler
    assert rank[2.0]["dbs"] < rank[2.0]["ddp"]  # a 2x straggler: the split pays


# -- two ranks, the real loop ---------------------------------------------------------------------
def train_all(out_dir: str, configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One rank: every configuration in turn, then (rank 0 alone) `single` on the global batch."""
    import torch.distributed as dist

    from rank_runs import records, train_rank

    def run(label: str, overrides: dict[str, Any], rank: int, world: int) -> None:
        models[label], run_rows = train_rank({**COMMON, "cluster.world_size": world, **overrides}, rank, world,
                                             Path(out_dir) / f"{label}-{rank}.jsonl", whole_model=False)
        rows[label] = records(run_rows, "step")

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    models: dict[str, Any] = {}
    rows: dict[str, Any] = {}
    try:
        for label, overrides in configs.items():
            run(label, overrides, rank, 2)
    finally:
        dist.destroy_process_group()
    if rank == 0:  # no communication: the one-process reference on the same global batches
        run("single", {"strategy.name": "single"}, 0, 1)
    return {"models": models, "rows": rows}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    from ddlscope.runtime.launcher import launch_processes

    out = tmp_path_factory.mktemp("batching")
    return launch_processes(train_all, (str(out), CONFIGS), 2, run_id=f"batching-{os.getpid()}")


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _samples(trained: dict[int, Any], label: str) -> list[tuple[int, int]]:
    return [(a["samples"], b["samples"]) for a, b in zip(trained[0]["rows"][label], trained[1]["rows"][label])]


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_split_batch_trains_exactly_like_one_process_on_the_global_batch(trained):
    models = trained[0]["models"]
    assert _samples(trained, "ddp-declared") == [(24, 8)] * STEPS
    assert max_difference(models["ddp-declared"], models["single"]) < 1e-6
    assert max_difference(models["ddp"], models["single"]) < 1e-6
    for label in CONFIGS:  # and every rank holds the same model
        assert max_difference(trained[0]["models"][label], trained[1]["models"][label]) < 1e-6, label


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_dbs_equals_ddp_and_moves_the_batch_to_the_fast_worker(trained):
    models = trained[0]["models"]
    assert max_difference(models["dbs-equal"], models["ddp"]) < 1e-6
    assert max_difference(models["dbs-straggler"], models["ddp"]) < 1e-6  # re-split, still exact
    even = _samples(trained, "dbs-equal")
    assert all(a + b == BATCH for a, b in even) and even[:RESPLIT] == [(16, 16)] * RESPLIT
    assert all(abs(a - b) <= 16 for a, b in even[RESPLIT:]), even  # noise, not a 3:1 split
    uneven = _samples(trained, "dbs-straggler")
    assert all(a + b == BATCH for a, b in uneven) and uneven[:RESPLIT] == [(16, 16)] * RESPLIT
    # The first re-split measured equal batches (steps 2-4): each worker's median step compute, the
    # split that equalises them. The rows hold the same compute, so the split is known exactly.
    first = uneven[RESPLIT]
    assert uneven[RESPLIT:2 * RESPLIT] == [first] * RESPLIT, uneven
    step_s = [_median_compute_s(trained, rank, "dbs-straggler", range(2, RESPLIT)) for rank in (0, 1)]
    assert 1.5 < step_s[1] / step_s[0] < 8, step_s  # the emulated 3x straggler: slower, not absurdly
    assert list(first) == balanced_split(BATCH, [0, 0], [s / 16 for s in step_s]), (uneven, step_s)
    assert 2 <= first[1] <= 12, uneven  # about a quarter (8 of 32) for a 3x slower worker
    # The second (step 10) may fit an overhead from the two batch sizes; the straggler stays below half.
    assert 1 <= uneven[2 * RESPLIT][1] < 16, uneven
    # the re-split's all-gather of (overhead, per-sample time) is counted: 16 bytes more on re-split steps
    sent = [r["bytes_sent"] for r in trained[0]["rows"]["dbs-equal"]]
    ddp_sent = trained[0]["rows"]["ddp"][0]["bytes_sent"]
    assert sent == [ddp_sent + (16 if s in (RESPLIT, 2 * RESPLIT) else 0) for s in range(STEPS)]
    for label, overrides in CONFIGS.items():
        for rank in (0, 1):
            assert_step_phases(trained[rank]["rows"][label], overrides["strategy.name"])


def _median_compute_s(trained: dict[int, Any], rank: int, label: str, steps: range) -> float:
    rows = trained[rank]["rows"][label]
    return statistics.median(rows[s]["forward_s"] + rows[s]["backward_s"] for s in steps)


# -- the parameter servers: two workers and a server, the real loop and server loop -------------
PS_CONFIGS: dict[str, dict[str, Any]] = {
    "ps-sync-declared": {"strategy.name": "ps-sync", "strategy.batch_split": "declared",
                         "strategy.worker_speeds": [1, 3]},
    # Hogbatch: batches from the straggler profile, lock-free updates
    "hogbatch": {"strategy.name": "ps-async", "strategy.batch_split": "cluster", "strategy.lock_free": True,
                 "cluster.slowdown": [1, 2]},
}


def serve_all(out_dir: str, configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Ranks 0-1 train, rank 2 serves, every configuration in turn (as runtime/worker.py sets them up)."""
    import torch.distributed as dist

    from ddlscope.runtime.config import load_experiment
    from ddlscope.runtime.loop import train
    from ddlscope.runtime.ps_server import serve
    from ddlscope.runtime.rows import RowWriter, read_records
    from ddlscope.strategies import RunContext, runtime_class
    from ddlscope.workloads import WORKLOADS

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    models, rows = {}, {}
    try:
        for label, overrides in configs.items():
            exp = load_experiment(None, {**COMMON, "cluster.world_size": 2, **overrides})
            group = dist.new_group([0, 1])
            ctx = RunContext(rank, 3, rank, 0, torch.device("cpu"), "gloo", exp, workers=2, worker_group=group)
            task = WORKLOADS.get(exp.workload.name).build(exp.workload, exp.seed)
            path = Path(out_dir) / f"{label}-{rank}.jsonl"
            writer = RowWriter(path, rank)
            strategy = runtime_class(exp.strategy)(exp.strategy, ctx)
            if rank == 2:
                serve(task, strategy, ctx, writer)  # type: ignore[arg-type]
            else:
                models[label] = {k: v.detach().clone() for k, v in train(task, strategy, ctx, writer).model.state_dict().items()}
            writer.close()
            rows[label] = [r for r in read_records(path) if r.get("kind") in ("step", "update")]
            dist.barrier()
    finally:
        dist.destroy_process_group()
    return {"models": models, "rows": rows}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    from ddlscope.runtime.launcher import launch_processes

    out = tmp_path_factory.mktemp("batching-ps")
    return launch_processes(serve_all, (str(out), PS_CONFIGS), 3, run_id=f"batching-ps-{os.getpid()}")


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_parameter_servers_split_the_batch_by_speed(trained, served):
    # a share-weighted synchronous round: the global batch's step, as one process takes it
    assert max_difference(served[0]["models"]["ps-sync-declared"], trained[0]["models"]["single"]) < 1e-5
    samples = {label: [(r["samples"], s["samples"]) for r, s in zip(served[0]["rows"][label], served[1]["rows"][label])]
               for label in PS_CONFIGS}
    assert samples == {"ps-sync-declared": [(8, 24)] * STEPS, "hogbatch": [(21, 11)] * STEPS}  # 32 x 1 : 0.5
    updates = served[2]["rows"]["hogbatch"]
    assert len(updates) == 2 * STEPS
    # lock-free: every push is answered before it is applied, so each worker's later pushes are at least
    # one update stale (its own)
    assert min(u["staleness"] for u in updates if u["worker_step"] > 0) >= 1


# -- the study ------------------------------------------------------------------------------------
def test_the_study_runs_dbs_and_the_static_splits_and_reads_the_three_step_times():
    from test_dataparallel_study import _result

    from ddlscope.studies import STUDIES

    study = STUDIES.get("dataparallel")()
    quick = {c.key: c for c in study.cells(quick=True)}
    assert {"dbs/fast/straggler/w2", "ddp/fast/homogeneous/w2", "ddp/fast/straggler/w2"} <= quick.keys()
    full = {c.key: c for c in study.cells(quick=False)}
    hog = full["ps-async+hogbatch/slow/straggler/w2"].experiment
    assert (hog.strategy.name, hog.strategy.batch_split, hog.strategy.lock_free) == ("ps-async", "cluster", True)
    assert hog.cluster.slowdown == [1.0, 2.0]
    assert full["ddp+speeds/fast/straggler/w2"].experiment.strategy.batch_split == "cluster"
    assert full["dbs/slow/homogeneous/w2"].experiment.strategy.name == "dbs"

    kb = 150_000.0
    results = [_result("ddp", "fast", "homogeneous", 0.030, 0.97, kb, 0.002),
               _result("ddp", "fast", "straggler", 0.060, 0.97, kb, 0.002),
               _result("dbs", "fast", "straggler", 0.042, 0.97, kb, 0.002),
               _result("ddp+speeds", "fast", "straggler", 0.045, 0.97, kb, 0.002),
               _result("ps-async", "fast", "straggler", 0.020, 0.90, kb, 0.001),
               _result("ps-async+hogbatch", "fast", "straggler", 0.020, 0.93, kb, 0.001)]
    by_name = {h["headline"]: h for h in study.analyse(results, quick=False).headlines}
    dbs = by_name["DBS vs DDP with a straggler"]
    # (60 - 42) / (60 - 30) of the gap
    assert "step 42.0 ms vs DDP's 60.0 ms with it and 30.0 ms without: 60% of the gap" in dbs["measured"]
    assert dbs["verdict"].startswith("agrees")
    static = by_name["Heterogeneity-aware static batching (Hogbatch)"]
    assert "45.0 ms a step vs 60.0 ms" in static["measured"] and "accuracy 93.0%" in static["measured"]
    slower = [_result("ddp", "fast", "homogeneous", 0.030, 0.97, kb, 0.002),
              _result("ddp", "fast", "straggler", 0.060, 0.97, kb, 0.002),
              _result("dbs", "fast", "straggler", 0.063, 0.97, kb, 0.002)]
    dbs = {h["headline"]: h for h in study.analyse(slower, quick=True).headlines}["DBS vs DDP with a straggler"]
    assert "-10% of the gap" in dbs["measured"] and dbs["verdict"].startswith("differs")
