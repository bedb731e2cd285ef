"""The speedup's denominator: the newest finished one-process run of the same workload, whatever its
schedule (steps, evaluations); a workload that computes another step is not it."""

from __future__ import annotations

from pathlib import Path

from ddlscope.analysis.summary import find_single_baseline
from ddlscope.store import Store

DIGITS = {"name": "mlp-digits", "batch_size": 64, "steps": 100, "eval_every": 0, "eval_batches": 0, "lr": 0.1}


def _run(store: Store, name: str, strategy: str, workload: dict) -> int:
    run_id = store.create_run(uuid=name.ljust(32, "0"), name=name, workload=workload["name"], strategy=strategy,
                              world_size=1 if strategy == "single" else 2,
                              config={"name": name, "workload": workload, "strategy": {"name": strategy}},
                              code_version="test", seed=0, environment={})
    store.mark_done(run_id, "finished")
    return run_id


def test_the_baseline_may_train_for_another_number_of_steps(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db") as store:
        single = _run(store, "base", "single", DIGITS)
        _run(store, "bigger", "single", {**DIGITS, "batch_size": 128})  # another step: never the baseline
        ddp = _run(store, "ddp", "ddp", {**DIGITS, "steps": 50, "eval_every": 10})
        other = _run(store, "ddp-128", "ddp", {**DIGITS, "batch_size": 32, "steps": 50})
        assert find_single_baseline(store, store.get_run(str(ddp))).id == single
        assert find_single_baseline(store, store.get_run(str(other))) is None  # no single run at batch 32
        assert find_single_baseline(store, store.get_run(str(single))) is None  # a baseline has none
