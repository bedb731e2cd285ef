"""The speedup's denominator: the newest finished one-process run of the same workload, whatever its
schedule (steps, evaluations); a workload that computes another step is not it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

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


def test_one_network_emulated_at_different_scales_is_flagged(tmp_path: Path) -> None:
    from ddlscope.analysis.summary import emulation_scale_notes

    def run(run_id: int, profile: str, factor: float | None):
        network = {"profile": profile, "emulated": True, "scaled": factor is not None, "scale_factor": factor}
        return SimpleNamespace(id=run_id, environment={"network": network})

    alike = [run(1, "slow", 1000.0), run(2, "slow", 1090.0), run(3, "fast", 50.0)]
    assert emulation_scale_notes(alike) == []  # within 10%: one emulated network
    (note,) = emulation_scale_notes([*alike, run(4, "slow", 601.0), run(5, "fast", None)])
    assert note.startswith("network 'slow' was emulated at different scales here: x1/601 (run 4) to x1/1090 (run 2)")
    assert "1.81x" in note
