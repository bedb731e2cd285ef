"""Store, nothing lost: a launcher killed during a run or during ingestion, a locked store, several
processes writing at once, and stores that are not stores. Real processes, each with a timeout."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from conftest import SRC, run_cli
from ddlscope.runtime.rows import RowWriter, rank_file, read_records, run_files
from ddlscope.store import Store, StoreError

pytestmark = pytest.mark.multiprocess

DEAD_PID = 2**22 + 12345  # above Linux's largest pid_max: never a live process
STEP = dict(t_s=0.0, data_s=0.1, forward_s=0.1, backward_s=0.1, comm_wait_s=0.0, optimizer_s=0.1, step_s=0.4,
            comm_s=0.0, compute_cpu_s=0.2, samples=8, loss=1.0, bytes_sent=4)


# ---------------------------------------------------------------------------- helpers
def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(SRC), "COLUMNS": "200", **extra}


def _spawn(args: list[str], cwd: Path, **env: str) -> subprocess.Popen:
    """A process of its own session (so that a kill reaches only what the test means), output captured."""
    return subprocess.Popen([sys.executable, *args], cwd=cwd, env=_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.communicate(timeout=30)


def _wait_for(condition, timeout_s: float, what: str, poll_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _file_pairs(run_dir: Path) -> set[tuple[int, int]]:
    return {(r["rank"], r["step"]) for path in run_files(run_dir) for r in read_records(path) if r.get("kind") == "step"}


def _query(db: Path, sql: str, *params: object) -> list[tuple]:
    conn = sqlite3.connect(db)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def _integrity(db: Path) -> str:
    return _query(db, "PRAGMA integrity_check")[0][0]


def _new_run(store: Store, uuid: str, name: str = "t") -> int:
    return store.create_run(uuid=uuid, name=name, workload="mlp-digits", strategy="ddp", world_size=2,
                            config={}, code_version="test", seed=0, environment={})


def _write_rank_files(run_dir: Path, ranks: int, steps: int, last_event: tuple[str, str] | None = None) -> None:
    for rank in range(ranks):
        writer = RowWriter(rank_file(run_dir, rank), rank)
        for step in range(steps):
            writer.write("step", step=step, **STEP)
        if last_event:
            writer.event(*last_event)
        writer.close()


def _orphan(db: Path, uuid: str, ranks: int, steps: int, last_event: tuple[str, str] | None = None) -> int:
    """A run left `running` by a launcher that is gone, its rows only in its rank files."""
    from ddlscope.runtime.launcher import run_dir_for

    with Store(db) as store:
        run_id = _new_run(store, uuid)
        store.mark_running(run_id)
        store.conn.execute("UPDATE runs SET launcher_pid=? WHERE id=?", (DEAD_PID, run_id))
    _write_rank_files(run_dir_for(db, uuid), ranks, steps, last_event)
    return run_id


# ---------------------------------------------------------------------------- a launcher killed during a run
@pytest.mark.timeout(240)
def test_sigkill_of_the_launcher_mid_run_loses_no_row_and_never_shows_finished(tmp_path):
    db = tmp_path / "crash.db"
    launcher = _spawn(["-m", "ddlscope", "run", "--strategy", "ddp", "--world-size", "2", "--steps", "400", "--quiet",
                       "--db", str(db)], tmp_path)
    try:
        runs_dir = tmp_path / "ddlscope-runs"

        def enough_rows():
            dirs = list(runs_dir.glob("*")) if runs_dir.exists() else []
            return dirs[0] if dirs and len(_file_pairs(dirs[0])) >= 20 else None

        run_dir = _wait_for(enough_rows, 180, "20 step rows in the rank files")
        assert launcher.poll() is None, launcher.communicate()
        launcher.send_signal(signal.SIGKILL)  # the launcher only: its ranks die through PR_SET_PDEATHSIG
        launcher.communicate(timeout=30)
        rank_pids = [int(r["message"].split("pid=")[1].split()[0]) for path in run_files(run_dir)
                     for r in read_records(path) if r.get("kind") == "event" and r.get("event") == "started"]
        assert len(rank_pids) == 2
        _wait_for(lambda: not any(map(_running, rank_pids)), 30, "the ranks to die with their launcher")
    finally:
        _kill_group(launcher)
    written = _file_pairs(run_dir)
    assert 20 <= len(written) < 800
    assert _query(db, "SELECT status FROM runs") == [("running",)]  # what the launcher left
    assert _query(db, "SELECT COUNT(*) FROM steps") == [(0,)]

    # Two processes open the store at once: one recovers the run, the other finds it recovered.
    readers = [_spawn(["-m", "ddlscope", "runs", "--db", str(db)], tmp_path) for _ in range(2)]
    outputs = [p.communicate(timeout=120) for p in readers]
    assert [p.returncode for p in readers] == [0, 0], outputs
    assert all("Traceback" not in err for _, err in outputs)
    notes = [line for _, err in outputs for line in err.splitlines()]
    assert len(notes) == 1 and "launcher died" in notes[0] and f"{len(written)} step rows" in notes[0], notes
    assert all("failed" in out and "running" not in out and "finished" not in out for out, _ in outputs)

    assert _integrity(db) == "ok"
    (status, error), = _query(db, "SELECT status, error FROM runs")
    assert status == "failed" and error.startswith("launcher died")
    assert set(_query(db, "SELECT rank, step FROM steps")) == written
    assert _query(db, "SELECT COUNT(*) FROM steps") == [(len(written),)]
    assert _query(db, "SELECT COUNT(*) FROM events WHERE kind='recovered'") == [(1,)]
    again = run_cli("runs", "--db", str(db), cwd=tmp_path, timeout_s=60)
    assert again.returncode == 0 and again.stderr == "" and "failed" in again.stdout


# ---------------------------------------------------------------------------- a launcher killed while ingesting
INGEST = textwrap.dedent("""
    import sys
    from pathlib import Path
    from ddlscope.runtime import rows
    from ddlscope.runtime.launcher import ingest_run_dir, run_dir_for
    from ddlscope.store import Store

    db, uuid = Path(sys.argv[1]), sys.argv[2]
    rows.LARGE_INGEST_BYTES = int(sys.argv[3])
    store = Store(db)
    run_id = store.create_run(uuid=uuid, name="big", workload="mlp-digits", strategy="ddp", world_size=2,
                              config={}, code_version="test", seed=0, environment={})
    store.mark_running(run_id)
    rows = ingest_run_dir(store, run_id, run_dir_for(db, uuid))
    store.mark_done(run_id, "finished")
    print("done", rows, flush=True)
""")


def _bytes_on_disk(db: Path) -> int:
    return sum(path.stat().st_size for path in (db, Path(f"{db}-wal")) if path.exists())


# The WAL path, and the rollback journal of a large ingest (Store._bulk_load): "large" from 0 bytes.
@pytest.mark.timeout(240)
@pytest.mark.parametrize("journal, large_from_bytes", [("wal", 1 << 40), ("rollback", 0)])
def test_sigkill_mid_ingestion_leaves_a_sound_store_and_recovery_ingests_every_row(tmp_path, journal,
                                                                                    large_from_bytes):
    from ddlscope.runtime.launcher import run_dir_for

    db, uuid, steps = tmp_path / "big.db", "b" * 32, 100_000
    _write_rank_files(run_dir_for(db, uuid), 2, steps)
    script = tmp_path / "ingest.py"
    script.write_text(INGEST)
    ingester = _spawn([str(script), str(db), uuid, str(large_from_bytes)], tmp_path)
    try:
        # The transaction has begun and is spilling pages (into the WAL, or into the store itself
        # with the old ones in the rollback journal): the ingest is under way.
        _wait_for(lambda: _bytes_on_disk(db) > 4 << 20, 120, "the ingest to write 4 MiB", 0.02)
        assert ingester.poll() is None, ingester.communicate()
        ingester.send_signal(signal.SIGKILL)
        ingester.communicate(timeout=30)
    finally:
        _kill_group(ingester)
    assert ingester.returncode == -signal.SIGKILL

    if journal == "rollback":
        assert Path(f"{db}-journal").exists()  # hot: the next connection rolls the insert back
    assert _integrity(db) == "ok"
    assert _query(db, "SELECT status FROM runs") == [("running",)]  # never finished
    assert _query(db, "SELECT COUNT(*) FROM steps") == [(0,)]  # one transaction: nothing half-written

    listed = run_cli("runs", "--db", str(db), cwd=tmp_path, timeout_s=180)
    assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed.stderr
    assert f"{2 * steps} step rows" in listed.stderr and "failed" in listed.stdout
    assert _integrity(db) == "ok"
    assert _query(db, "SELECT status FROM runs") == [("failed",)]
    assert _query(db, "SELECT COUNT(*) FROM steps") == [(2 * steps,)]
    assert _query(db, "PRAGMA journal_mode") == [("wal",)]


# ---------------------------------------------------------------------------- a locked store
HOLD = textwrap.dedent("""
    import sqlite3, sys, time
    conn = sqlite3.connect(sys.argv[1], isolation_level=None)
    conn.execute("BEGIN EXCLUSIVE")
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
    released = time.time()
    conn.execute("COMMIT")
    print(released, flush=True)
""")


def _hold_lock(tmp_path: Path, db: Path, seconds: float) -> subprocess.Popen:
    script = tmp_path / "hold.py"
    script.write_text(HOLD)
    holder = _spawn([str(script), str(db), str(seconds)], tmp_path)
    assert holder.stdout.readline().strip() == "held"
    return holder


@pytest.mark.timeout(240)
def test_a_run_that_finds_the_store_locked_at_ingest_waits_past_the_busy_timeout_and_keeps_every_row(tmp_path):
    """sqlite's own busy timeout (1 s here, 30 s by default) is one try; the store keeps trying."""
    db = tmp_path / "locked.db"
    steps, busy_s = 60, 1.0
    run = _spawn(["-m", "ddlscope", "run", "--strategy", "ddp", "--world-size", "2", "--steps", str(steps), "--quiet",
                  "--db", str(db)], tmp_path, DDLSCOPE_STORE_BUSY_TIMEOUT_S=str(busy_s), DDLSCOPE_STORE_LOCK_WAIT_S="120")
    holder = None
    try:
        runs_dir = tmp_path / "ddlscope-runs"
        _wait_for(lambda: runs_dir.exists() and any(runs_dir.glob("*/rank-0.jsonl")), 180, "the ranks to start")
        holder = _hold_lock(tmp_path, db, 12)  # training ends while the store is locked
        out, err = run.communicate(timeout=180)
        released = float(holder.communicate(timeout=30)[0].strip())
    finally:
        _kill_group(run)
        if holder:
            _kill_group(holder)
    assert run.returncode == 0 and "Traceback" not in err, err
    (status, finished_at, run_dir), = [(s, f, u) for s, f, u in _query(db, "SELECT status, finished_at, uuid FROM runs")]
    assert status == "finished"
    assert _query(db, "SELECT COUNT(*) FROM steps") == [(2 * steps,)]
    last_row = _query(db, "SELECT MAX(t) FROM events WHERE rank >= 0")[0][0]
    assert last_row < released - 2 * busy_s < finished_at, "the ingest did not wait for the lock"
    assert _integrity(db) == "ok"


@pytest.mark.timeout(120)
def test_a_store_locked_past_the_bound_is_one_line_not_a_traceback(tmp_path):
    db = tmp_path / "locked.db"
    Store(db).close()
    holder = _hold_lock(tmp_path, db, 30)
    try:
        result = _spawn(["-m", "ddlscope", "run", "--strategy", "ddp", "--world-size", "2", "--steps", "5", "--quiet",
                         "--db", str(db)], tmp_path, DDLSCOPE_STORE_BUSY_TIMEOUT_S="0.5", DDLSCOPE_STORE_LOCK_WAIT_S="2")
        out, err = result.communicate(timeout=90)
    finally:
        _kill_group(holder)
    assert result.returncode == 2
    assert len(err.splitlines()) == 1 and "locked by another process for 2 s" in err, err
    reads = run_cli("runs", "--db", str(db), cwd=tmp_path, timeout_s=60)  # reading never waited on it
    assert reads.returncode == 0


# ---------------------------------------------------------------------------- several processes at once
WRITE = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from ddlscope.runtime.launcher import ingest_run_dir, run_dir_for
    from ddlscope.store import Store

    db, uuid, go = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    while not go.exists():
        time.sleep(0.01)
    with Store(db) as store:  # the first of them creates the store
        run_id = store.create_run(uuid=uuid, name=uuid[:4], workload="mlp-digits", strategy="ddp", world_size=2,
                                  config={}, code_version="test", seed=0, environment={})
        store.mark_running(run_id)
        for _ in range(3):  # ingesting again changes nothing
            ingest_run_dir(store, run_id, run_dir_for(db, uuid))
            store.add_event(run_id, "ingested", uuid)
        store.mark_done(run_id, "finished")
""")


@pytest.mark.timeout(180)
def test_concurrent_processes_on_one_store_lose_no_row(tmp_path):
    from ddlscope.runtime.launcher import run_dir_for

    db, go, steps = tmp_path / "shared.db", tmp_path / "go", 20_000
    uuids = [c * 32 for c in "abc"]
    for uuid in uuids:
        _write_rank_files(run_dir_for(db, uuid), 2, steps)
    script = tmp_path / "write.py"
    script.write_text(WRITE)
    # A short busy timeout: sqlite alone would give up while another process ingests; the store retries.
    writers = [_spawn([str(script), str(db), uuid, str(go)], tmp_path, DDLSCOPE_STORE_BUSY_TIMEOUT_S="0.05")
               for uuid in uuids]
    try:
        time.sleep(3)  # each has imported what it needs and waits
        go.touch()
        outputs = [w.communicate(timeout=150) for w in writers]
    finally:
        for w in writers:
            _kill_group(w)
    assert [w.returncode for w in writers] == [0, 0, 0], outputs
    assert _integrity(db) == "ok"
    assert sorted(_query(db, "SELECT r.uuid, r.status, COUNT(s.step) FROM runs r JOIN steps s ON s.run_id = r.id"
                             " GROUP BY r.id")) == [(u, "finished", 2 * steps) for u in uuids]
    assert _query(db, "SELECT COUNT(*) FROM events WHERE kind='ingested'") == [(9,)]


# ---------------------------------------------------------------------------- stores that are not stores
def _garbage(path: Path) -> None:
    path.write_bytes(bytes(range(256)) * 20)


def _truncated(path: Path) -> None:
    real = path.with_name("real.db")
    with Store(real) as store:
        _new_run(store, "e" * 32)
    path.write_bytes(real.read_bytes()[:100])


def _directory(path: Path) -> None:
    path.mkdir()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("make", [_garbage, _truncated, _directory])
def test_a_store_that_is_not_a_store_is_one_line_and_exit_2(tmp_path, make):
    db = tmp_path / "bad.db"
    make(db)
    for command in (["runs"], ["show", "1"], ["run", "--strategy", "ddp", "--world-size", "2", "--steps", "3", "--quiet"]):
        result = run_cli(*command, "--db", str(db), cwd=tmp_path, timeout_s=120)
        assert result.returncode == 2, (command, result)
        assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("error: "), (command, result.stderr)
        assert "bad.db" in result.stderr and result.stdout == ""
    assert not (tmp_path / "ddlscope-runs").exists()


def _as_another_user() -> list[str]:
    """A command prefix that runs as the user nobody when this is root (for whom chmod stops nothing)."""
    if os.geteuid() != 0:
        return []
    prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    try:
        ok = subprocess.run([*prefix, sys.executable, "-c", "pass"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    if not ok:
        pytest.skip("running as root, where a read-only file can still be written, and setpriv cannot run "
                    "this Python as the user nobody")
    return prefix


@pytest.mark.timeout(180)
def test_a_read_only_store_is_read_but_a_run_is_refused_in_one_line(tmp_path):
    prefix = _as_another_user()
    home = Path(tempfile.mkdtemp(prefix="ddlscope-ro-"))
    try:
        home.chmod(0o777)
        db = home / "ro.db"
        with Store(db) as store:
            _new_run(store, "f" * 32)
        db.chmod(0o444)

        def cli(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([*prefix, sys.executable, "-m", "ddlscope", *args, "--db", str(db)], cwd=home,
                                  env=_env(), capture_output=True, text=True, timeout=120)

        listed = cli("runs")
        assert listed.returncode == 0 and listed.stderr == "" and "mlp-digits" in listed.stdout, listed
        refused = cli("run", "--strategy", "ddp", "--world-size", "2", "--steps", "3", "--quiet")
        assert refused.returncode == 2, refused
        assert len(refused.stderr.splitlines()) == 1 and "read-only" in refused.stderr, refused.stderr
        assert _query(db, "SELECT COUNT(*) FROM runs") == [(1,)]
        db.chmod(0o000)
        unreadable = cli("runs")
        assert unreadable.returncode == 2 and len(unreadable.stderr.splitlines()) == 1, unreadable
        assert "not readable" in unreadable.stderr or "permission denied" in unreadable.stderr
    finally:
        shutil.rmtree(home, ignore_errors=True)


# ---------------------------------------------------------------------------- run lookups
def test_a_uuid_prefix_is_matched_literally(tmp_path):
    db = tmp_path / "s.db"
    with Store(db) as store:
        first = _new_run(store, "abcdef0123456789" * 2)
        _new_run(store, "abcdef9999456789" * 2, name="second")
        assert store.get_run("abcdef01").id == first
        for wildcard in ("______", "%%%%%%", "abcde%", "abcd_f01"):
            with pytest.raises(StoreError, match="no run"):
                store.get_run(wildcard)
        with pytest.raises(StoreError, match="2 runs"):
            store.get_run("abcdef")  # a prefix of both
    for wildcard in ("______", "%%%%%%"):
        shown = run_cli("show", wildcard, "--db", str(db), cwd=tmp_path, timeout_s=60)
        assert shown.returncode == 2 and shown.stderr.startswith("error: no run"), shown


# ---------------------------------------------------------------------------- recovery, in one process
def test_recovery_marks_an_interrupted_run_interrupted_and_leaves_live_and_foreign_runs_alone(tmp_path):
    from ddlscope.runtime.recovery import recover_orphaned_runs

    db = tmp_path / "r.db"
    interrupted = _orphan(db, "1" * 32, 2, 7, ("error", "KeyboardInterrupt: "))
    died = _orphan(db, "2" * 32, 2, 5)
    with Store(db) as store:
        live = _new_run(store, "3" * 32)  # this process is its launcher
        store.mark_running(live)
        foreign = _new_run(store, "4" * 32)
        store.conn.execute("UPDATE runs SET launcher_pid=?, host='elsewhere' WHERE id=?", (DEAD_PID, foreign))
        no_files = _new_run(store, "5" * 32)
        store.conn.execute("UPDATE runs SET launcher_pid=? WHERE id=?", (DEAD_PID, no_files))  # died at `created`

        recovered = {r.run_id: r for r in recover_orphaned_runs(store, db)}
        assert sorted(recovered) == [interrupted, died, no_files]
        assert recovered[interrupted].status == "interrupted" and recovered[died].status == "failed"
        assert recovered[died].error == f"launcher died (pid {DEAD_PID}); rows recovered from the rank files: 10 step rows"
        assert "no rank files" in recovered[no_files].error
        assert store.count_steps(interrupted) == 14 and store.count_steps(died) == 10
        assert {r.id: r.status for r in store.list_runs()} == {
            interrupted: "interrupted", died: "failed", live: "running", foreign: "created", no_files: "failed"}
        assert recover_orphaned_runs(store, db) == []  # once only
        assert [e["kind"] for e in store.events(died)] == ["recovered"]
