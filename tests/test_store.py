"""The store: idempotent ingestion, torn lines, statuses, lookups."""

import json

import pytest

from ddlscope.runtime.rows import RowWriter, rank_file, read_records
from ddlscope.store import Store, StoreError


def _new_run(store: Store, uuid: str = "a" * 32) -> int:
    return store.create_run(uuid=uuid, name="t", workload="mlp-digits", strategy="ddp", world_size=2,
                            config={"workload": {"name": "mlp-digits"}}, code_version="test", seed=0,
                            environment={"cores": 2})


def _write_rows(run_dir, rank: int, steps: int) -> None:
    writer = RowWriter(rank_file(run_dir, rank), rank)
    for step in range(steps):
        writer.write("step", step=step, t_s=0.0, data_s=0.1, forward_s=0.1, backward_s=0.1, comm_wait_s=0.0,
                     optimizer_s=0.1, step_s=0.4, comm_s=0.0, compute_cpu_s=0.2, samples=8, loss=1.0, bytes_sent=4)
    writer.write("memory", bytes={"parameters": 100, "activations": 50})
    writer.event("train_end", "ok")
    writer.close()


def test_ingest_twice_neither_loses_nor_duplicates(tmp_path):
    from ddlscope.runtime.launcher import ingest_run_dir

    for rank in (0, 1):
        _write_rows(tmp_path / "run", rank, 5)
    with Store(tmp_path / "s.db") as store:
        run_id = _new_run(store)
        first = ingest_run_dir(store, run_id, tmp_path / "run")
        second = ingest_run_dir(store, run_id, tmp_path / "run")
        assert first == second == {"step": 10, "eval": 0, "memory": 2, "event": 2, "update": 0}
        assert store.count_steps(run_id) == 10
        assert len(store.memory(run_id)) == 4 and len(store.events(run_id)) == 2


def test_line_cut_short_by_a_dying_process_is_skipped(tmp_path):
    _write_rows(tmp_path, 0, 3)
    with open(rank_file(tmp_path, 0), "a") as f:
        f.write('{"kind":"step","rank":0,"step":3,"t_s"')  # the process died mid-write
    records = list(read_records(rank_file(tmp_path, 0)))
    assert [r["step"] for r in records if r["kind"] == "step"] == [0, 1, 2]


def test_failed_ingest_writes_nothing(tmp_path):
    with Store(tmp_path / "s.db") as store:
        run_id = _new_run(store)
        good = {"kind": "step", "rank": 0, "step": 0, "step_s": 1.0}
        with pytest.raises(KeyError):
            store.ingest(run_id, [good, {"kind": "memory", "rank": 0}])  # malformed: no "bytes"
        assert store.count_steps(run_id) == 0


def test_status_lifecycle_and_lookup(tmp_path):
    with Store(tmp_path / "s.db") as store:
        run_id = _new_run(store)
        assert store.get_run(run_id).status == "created"
        store.mark_running(run_id)
        assert store.get_run("t").status == "running"
        store.mark_done(run_id, "failed", "rank 1 died")
        run = store.get_run("aaaaaa")  # uuid prefix
        assert run.status == "failed" and run.error == "rank 1 died" and run.finished_at
        with pytest.raises(ValueError):
            store.mark_done(run_id, "running")
        with pytest.raises(StoreError):
            store.get_run("999")


def test_store_refuses_a_file_that_is_not_sqlite(tmp_path):
    bad = tmp_path / "bad.db"
    bad.write_text("not a database " * 100)
    with pytest.raises(StoreError):
        Store(bad)


def test_config_round_trips_as_json(tmp_path):
    with Store(tmp_path / "s.db") as store:
        run_id = _new_run(store)
        assert json.loads(json.dumps(store.get_run(run_id).config)) == {"workload": {"name": "mlp-digits"}}


def test_scaling_table_grows_phases_relative_to_the_smallest_world(tmp_path):
    from ddlscope.analysis.scaling import latest_per_world_size, scaling_table

    with Store(tmp_path / "s.db") as store:
        for n, world in enumerate((2, 4)):
            run_id = store.create_run(uuid=f"{n:032x}", name="", workload="mlp-digits", strategy="ddp",
                                      world_size=world, config={"workload": {"name": "mlp-digits"}},
                                      code_version="test", seed=0, environment={"cores": 8})
            comm = 0.01 * world
            store.ingest(run_id, [{"kind": "step", "rank": r, "step": s, "t_s": 0.0, "data_s": 0.001,
                                   "forward_s": 0.002, "backward_s": 0.002, "comm_wait_s": comm, "optimizer_s": 0.001,
                                   "step_s": 0.006 + comm, "comm_s": comm, "compute_cpu_s": 0.004, "samples": 16,
                                   "loss": 1.0, "bytes_sent": 10} for r in range(world) for s in range(3)])
            store.mark_done(run_id, "finished")
        rows = scaling_table(store, latest_per_world_size(store, "mlp-digits", "ddp"))
    assert [r.world_size for r in rows] == [2, 4]
    assert rows[1].breakdown_growth["comm_wait_s"] == pytest.approx(2.0)
    assert rows[1].breakdown_growth["forward_s"] == pytest.approx(1.0)


def test_a_store_left_in_rollback_mode_is_back_in_wal_when_next_opened(tmp_path):
    """As a large ingest killed mid-way leaves it (see Store._bulk_load)."""
    import sqlite3
    from contextlib import closing

    Store(tmp_path / "s.db").close()
    with closing(sqlite3.connect(tmp_path / "s.db")) as conn:
        assert conn.execute("PRAGMA journal_mode=DELETE").fetchone()[0] == "delete"
    with Store(tmp_path / "s.db") as store:
        assert store.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
