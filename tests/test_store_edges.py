"""The store and the disk: a store replaced during a run, full and read-only filesystems, foreign and
special files given as --db or -o, and every written output going through store.atomic_output.

Full and read-only filesystems are small tmpfs mounts made here (root only; skipped otherwise)."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import sqlite3
import stat
import subprocess
from pathlib import Path

import pytest

from ddlscope.cli import main
from ddlscope.runtime.rows import RowWriter, rank_file, run_dir_for
from ddlscope.store import OutputError, Store, StoreError, atomic_output

DEAD_PID = 2**22 + 12345  # above Linux's largest pid_max: never a live process
STEP = dict(t_s=0.0, data_s=0.1, forward_s=0.1, backward_s=0.1, comm_wait_s=0.0, optimizer_s=0.1, step_s=0.4,
            comm_s=0.0, compute_cpu_s=0.2, samples=8, loss=1.0, bytes_sent=4)


# ---------------------------------------------------------------------------- helpers
@pytest.fixture
def small_fs(tmp_path: Path):
    """A 2 MiB tmpfs; `fill()` takes its last free byte, `read_only()` remounts it read-only."""
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {made.stderr.decode().strip()}")

    class SmallFs:
        path = mount

        @staticmethod
        def fill() -> Path:
            filler = mount / "filler"
            with open(filler, "wb", buffering=0) as f:
                try:
                    while True:
                        f.write(b"\0" * 4096)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC
            return filler

        @staticmethod
        def read_only() -> None:
            subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)

    try:
        yield SmallFs
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def _new_run(store: Store, uuid: str = "a" * 32, world_size: int = 2) -> int:
    return store.create_run(uuid=uuid, name="t", workload="mlp-digits", strategy="ddp", world_size=world_size,
                            config={"workload": {"name": "mlp-digits"}}, code_version="test", seed=0,
                            environment={"cores": 2})


def _write_rank_files(run_dir: Path, ranks: int, steps: int) -> None:
    for rank in range(ranks):
        writer = RowWriter(rank_file(run_dir, rank), rank)
        for step in range(steps):
            writer.write("step", step=step, **STEP)
        writer.close()


def _store_with_run(db: Path, steps: int = 5) -> int:
    with Store(db) as store:
        run_id = _new_run(store)
        store.ingest(run_id, ({"kind": "step", "rank": r, "step": s, **STEP} for r in (0, 1) for s in range(steps)))
        store.mark_done(run_id, "finished")
    return run_id


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def _launch_result(run_dir: Path, run_id: int, status: str = "finished"):
    from ddlscope.runtime.launcher import LaunchResult

    return LaunchResult(status, run_id, run_dir)


# ---------------------------------------------------------------------------- a store replaced during a run
def test_a_store_replaced_during_a_run_keeps_the_rank_files_and_names_them(tmp_path):
    from ddlscope.runtime.launcher import store_rows_and_status

    db = tmp_path / "s.db"
    store = Store(db)
    run_id = _new_run(store)
    run_dir = run_dir_for(db, "a" * 32)
    _write_rank_files(run_dir, 2, 3)
    other = tmp_path / "other.db"
    other.write_bytes(b"not a store, renamed over the real one")
    os.replace(other, db)  # what `mv other.db s.db` does while the run trains
    try:
        with pytest.raises(StoreError) as caught:
            store_rows_and_status(store, run_id, _launch_result(run_dir, run_id), 6, [])
    finally:
        store.close()
    assert f"store {db} was replaced" in str(caught.value) and str(run_dir) in str(caught.value)
    assert sorted(p.name for p in run_dir.glob("rank-*.jsonl")) == ["rank-0.jsonl", "rank-1.jsonl"]
    assert db.read_bytes() == b"not a store, renamed over the real one"


# ---------------------------------------------------------------------------- full disks
@pytest.mark.timeout(60)
def test_a_full_store_keeps_the_rows_and_recovery_gives_the_launchers_verdict(small_fs, capsys):
    from ddlscope.runtime.launcher import reserve_outcome, store_rows_and_status

    db = small_fs.path / "s.db"
    store = Store(db)
    run_id = _new_run(store)
    store.mark_running(run_id)
    store.conn.execute("UPDATE runs SET launcher_pid=? WHERE id=?", (DEAD_PID, run_id))  # recovery's to take
    run_dir = run_dir_for(db, "a" * 32)
    _write_rank_files(run_dir, 2, 50)
    reserve_outcome(run_dir)
    filler = small_fs.fill()
    try:
        with pytest.raises(StoreError) as caught:
            store_rows_and_status(store, run_id, _launch_result(run_dir, run_id), 100, [])
    finally:
        store.close()
    assert "disk is full" in str(caught.value) and str(run_dir) in str(caught.value)
    assert "marks the run finished" in str(caught.value)
    assert run_dir.is_dir()

    filler.unlink()  # space freed: the next command that opens the store stores the rows
    assert main(["runs", "--db", str(db)]) == 0
    assert f"run {run_id}: rows stored from {run_dir}; marked finished" in capsys.readouterr().err
    with Store(db) as store:
        run = store.get_run(run_id)
        assert (run.status, store.count_steps(run_id)) == ("finished", 100)
    assert not run_dir.exists()


def test_a_failed_run_on_a_full_disk_says_so_and_recovery_keeps_that_cause(small_fs):
    from ddlscope.runtime.launcher import full_disk_of
    from ddlscope.runtime.recovery import recover_orphaned_runs
    from ddlscope.runtime.rows import record_outcome, reserve_outcome

    run_dir = small_fs.path / "ddlscope-runs" / ("a" * 32)
    run_dir.mkdir(parents=True)
    reserve_outcome(run_dir)
    assert full_disk_of(run_dir) is None
    small_fs.fill()
    cause = full_disk_of(run_dir, small_fs.path / "not-yet" / "checkpoints")
    assert cause is not None and cause.startswith(f"no space left on device: the filesystem of {run_dir} is full")
    record_outcome(run_dir, "failed", cause, 100)  # over the reserved bytes: no new space needed

    db = small_fs.path.parent / "s.db"  # the store elsewhere, its run folder on the full disk
    with Store(db) as store:
        run_id = _new_run(store)
        store.conn.execute("UPDATE runs SET status='running', launcher_pid=? WHERE id=?", (DEAD_PID, run_id))
    (db.parent / "ddlscope-runs").symlink_to(small_fs.path / "ddlscope-runs")
    with Store(db) as store:
        [recovered] = recover_orphaned_runs(store, db)
        assert (recovered.status, recovered.error) == ("failed", cause)
        assert "launcher died" not in store.get_run(run_id).error


@pytest.mark.timeout(120)
def test_a_run_whose_checkpoint_folder_is_full_fails_in_one_line_naming_it_and_leaves_no_partial(tmp_path, small_fs):
    from conftest import run_cli

    small_fs.fill()
    checkpoints = small_fs.path / "ck"
    out = run_cli("run", "--steps", "4", "--checkpoint-every", "2", "-q", "--set", f'checkpoint_dir="{checkpoints}"',
                  cwd=tmp_path, timeout_s=100)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr  # no rank's traceback on the terminal: it is in the rank's log
    assert f"run 1 failed: no space left on device: the filesystem of {checkpoints} is full" in lines[0]
    assert not list(small_fs.path.rglob("*.partial"))
    with Store(tmp_path / "ddlscope.db") as store:
        assert store.get_run(1).status == "failed"


class _LikeCheckpointException(BaseException):
    """torch.distributed.checkpoint's CheckpointException is a BaseException: torch's own wrappers let it by."""


def _raise_like_dcp() -> None:
    raise _LikeCheckpointException("rank 0: [Errno 28] No space left on device")


def _rank_with_stderr_in(log: Path, error_file: Path) -> None:
    from ddlscope.runtime.launcher import _rank_entry

    import sys

    # torch puts the console back as stderr before multiprocessing prints what escaped: here both go to `log`
    sys.stderr = open(log, "w", buffering=1)
    _rank_entry({**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file)}, 1, os.getppid(), os.getcwd(),
                _raise_like_dcp)


@pytest.mark.timeout(60)
def test_a_rank_that_raises_leaves_its_error_file_and_prints_nothing_past_its_log(tmp_path):
    import json
    import multiprocessing

    log, error_file = tmp_path / "stderr.log", tmp_path / "error.json"
    rank = multiprocessing.get_context("fork").Process(target=_rank_with_stderr_in, args=(log, error_file))
    rank.start()
    rank.join(30)
    assert rank.exitcode == 1
    printed = log.read_text()
    assert printed.count("Traceback") == 1 and "Process " not in printed, printed  # not a second time by multiprocessing
    message = json.loads(error_file.read_text())["message"]["message"]
    assert message == "_LikeCheckpointException: rank 0: [Errno 28] No space left on device"


def _report_where(out: str) -> None:
    Path(out).write_text(f"{os.getcwd()}\n{os.environ.get('DDLSCOPE_LAUNCH_MARK')}")


def _rank_forked_elsewhere(launch_folder: str, out: str) -> None:
    from ddlscope.runtime.launcher import _rank_entry

    # a fork server's rank starts in the folder and environment the server had; the launch's are handed over
    _rank_entry({**os.environ, "DDLSCOPE_LAUNCH_MARK": "this launch"}, 1, os.getppid(), launch_folder,
                _report_where, out)


@pytest.mark.timeout(60)
def test_a_rank_runs_in_the_folder_and_environment_of_its_launch_not_of_its_fork_server(tmp_path):
    import multiprocessing

    launch_folder, out = tmp_path / "launched-from", tmp_path / "where.txt"
    launch_folder.mkdir()
    rank = multiprocessing.get_context("fork").Process(target=_rank_forked_elsewhere, args=(str(launch_folder), str(out)))
    rank.start()
    rank.join(30)
    assert rank.exitcode == 0
    assert out.read_text().splitlines() == [str(launch_folder), "this launch"]


def test_partial_checkpoints_are_removed():
    from ddlscope.runtime.launcher import remove_partial_checkpoints

    root = Path(__import__("tempfile").mkdtemp())
    (root / "step-4.partial" / "rank-0").mkdir(parents=True)
    (root / "step-2").mkdir()
    remove_partial_checkpoints(root)
    assert sorted(p.name for p in root.iterdir()) == ["step-2"]


def test_torchs_per_module_loggers_are_quieted():
    from ddlscope.runtime.launcher import quiet_torch_logging

    errors = logging.getLogger("torch.distributed.elastic.multiprocessing.errors")
    errors.setLevel(logging.WARNING)  # what torch's get_logger gives it at import
    quiet_torch_logging()
    assert not errors.isEnabledFor(logging.ERROR)  # "Failed to parse reply file ... Traceback" stays out


@pytest.mark.parametrize("fmt", ["csv", "json", "parquet"])
def test_an_export_to_a_full_disk_leaves_the_old_file_whole_and_no_partial_one(tmp_path, small_fs, capsys, fmt):
    db = tmp_path / "s.db"
    run_id = _store_with_run(db)
    target = small_fs.path / f"out.{fmt}"
    target.write_text("the previous export\n")
    small_fs.fill()
    assert main(["export", str(run_id), "-f", fmt, "-o", str(target), "--db", str(db)]) == 2
    line = _one_error_line(capsys)
    assert f"--output {target}: cannot write it (No space left on device)" in line
    assert target.read_text() == "the previous export\n"
    assert sorted(p.name for p in small_fs.path.iterdir()) == ["filler", f"out.{fmt}"]


def test_an_export_to_a_read_only_filesystem_is_one_line(tmp_path, small_fs, capsys):
    db = tmp_path / "s.db"
    run_id = _store_with_run(db)
    small_fs.read_only()
    assert main(["export", str(run_id), "-o", str(small_fs.path / "x.csv"), "--db", str(db)]) == 2
    assert "Read-only file system" in _one_error_line(capsys)


def test_a_report_to_a_full_or_read_only_filesystem_is_an_output_error(small_fs):
    from ddlscope.report.html import write_report

    small_fs.fill()
    with pytest.raises(OutputError, match="No space left on device"):
        write_report("<html>" + "x" * 100_000, small_fs.path / "r.html")
    small_fs.read_only()
    with pytest.raises(OutputError, match="Read-only file system"):
        write_report("<html></html>", small_fs.path / "r.html")
    assert sorted(p.name for p in small_fs.path.iterdir()) == ["filler"]


# ---------------------------------------------------------------------------- the atomic writer
def test_atomic_output_keeps_the_old_file_when_the_writer_fails_and_follows_a_symlink(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old")
    target.chmod(0o640)
    with pytest.raises(ValueError):
        with atomic_output(target) as f:
            f.write("half of the new")
            raise ValueError("the writer failed")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["out.json"]
    link = tmp_path / "link.json"
    link.symlink_to(target)
    with atomic_output(link) as f:
        f.write("new")
    assert link.is_symlink() and target.read_text() == "new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640


def test_atomic_output_refuses_a_device_or_a_fifo(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(OutputError, match="is a named pipe"):
        with atomic_output(fifo, what="--output") as f:
            f.write("x")
    assert stat.S_ISFIFO(fifo.stat().st_mode)


def test_report_onto_a_character_device_leaves_the_device(tmp_path, capsys):
    device = tmp_path / "null"
    try:
        os.mknod(device, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # what /dev/null is
    except PermissionError:
        pytest.skip("making a device node needs root")
    db = tmp_path / "s.db"
    Store(db).close()  # no run 1: the refusal must come before the runs are looked up
    assert main(["report", "1", "-o", str(device), "--db", str(db)]) == 2
    assert "is a character device, not a regular file" in _one_error_line(capsys)
    assert stat.S_ISCHR(device.stat().st_mode)


# ---------------------------------------------------------------------------- --db that is not a store
def _foreign(path: Path) -> str:
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE runs (who TEXT, miles REAL)")
        conn.execute("INSERT INTO runs VALUES ('me', 5.0)")
    conn.close()
    return _digest(path)


@pytest.mark.parametrize("command", [["runs"], ["show", "1"], ["run", "--steps", "1", "-q"]])
def test_a_foreign_sqlite_database_is_refused_and_left_as_it_was(tmp_path, capsys, command):
    db = tmp_path / "foreign.db"
    before = _foreign(db)
    assert main([*command, "--db", str(db)]) == 2
    assert f"{db} is an SQLite database but not a ddlscope store (its tables: runs)" in _one_error_line(capsys)
    assert _digest(db) == before and sorted(p.name for p in tmp_path.iterdir()) == ["foreign.db"]


@pytest.mark.timeout(30)
def test_a_fifo_or_a_device_as_the_store_is_refused_without_blocking(tmp_path, capsys):
    fifo = tmp_path / "fifo.db"
    os.mkfifo(fifo)
    assert main(["runs", "--db", str(fifo)]) == 2
    assert "is a named pipe (FIFO), not a regular file" in _one_error_line(capsys)
    assert main(["runs", "--db", "/dev/null"]) == 2
    assert "store /dev/null is a character device, not a regular file" in _one_error_line(capsys)


# ---------------------------------------------------------------------------- a killed sweep's runs
def test_a_study_recovers_the_runs_a_killed_earlier_invocation_left(tmp_path):
    from ddlscope.studies.base import run_cells

    db = tmp_path / "s.db"
    with Store(db) as store:
        run_id = _new_run(store)
        store.mark_running(run_id)
        store.conn.execute("UPDATE runs SET launcher_pid=? WHERE id=?", (DEAD_PID, run_id))
    _write_rank_files(run_dir_for(db, "a" * 32), 2, 3)
    assert run_cells("sweep", [], db, fresh=False) == []
    with Store(db) as store:
        assert store.get_run(run_id).status == "failed" and store.count_steps(run_id) == 6
