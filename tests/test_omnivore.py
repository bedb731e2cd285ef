"""omnivore (PAPERS.md item 15): groups = 1 is ps-sync's update, groups = workers is ps-async's, and groups in
between all-reduce inside a group and push once per group.

Five processes (4 workers + 1 server), started once through the project's launcher, run every configuration
below in turn with the real training loop and the one server loop, on mlp-digits with momentum. ps-async's
arrival order is a race, so the "sequential" configurations make it deterministic: worker r starts only once
worker r - 1 has finished (nothing but the server connects them), so both protocols see the same pushes in the
same order, and must end with the same models, worker by worker.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from phase_checks import assert_step_phases

pytestmark = [pytest.mark.multiprocess, pytest.mark.cli_in_this_process]

STEPS, WORKERS = 5, 4
COMMON = {"workload.name": "mlp-digits", "workload.steps": STEPS, "workload.batch_size": 32, "workload.lr": 0.2,
          "workload.momentum": 0.9, "workload.eval_batches": 1, "cluster.world_size": WORKERS, "seed": 3}
CONFIGS: dict[str, tuple[dict[str, Any], bool]] = {  # label: (overrides, sequential)
    "ps-sync": ({"strategy.name": "ps-sync"}, False),
    "omnivore-1": ({"strategy.name": "omnivore", "strategy.groups": 1}, False),
    "ps-async-seq": ({"strategy.name": "ps-async"}, True),
    "omnivore-4-seq": ({"strategy.name": "omnivore", "strategy.groups": WORKERS}, True),
    "omnivore-2": ({"strategy.name": "omnivore", "strategy.groups": 2}, False),
    # trained for its step rows' phase check alone (tests/phase_checks.py): no other test trains it
    "ps-stale-aware": ({"strategy.name": "ps-stale-aware"}, False),
}


def train_all(out_dir: str) -> dict[str, Any]:
    """One rank: every configuration in turn; returns its final models and its rows (a server: its updates)."""
    import torch.distributed as dist

    from ddlscope.runtime.config import load_experiment
    from ddlscope.runtime.loop import train
    from ddlscope.runtime.ps_server import serve
    from ddlscope.runtime.rows import RowWriter, read_records
    from ddlscope.strategies import RunContext, runtime_class
    from ddlscope.workloads import WORKLOADS

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    worker_group = dist.new_group(list(range(WORKERS)))
    models, rows = {}, {}
    try:
        for label, (overrides, sequential) in CONFIGS.items():
            exp = load_experiment(None, {**COMMON, **overrides})
            ctx = RunContext(rank, world, rank, 0, torch.device("cpu"), "gloo", exp, None, WORKERS, worker_group)
            task = WORKLOADS.get(exp.workload.name).build(exp.workload, exp.seed)
            strategy = runtime_class(exp.strategy)(exp.strategy, ctx)  # every rank: it may make groups
            path = Path(out_dir) / f"{label}-{rank}.jsonl"
            writer = RowWriter(path, rank)
            if strategy.is_server():
                serve(task, strategy, ctx, writer)
            else:
                if sequential and rank > 0:
                    _wait_for(Path(out_dir) / f"{label}-{rank - 1}.done")
                result = train(task, strategy, ctx, writer)
                models[label] = {k: v.detach().clone() for k, v in result.model.state_dict().items()}
                (Path(out_dir) / f"{label}-{rank}.done").touch()
            writer.close()
            rows[label] = list(read_records(path))
            dist.barrier()  # no rank starts the next configuration while the server still serves this one
    finally:
        dist.destroy_process_group()
    return {"models": models, "rows": rows}


def _wait_for(path: Path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    from ddlscope.runtime.launcher import launch_processes

    out = tmp_path_factory.mktemp("omnivore")
    return launch_processes(train_all, (str(out),), WORKERS + 1, run_id=f"omnivore-{os.getpid()}")


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def kind(rows: list[dict], name: str) -> list[dict]:
    return [r for r in rows if r.get("kind") == name]


@pytest.mark.timeout(300)
def test_one_group_is_ps_sync(trained):
    for rank in range(WORKERS):
        assert max_difference(trained[rank]["models"]["omnivore-1"], trained[rank]["models"]["ps-sync"]) < 1e-6
        losses = [r["loss"] for r in kind(trained[rank]["rows"]["omnivore-1"], "step")]
        assert losses == pytest.approx([r["loss"] for r in kind(trained[rank]["rows"]["ps-sync"], "step")], abs=1e-6)
    # One push a step (the leader's), where ps-sync takes one from every worker.
    server = trained[WORKERS]["rows"]
    assert [u["worker"] for u in kind(server["omnivore-1"], "update")] == [0] * STEPS
    assert len(kind(server["ps-sync"], "update")) == WORKERS * STEPS


@pytest.mark.timeout(300)
def test_one_worker_per_group_is_ps_async_in_the_same_arrival_order(trained):
    server = trained[WORKERS]["rows"]
    order = [(u["worker"], u["worker_step"], u["staleness"]) for u in kind(server["ps-async-seq"], "update")]
    # The sequence forced: worker w's first push was computed on the initial model, w x STEPS updates ago.
    assert order == [(w, s, w * STEPS if s == 0 else 0) for w in range(WORKERS) for s in range(STEPS)]
    assert [(u["worker"], u["worker_step"], u["staleness"]) for u in kind(server["omnivore-4-seq"], "update")] == order
    for rank in range(WORKERS):
        assert max_difference(trained[rank]["models"]["omnivore-4-seq"], trained[rank]["models"]["ps-async-seq"]) < 1e-6
    # ... and not ps-sync's: the scaling by 1/groups and the staleness differ from one averaged step
    assert max_difference(trained[0]["models"]["omnivore-4-seq"], trained[0]["models"]["ps-sync"]) > 1e-4


@pytest.mark.timeout(300)
def test_two_groups_all_reduce_inside_and_push_once_per_group(trained):
    models, server = trained, trained[WORKERS]["rows"]["omnivore-2"]
    updates = kind(server, "update")
    assert sorted(u["worker"] for u in updates) == [0] * STEPS + [2] * STEPS  # the leaders only
    push_bytes = updates[0]["bytes"]
    assert all(u["bytes"] == push_bytes for u in updates) and push_bytes > 0
    for leader, member in ((0, 1), (2, 3)):  # the leader's broadcast: one model per group
        assert max_difference(models[leader]["models"]["omnivore-2"], models[member]["models"]["omnivore-2"]) == 0
        # Bytes a step: the group's all-reduce and broadcast of the whole model; the leader's push on top.
        for rank, expected in ((leader, 3 * push_bytes), (member, 2 * push_bytes)):
            assert [r["bytes_sent"] for r in kind(trained[rank]["rows"]["omnivore-2"], "step")] == [expected] * STEPS
    losses = [r["loss"] for r in kind(trained[0]["rows"]["omnivore-2"], "step")]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    # Asynchronous across groups: close to the synchronous update, but not far from it
    assert max_difference(models[0]["models"]["omnivore-2"], models[0]["models"]["ps-sync"]) < 0.5


@pytest.mark.timeout(300)
def test_every_workers_step_phases_add_up(trained):
    for label, (overrides, _) in CONFIGS.items():
        for rank in range(WORKERS):
            assert_step_phases(trained[rank]["rows"][label], overrides["strategy.name"])


@pytest.mark.timeout(300)
def test_the_tuner_probes_measures_prints_and_reuses_its_probe(cli):
    """The multi-process half of the tuner, on one probe (the choice among several is test_omnivore_units')."""
    args = ("omnivore-tune", "--workers", "2", "--groups", "2", "--lowered-only", "--steps", "6")
    first = cli(*args, timeout_s=280)
    assert first.returncode == 0, first.stderr
    assert first.stderr.count(": running") == 1  # the probe w2/g2/m0.4: momentum 0.9 lowered by 1 - 1/2
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in first.stdout.splitlines()
            if line.startswith("│")]
    assert len(rows) == 1 and rows[0][:3] == ["2", "0.4", "0.50"] and rows[0][-1] == "<-"
    ms_per_step, us_per_sample = float(rows[0][3]), float(rows[0][4])
    assert ms_per_step > 0 and us_per_sample == pytest.approx(ms_per_step * 1e3 / 32, rel=0.02, abs=1)
    chose = [line for line in first.stdout.splitlines() if line.startswith("chose groups=2, momentum=0.4")]
    assert len(chose) == 1 and "predicted to loss" in chose[0]
    # The probe is in the store: a second call runs nothing and chooses the same from the same numbers.
    again = cli(*args, timeout_s=120)
    assert again.returncode == 0 and again.stderr.count(": reused") == 1 and ": running" not in again.stderr
    assert [line for line in again.stdout.splitlines() if line.startswith("chose groups=")] == chose
