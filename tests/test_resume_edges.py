"""Resume, checkpoints and the watchdog at their edges, without a real run (issue 40).

- A checkpoint folder cannot vouch for itself: a `.metadata` replaced by a crafted pickle, its size and
  sha256 rewritten in the manifest, is refused before anything is unpickled (the manifest's MAC is made
  with a key in the store).
- One live launcher per run: a second resume of a run is refused, the resuming launcher's pid is the
  one recorded, and recovery never touches a run whose launcher holds its lock.
- Heartbeats belong to one launch and one elastic attempt, and no process the launch did not start is
  ever signalled, whatever pid a file names.
- What the tests elsewhere stepped over: RNG states restored, rank 0's interrupt seen by recovery, the
  watchdog's allowance of the slowest step.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import run_cli
from ddlscope.cli import main
from ddlscope.runtime.checkpoint import (CheckpointError, experiment_digest, latest_checkpoint, partial_dir, rng_state,
                                         run_key, seal, set_rng_state, step_dir, write_atomically)
from ddlscope.runtime.config import experiment_to_dict, load_experiment
from ddlscope.runtime.heartbeat import Heartbeat, Watchdog, heartbeat_file, process_state, read_beat
from ddlscope.runtime.launcher import ExitReaper, _open_run, fresh_launch_dir, kill_ranks
from ddlscope.runtime.recovery import RunLocked, hold_run_lock, recover_orphaned_runs
from ddlscope.runtime.rows import leave_done_marker, run_dir_for
from ddlscope.store import Store

UUID = "c0ffee" * 5 + "00"


@pytest.fixture
def exp():
    return load_experiment(None, {"workload.steps": 10, "checkpoint_every": 5})


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def stored_run(db: Path, exp, status: str = "failed", pid: int | None = None) -> int:
    """A run as a launcher that died (or ended) left it: its row, its folder."""
    with Store(db) as store:
        run_id = store.create_run(uuid=UUID, name="", workload=exp.workload.name, strategy=exp.strategy.name,
                                  world_size=exp.cluster.world_size, config=experiment_to_dict(exp),
                                  code_version="test", seed=exp.seed, environment={})
        store.conn.execute("UPDATE runs SET status=?, launcher_pid=? WHERE id=?", (status, pid or dead_pid(), run_id))
    run_dir_for(db, UUID).mkdir(parents=True)
    return run_id


def one_error_line(stderr: str) -> bool:
    lines = stderr.strip().splitlines()
    return len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in stderr


# ---------------------------------------------------------------------------- a checkpoint folder cannot run code
class _Payload:
    """Unpickling it creates a file: what a crafted `.metadata` could do instead."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def crafted_checkpoint(root: Path, exp, marker: Path, key: bytes) -> Path:
    """A sealed checkpoint whose `.metadata` is then replaced and its manifest entry rewritten to match."""
    folder = partial_dir(root, 5)
    folder.mkdir(parents=True)
    write_atomically(folder / "rank-0.pt", {"step": 5})
    (folder / ".metadata").write_bytes(b"honest")
    sealed = seal(root, 5, exp, key)
    crafted = pickle.dumps(_Payload(marker))
    (sealed / ".metadata").write_bytes(crafted)
    import hashlib

    manifest = json.loads((sealed / "manifest.json").read_text())
    manifest["files"][".metadata"] = {"bytes": len(crafted), "sha256": hashlib.sha256(crafted).hexdigest()}
    (sealed / "manifest.json").write_text(json.dumps(manifest))
    return sealed


@pytest.mark.timeout(120)
def test_a_crafted_pickle_in_a_checkpoint_is_refused_before_it_is_unpickled(tmp_path, exp):
    proof = tmp_path / "proof"
    pickle.loads(pickle.dumps(_Payload(proof)))
    assert proof.exists()  # the payload does run when unpickled
    db, marker = tmp_path / "ddlscope.db", tmp_path / "pwned"
    run_id = stored_run(db, exp)
    with Store(db) as store:
        key = run_key(store.checkpoint_secret(), UUID)
        before = store.get_run(run_id)
    crafted_checkpoint(run_dir_for(db, UUID) / "checkpoints", exp, marker, key)

    result = run_cli("run", "--resume", str(run_id), "--quiet", cwd=tmp_path, timeout_s=100)
    assert result.returncode == 2 and one_error_line(result.stderr), result.stderr
    assert "not signed" in result.stderr
    assert not marker.exists()
    with Store(db) as store:  # nothing in the store changed
        after = store.get_run(run_id)
        assert (after.status, after.launcher_pid) == (before.status, before.launcher_pid)
        assert not [e for e in store.events(run_id) if e["kind"] == "resumed"]


def test_the_launcher_and_each_rank_refuse_the_crafted_checkpoint_too(tmp_path, exp):
    """The CLI's early look is not the only one: a resume through launch() (a study) and a rank's restore
    (an elastic restart) check the MAC before dcp.load."""
    from ddlscope.runtime.checkpoint import Checkpointer

    db, marker = tmp_path / "ddlscope.db", tmp_path / "pwned"
    run_id = stored_run(db, exp)
    root = run_dir_for(db, UUID) / "checkpoints"
    crafted_checkpoint(root, exp, marker, run_key(b"another store's secret", UUID))
    locks: list[int] = []
    with Store(db) as store:
        with pytest.raises(CheckpointError, match="not signed"):
            _open_run(exp, store, db, store.get_run(run_id), locks)
        key = run_key(store.checkpoint_secret(), UUID)
    for fd in locks:
        os.close(fd)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(CheckpointError, match="not signed"):
        Checkpointer(root, exp, 0, torch.device("cpu"), key=key).restore(model, torch.optim.SGD(model.parameters()))
    assert not marker.exists()


def test_a_checkpoint_signed_for_another_run_or_store_is_refused(tmp_path, exp):
    folder = partial_dir(tmp_path, 5)
    folder.mkdir(parents=True)
    write_atomically(folder / "rank-0.pt", {"step": 5})
    seal(tmp_path, 5, exp, run_key(b"s" * 32, "run-a"))
    assert latest_checkpoint(tmp_path, exp, key=run_key(b"s" * 32, "run-a")).step == 5
    for other in (run_key(b"s" * 32, "run-b"), run_key(b"t" * 32, "run-a")):
        with pytest.raises(CheckpointError, match="not signed"):
            latest_checkpoint(tmp_path, exp, key=other)


@pytest.mark.parametrize("manifest", [
    [], {"format": 2, "experiment": "x", "files": {}}, {"format": 2, "step": "abc", "experiment": "x", "files": {}},
    {"format": 2, "step": 5, "experiment": "x", "files": []},
    {"format": 2, "step": 5, "experiment": "x", "files": {"a": 3}}, {"format": 2, "step": 5, "files": {}},
    {"step": 5}, "null",
], ids=["list", "no-step", "step-abc", "files-list", "entry-not-mapping", "no-experiment", "no-format", "null"])
def test_a_hand_edited_manifest_is_refused_in_one_line(tmp_path, exp, manifest):
    folder = step_dir(tmp_path, 5)
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(manifest if isinstance(manifest, str) else json.dumps(manifest))
    for key in (b"k", None):  # None: the parameter servers' look, which reads no pickle
        with pytest.raises(CheckpointError) as error:
            latest_checkpoint(tmp_path, exp, key=key)
        assert "\n" not in str(error.value) and "manifest" in str(error.value)


# ---------------------------------------------------------------------------- one live launcher per run
def test_a_resume_takes_the_run_and_a_second_resume_cannot_start(tmp_path, exp):
    db = tmp_path / "ddlscope.db"
    run_id = stored_run(db, exp)
    locks: list[int] = []
    with Store(db) as store:
        run = store.get_run(run_id)
        try:
            _open_run(exp, store, db, run, locks)  # the first resume's launcher (this process)
            store.mark_running(run_id)
            taken = store.get_run(run_id)
            assert taken.launcher_pid == os.getpid() and taken.shown_status == "running"
            assert recover_orphaned_runs(store, db) == [] and store.get_run(run_id).status == "running"
            with Store(db) as second, pytest.raises(RunLocked):  # a second resume that read the run before
                _open_run(exp, second, db, run, [])
        finally:
            for fd in locks:
                os.close(fd)


def test_recovery_leaves_a_run_alone_while_its_launcher_lock_is_held(tmp_path, exp):
    db = tmp_path / "ddlscope.db"
    run_id = stored_run(db, exp, status="running")  # its stored pid is gone: it looks dead
    fd = hold_run_lock(run_dir_for(db, UUID))
    try:
        with Store(db) as store:
            assert recover_orphaned_runs(store, db) == [] and store.get_run(run_id).status == "running"
    finally:
        os.close(fd)
    with Store(db) as store:
        assert [r.run_id for r in recover_orphaned_runs(store, db)] == [run_id]


@pytest.mark.parametrize("flags", [["--max-restarts", "-1"], ["--nnodes", "2"], ["--node-rank", "1"],
                                   ["--rdzv-endpoint", "h:1"], ["--procs-per-node", "2"]])
def test_resume_refuses_the_cluster_flags_it_would_ignore(tmp_path, capsys, flags):
    assert main(["run", "--resume", "2", *flags, "--db", str(tmp_path / "x.db")]) == 2
    err = capsys.readouterr().err
    assert one_error_line(err) and flags[0] in err


# ---------------------------------------------------------------------------- heartbeats per attempt, no stray signals
def write_beat(folder: Path, rank: int, pid: int, started_ticks: int, slowest_s: float = 0.01,
               attempt: int = 0) -> None:
    beat = Heartbeat(folder, rank, attempt)
    beat.pid, beat.started_ticks, beat.slowest_step_s = pid, started_ticks, slowest_s
    beat.beat(step=3, phase="forward")
    beat.close()


def test_a_resumed_launch_never_reads_the_heartbeats_of_the_launch_before(tmp_path):
    run_dir = tmp_path / "run"
    old = fresh_launch_dir(run_dir)
    for folder in (run_dir, old):  # an older ddlscope's beats, and the previous launch's
        for rank in (0, 1):
            write_beat(folder, rank, os.getpid(), 1)
    new = fresh_launch_dir(run_dir)
    assert not old.exists() and not list(new.iterdir())
    watchdog = Watchdog(new, [0, 1], timeout_s=2, on_hang=lambda m, b: None, startup_s=300)
    assert watchdog.check(time.monotonic() + 3) is None  # start-up allowed, not 2 s past a stale step


@pytest.fixture
def unrelated_sleep():
    """A live process this one did not start (its parent shell is gone): what a reused pid names."""
    out = subprocess.run(["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True,
                         check=True).stdout
    pid = int(out.strip())
    yield pid
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def alive(pid: int) -> bool:
    return process_state(pid) not in ("zombie", "gone")


def start_ticks(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


@pytest.mark.timeout(30)
def test_no_process_the_launch_did_not_start_is_ever_signalled(tmp_path, unrelated_sleep):
    own = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        write_beat(tmp_path, 0, unrelated_sleep, start_ticks(unrelated_sleep))  # a pid reused by someone else
        write_beat(tmp_path, 1, own[0].pid, start_ticks(own[0].pid) - 1)  # a stale beat: another process then
        write_beat(tmp_path, 2, own[1].pid, start_ticks(own[1].pid))  # a rank of this launch
        beats = [read_beat(heartbeat_file(tmp_path, r), r) for r in range(3)]
        assert kill_ranks(beats) == [own[1].pid]
        assert own[1].wait(timeout=10) == -signal.SIGKILL
        assert alive(unrelated_sleep) and own[0].poll() is None

        markers = tmp_path / "markers"  # the exit reaper's done markers name pids too
        markers.mkdir()
        leave_done_marker(markers, 0, unrelated_sleep)
        reaper = ExitReaper(markers, ranks=1, grace_s=0.0, poll_s=0.02)
        reaper.start()
        reaper.join(timeout=10)
        assert reaper.killed == [] and alive(unrelated_sleep)
    finally:
        for proc in own:
            proc.kill()
            proc.wait()


def test_a_new_elastic_attempt_is_watched_afresh(tmp_path):
    me = (os.getpid(), start_ticks(os.getpid()))
    for rank in (0, 1):
        write_beat(tmp_path, rank, *me, slowest_s=0.5)
    watchdog = Watchdog(tmp_path, [0, 1], timeout_s=1, on_hang=lambda m, b: None, startup_s=30)
    t0 = time.monotonic()
    assert watchdog.check(t0) is None
    write_beat(tmp_path, 0, *me, slowest_s=0.0, attempt=1)  # rank 0 restarted; rank 1's beat is the old attempt's
    assert watchdog.check(t0 + 3) is None and watchdog.attempt == 1
    assert watchdog.check(t0 + 20) is None  # still starting up
    assert watchdog.check(t0 + 40) is not None and "rank 1 never started" in watchdog.message


# ---------------------------------------------------------------------------- what earlier tests stepped over
def test_a_checkpoint_restores_every_random_generator():
    state = rng_state()
    expected = (torch.rand(4), random.random(), torch.nn.functional.dropout(torch.ones(8), 0.5))
    torch.manual_seed(1234)
    random.seed(1234)
    set_rng_state(state)
    again = (torch.rand(4), random.random(), torch.nn.functional.dropout(torch.ones(8), 0.5))
    assert torch.equal(expected[0], again[0]) and expected[1] == again[1] and torch.equal(expected[2], again[2])


def test_recovery_sees_rank_0s_interrupt(tmp_path, exp):
    db = tmp_path / "ddlscope.db"
    run_id = stored_run(db, exp, status="running")
    with Store(db) as store:
        store.add_event(run_id, "error", "KeyboardInterrupt: ", rank=0)
        assert [(r.run_id, r.status) for r in recover_orphaned_runs(store, db)] == [(run_id, "interrupted")]


def test_the_watchdog_allows_the_slowest_step_past_its_timeout(tmp_path):
    me = (os.getpid(), start_ticks(os.getpid()))
    for rank in (0, 1):
        write_beat(tmp_path, rank, *me, slowest_s=2.0)
    watchdog = Watchdog(tmp_path, [0, 1], timeout_s=0.5, on_hang=lambda m, b: None, startup_s=300)
    t0 = time.monotonic()
    assert watchdog.check(t0) is None
    assert watchdog.check(t0 + 1.5) is None  # a slow step, not a hang: 0.5 s past a 2 s step is allowed
    assert watchdog.check(t0 + 3) is not None and "rank 0" in watchdog.message
