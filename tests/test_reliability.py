"""Reliability, proven by really killing, stopping and interrupting processes.

- A worker SIGKILLed from outside at a random step, with checkpoints and one allowed restart, ends
  with the same final parameters (bit for bit) and the same rows as an uninterrupted run.
- A stopped (SIGSTOP) rank ends the run within the watchdog's timeout, naming the rank, its step and
  what the others wait on; no process is left behind.
- SIGTERM to the launcher (or Ctrl-C to the whole group) stops every rank within seconds, keeps the
  rows, and `run --resume` finishes the run with an uninterrupted run's rows.

Steps are slowed by an emulated 15 ms link latency (numerics unchanged), so a run lasts long
enough to be hit mid-way. The random step is printed on failure. Each strategy's uninterrupted
reference run is made once per module and shared by the tests that compare against it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import SRC

pytestmark = [pytest.mark.multiprocess, pytest.mark.cli_in_this_process]

SLOW_LINK = ["--set", 'cluster.network.profile="custom"', "--set", "cluster.network.alpha_us=15000",
             "--set", "cluster.network.bandwidth_gbps=100"]
STRATEGIES = {"ddp": ["--strategy", "ddp", "--world-size", "2"],
              "fsdp": ["--strategy", "fsdp", "--world-size", "2"],
              "ps-sync": ["--strategy", "ps-sync", "--world-size", "2"]}
# Killed and restarted: FSDP's sharded checkpoint and the parameter server's. DDP's rank-0 checkpoint is
# restored bit for bit by the interrupted-and-resumed tests below (their reference is ddp's).
KILLED = ["fsdp", "ps-sync"]


def start(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(SRC), "COLUMNS": "200"}
    return subprocess.Popen([sys.executable, "-m", "ddlscope", *args], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def run_dir(tmp_path: Path) -> Path:
    folders = [p for p in (tmp_path / "ddlscope-runs").glob("*") if p.is_dir()] if (tmp_path / "ddlscope-runs").exists() else []
    return folders[0] if len(folders) == 1 else Path("/nonexistent")


def records(path: Path) -> list[dict]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def worker_pid(folder: Path, rank: int) -> int:
    started = [r for r in records(folder / f"rank-{rank}.jsonl") if r.get("event") == "started"]
    return int(started[-1]["message"].split("pid=")[1].split()[0])


def steps_done(folder: Path, rank: int) -> int:
    return sum(1 for r in records(folder / f"rank-{rank}.jsonl") if r.get("kind") == "step")


def sealed_checkpoints(folder: Path) -> list[Path]:
    return sorted(p for p in (folder / "checkpoints").glob("step-*") if not p.name.endswith(".partial"))


def finish(proc: subprocess.Popen[str], timeout_s: float) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"ddlscope did not finish within {timeout_s} s: {err[-2000:]}")
    return proc.returncode, out, err


def step_rows(db: Path, run_id: int) -> dict[tuple[int, int], float]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT rank, step, loss FROM steps WHERE run_id=?", (run_id,)).fetchall()
    return {(rank, step): loss for rank, step, loss in rows}


def summary(tmp_path: Path, run_id: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    shown = subprocess.run([sys.executable, "-m", "ddlscope", "show", str(run_id), "--json"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)


def kill_all(pids: list[int]) -> None:
    """SIGKILL each of `pids` that is still there (a stopped rank takes nothing gentler)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def no_process_left(pids: list[int]) -> bool:
    def alive(pid: int) -> bool:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        return state != "Z"
    return not any(alive(p) for p in pids)


# ---------------------------------------------------------------------------- uninterrupted references
STEPS = 40
# momentum: the optimizer has state a restart or a resume must bring back
EXPERIMENT = ["--steps", str(STEPS), "--seed", "3", "--quiet", "--set", "workload.momentum=0.9"]
COMMON = [*EXPERIMENT, *SLOW_LINK]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The uninterrupted run of each strategy's experiment, made once (in its own folder and store) for
    every test that compares a killed, restarted or resumed run with it: a reference(strategy) call runs
    it the first time and returns its summary and its (rank, step) -> loss rows. It runs on the local
    link: the emulated latency only delays messages, so the parameters and losses must come out the same
    bits (nothing here needs the reference to last)."""
    home = tmp_path_factory.mktemp("uninterrupted")
    done: dict[str, tuple[dict, dict]] = {}

    def reference(strategy: str) -> tuple[dict, dict]:
        if strategy not in done:
            code, _, err = finish(start(home, "run", *STRATEGIES[strategy], *EXPERIMENT, "--db", f"{strategy}.db"), 240)
            assert code == 0, err
            shown = subprocess.run([sys.executable, "-m", "ddlscope", "show", "1", "--json", "--db", f"{strategy}.db"],
                                   cwd=home, env={**os.environ, "PYTHONPATH": str(SRC)}, capture_output=True,
                                   text=True, timeout=120)
            assert shown.returncode == 0, shown.stderr
            done[strategy] = json.loads(shown.stdout), step_rows(home / f"{strategy}.db", 1)
        return done[strategy]

    return reference


# ---------------------------------------------------------------------------- kill and restart
@pytest.mark.timeout(420)
@pytest.mark.parametrize("strategy", KILLED)
def test_worker_killed_at_a_random_step_restarts_to_bit_identical_parameters(strategy, tmp_path, uninterrupted):
    steps = STEPS
    common = [*STRATEGIES[strategy], *COMMON]
    kill_at = random.Random().randrange(12, 30)
    print(f"killing rank 1 of {strategy} once it has done {kill_at} steps")

    proc = start(tmp_path, "run", *common, "--checkpoint-every", "5", "--max-restarts", "1")
    wait_until(lambda: steps_done(run_dir(tmp_path), 1) >= kill_at, 240, f"{kill_at} steps")
    folder = run_dir(tmp_path)
    assert sealed_checkpoints(folder), "a checkpoint was sealed before the kill"
    os.kill(worker_pid(folder, 1), signal.SIGKILL)
    code, _, err = finish(proc, 300)
    assert code == 0, err

    reference, reference_rows = uninterrupted(strategy)  # the same experiment, never interrupted
    restarted = summary(tmp_path, 1)
    assert restarted["run"]["status"] == "finished" and restarted["restarts"] == 1
    assert reference["restarts"] == 0 and reference["run"]["strategy"] == strategy
    assert restarted["final_params_sha256"] and len(restarted["final_params_sha256"]) == 64
    assert restarted["final_params_sha256"] == reference["final_params_sha256"]
    # Rows: exactly once per (rank, step), and each step's loss the uninterrupted run's, bit for bit.
    db = tmp_path / "ddlscope.db"
    assert step_rows(db, 1) == reference_rows
    assert len(step_rows(db, 1)) == 2 * steps
    with sqlite3.connect(db) as conn:
        kinds = [k for (k,) in conn.execute("SELECT kind FROM events WHERE run_id=1 AND rank=0")]
    assert "restart" in kinds and "restored" in kinds


# ---------------------------------------------------------------------------- watchdog
@pytest.mark.timeout(240)
def test_a_stopped_rank_ends_the_run_within_the_watchdog_timeout(tmp_path):
    proc = start(tmp_path, "run", "--strategy", "ddp", "--world-size", "2", "--steps", "100000", "--quiet",
                 "--set", "cluster.hang_timeout_s=3")
    wait_until(lambda: steps_done(run_dir(tmp_path), 1) >= 20, 120, "20 steps")
    folder = run_dir(tmp_path)
    pids = [worker_pid(folder, 0), worker_pid(folder, 1)]
    os.kill(pids[1], signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        code, _, err = finish(proc, 90)
    finally:
        kill_all(pids)
    took_s = time.monotonic() - stopped_at
    assert code == 1
    assert 3 <= took_s < 30, f"the run ended {took_s:.1f} s after the stop (timeout 3 s)"
    message = err.strip().splitlines()[-1]
    assert "hang" in message and "rank 1" in message and "stopped" in message and "step" in message
    assert "rank 0" in message and "all_reduce" in message  # what the healthy rank waits on
    with sqlite3.connect(tmp_path / "ddlscope.db") as conn:
        status, error = conn.execute("SELECT status, error FROM runs").fetchone()
        hang_events = conn.execute("SELECT COUNT(*) FROM events WHERE kind='hang'").fetchone()[0]
    assert status == "failed" and "rank 1" in error and hang_events == 1
    wait_until(lambda: no_process_left(pids), 10, "every rank to be gone")


# ---------------------------------------------------------------------------- signals and --resume
@pytest.mark.timeout(420)
@pytest.mark.parametrize("how", ["SIGTERM to the launcher", "Ctrl-C to the process group"])
def test_interrupted_run_stops_fast_keeps_its_rows_and_resumes_to_the_uninterrupted_result(how, tmp_path,
                                                                                          uninterrupted):
    steps = STEPS
    common = [*STRATEGIES["ddp"], *COMMON]
    proc = start(tmp_path, "run", *common, "--checkpoint-every", "10")
    # both ranks' 15 steps on disk: rank 1 writes its row a moment after rank 0 (29 rows were seen once)
    wait_until(lambda: len(sealed_checkpoints(run_dir(tmp_path))) >= 1
               and min(steps_done(run_dir(tmp_path), rank) for rank in (0, 1)) >= 15, 240, "a checkpoint and 15 steps")
    folder = run_dir(tmp_path)
    pids = [worker_pid(folder, 0), worker_pid(folder, 1)]
    if how.startswith("SIGTERM"):
        os.kill(proc.pid, signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGINT)
    signalled = time.monotonic()
    code, _, err = finish(proc, 60)
    took_s = time.monotonic() - signalled
    assert code == 130, err
    assert took_s < 10, f"took {took_s:.1f} s to stop"
    assert "interrupted" in err
    wait_until(lambda: no_process_left(pids), 10, "every rank to be gone")
    db = tmp_path / "ddlscope.db"
    on_disk = {(r["rank"], r["step"]) for rank in (0, 1) for r in records(folder / f"rank-{rank}.jsonl")
               if r.get("kind") == "step"}
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT status FROM runs WHERE id=1").fetchone()[0] == "interrupted"
    assert set(step_rows(db, 1)) == on_disk and len(on_disk) >= 30  # everything measured is kept

    resumed = start(tmp_path, "run", "--resume", "1", "--quiet")
    code, _, err = finish(resumed, 240)
    assert code == 0, err
    reference, reference_rows = uninterrupted("ddp")  # the same experiment, never interrupted
    assert step_rows(db, 1) == reference_rows and len(step_rows(db, 1)) == 2 * steps
    first = summary(tmp_path, 1)
    assert first["run"]["status"] == "finished" and first["restarts"] == 1
    assert first["final_params_sha256"] and first["final_params_sha256"] == reference["final_params_sha256"]


def test_resume_refuses_a_finished_run_and_other_input(tmp_path, cli):
    from ddlscope.store import Store

    with Store(tmp_path / "ddlscope.db") as store:
        run_id = store.create_run(uuid="a" * 32, name="done", workload="mlp-digits", strategy="ddp", world_size=2,
                                  config={}, code_version="test", seed=0, environment={})
        store.mark_done(run_id, "finished")
    result = cli("run", "--resume", "1", timeout_s=60)
    assert result.returncode == 2 and "finished" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    result = cli("run", "--resume", "1", "--steps", "3", timeout_s=60)
    assert result.returncode == 2 and "--steps" in result.stderr


# ---------------------------------------------------------------------------- preemptible workers
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["ps-async", "ssp"])
def test_preempted_worker_leaves_the_survivors_training_and_returns_with_the_newest_model(strategy, cli, tmp_path):
    steps, down_s = 30, 2.0
    result = cli("run", "--strategy", strategy, "--world-size", "3", "--batch-size", "60", "--steps", str(steps),
                 "--quiet", "--set", f"cluster.preemptions=[{{rank = 1, step = 5, down_s = {down_s}}}]",
                 *SLOW_LINK[:2], "--set", "cluster.network.alpha_us=5000", *SLOW_LINK[4:], timeout_s=240)
    assert result.returncode == 0, result.stderr
    with sqlite3.connect(tmp_path / "ddlscope.db") as conn:
        steps_by_rank = dict(conn.execute("SELECT rank, COUNT(DISTINCT step) FROM steps GROUP BY rank").fetchall())
        updates = conn.execute("SELECT worker, worker_step FROM updates").fetchall()
        events = {(rank, kind): message for rank, kind, message in
                  conn.execute("SELECT rank, kind, message FROM events")}
        t = {(rank, kind): t for rank, kind, t in conn.execute("SELECT rank, kind, t FROM events")}
        rank0_steps = conn.execute("SELECT t_s FROM steps WHERE rank=0").fetchall()
        losses = [loss for (loss,) in conn.execute("SELECT loss FROM steps WHERE rank=1 AND step>=5")]
    assert steps_by_rank == {0: steps, 1: steps, 2: steps}
    # The server's counters: every push of every worker applied exactly once, none lost.
    for worker in range(3):
        pushed = sorted(s for w, s in updates if w == worker)
        assert pushed == list(range(steps)), f"worker {worker}'s updates: {pushed}"
    server = 3
    assert f"updates={3 * steps}" in events[server, "server_end"]
    # It really left and came back: away about down_s, and pulled the version the server had then.
    away_s = t[1, "rejoined"] - t[1, "preempted"]
    assert down_s <= away_s < down_s + 5
    joined_version = events[server, "worker_joined"].split("version=")[1]
    assert events[1, "rejoined"].endswith(f"model version {joined_version}")
    assert int(joined_version) > int(events[server, "worker_left"].split("version=")[1])  # survivors trained on
    # The survivors kept stepping while it was away.
    start0 = t[0, "train_start"]
    during = [s for (s,) in rank0_steps if t[1, "preempted"] < start0 + s < t[1, "rejoined"]]
    assert len(during) >= 3
    # Its model was discarded (NaN) on leaving: finite losses afterwards prove it pulled a whole one.
    assert all(loss == loss for loss in losses) and len(losses) == steps - 5

    report = cli("report", "1", "-o", "r.html", timeout_s=120)
    assert report.returncode == 0 and "Timeline: preemptions" in (tmp_path / "r.html").read_text()


def test_preemption_is_refused_where_a_worker_cannot_go_missing(cli, tmp_path):
    for strategy in ("ddp", "ps-sync"):
        result = cli("run", "--strategy", strategy, "--world-size", "2", "--steps", "10",
                     "--set", "cluster.preemptions=[{rank = 1, step = 5}]", timeout_s=60)
        assert result.returncode == 2 and "preemption" in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "ddlscope.db").exists()
