"""The check every strategy's step rows must pass, made on runs the suite already makes.

A step row's parts (data, forward, backward, comm_wait, optimizer) are non-negative and add up to its
step_s, and a strategy whose forward pass communicates (traits.collective_forward) waits in comm_wait_s.
Both fail when the runtime's split (runtime/timer.py: step_phases) leaves exposed communication in a
compute phase as well as in comm_wait_s, or takes out more than the phase held.

The suite is at its time limit, so no strategy gets a run for this check alone: CHECKED_IN names, per
registered strategy, the test module that passes its rows here, and test_step_hook.py's contract test
fails for a strategy registered without one.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest

PARTS = ("data_s", "forward_s", "backward_s", "comm_wait_s", "optimizer_s")

CHECKED_IN = {
    "single": "test_step_hook.py",
    "ddp": "test_run_e2e.py",
    "localsgd": "test_dataparallel_equivalence.py",
    "gossip": "test_dataparallel_equivalence.py",
    "hpsgd": "test_dataparallel_equivalence.py",
    "osp": "test_dataparallel_equivalence.py",
    "cocod": "test_dataparallel_equivalence.py",
    "diloco": "test_dataparallel_equivalence.py",
    "dbs": "test_batching.py",
    "fedavg": "test_federated.py",
    "mc-psgd": "test_federated.py",
    "mm-psgd": "test_federated.py",
    "fsdp": "test_fsdp.py",
    "nodepar": "test_graph.py",
    "pipeline": "test_pipeline.py",
    "tp": "test_pipeline.py",
    "partitioned": "test_partitioned.py",
    "ps-sync": "test_omnivore.py",
    "ps-async": "test_omnivore.py",
    "ps-stale-aware": "test_omnivore.py",
    "omnivore": "test_omnivore.py",
    "ssp": "test_ps.py",
}


def assert_step_phases(rows: Iterable[Mapping[str, Any]], strategy: str) -> None:
    """Check the step rows of one run of `strategy` (other records, e.g. evaluations, are skipped)."""
    from ddlscope.specs import STRATEGY_SPECS

    communicates_in_forward = STRATEGY_SPECS.get(strategy).traits.collective_forward
    steps = [r for r in rows if r.get("kind", "step") == "step"]
    assert steps, f"{strategy}: no step rows to check"
    for r in steps:
        where = f"{strategy} rank {r.get('rank')} step {r.get('step')}: {dict(r)}"
        assert all(r[p] >= 0 for p in PARTS), where
        assert sum(r[p] for p in PARTS) == pytest.approx(r["step_s"], rel=1e-9), where
        if communicates_in_forward:
            assert r["comm_wait_s"] > 0, where


def assert_store_phases(db: Path) -> set[str]:
    """Check every run in the store at `db`; returns the strategies its runs were."""
    with sqlite3.connect(db) as conn:
        conn.row_factory = sqlite3.Row
        runs = conn.execute("SELECT id, strategy FROM runs").fetchall()
        for run in runs:
            rows = conn.execute("SELECT * FROM steps WHERE run_id = ?", (run["id"],))
            assert_step_phases([dict(r) for r in rows], run["strategy"])
    return {run["strategy"] for run in runs}
