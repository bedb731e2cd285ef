"""`ddlscope.attach` in a loop ddlscope did not write, and `ddlscope launch` for the user's script.

The job is examples/torchrun_ddp.py, a plain DDP (or FSDP2) loop with three ddlscope lines, run under
`ddlscope launch --nproc 2` and under torch's own `torchrun`. What is checked: every step row's parts
add up to its step, the bytes are the model's gradients, model FLOPs are the layers' exact GEMM
count, `show` and `report` read the run; a job killed or stopped is recovered or named.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import SRC, run_cli
from phase_checks import assert_step_phases, assert_store_phases
from test_reliability import finish, kill_all, no_process_left, records, start, wait_until

ROOT = SRC.parent
EXAMPLE = ROOT / "examples" / "torchrun_ddp.py"
WIDTH, BATCH = 64, 16
PARAMS = 32 * WIDTH + WIDTH + WIDTH * WIDTH + WIDTH + WIDTH * 4 + 4  # the example's three Linear layers


def step_rows(db: Path) -> list[dict]:
    with sqlite3.connect(db) as conn:
        conn.row_factory = sqlite3.Row
        return [dict(r) for r in conn.execute("SELECT * FROM steps ORDER BY rank, step")]


def torchrun(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """torch's own launcher, as a user types it. Its stores listen on every interface, so it runs in a
    network namespace of its own that has only a loopback (unshare: root, as CI is)."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", "29500", str(EXAMPLE), *args]
    isolated = ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *command]
    return subprocess.run(isolated, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)


# ---------------------------------------------------------------------------- the rows
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("how,wrapper", [("launch", "ddp"), ("torchrun", "ddp"), ("launch", "fsdp")])
def test_an_attached_loop_stores_steps_whose_parts_add_up(how: str, wrapper: str, tmp_path: Path) -> None:
    steps = 6
    args = ["--steps", str(steps), "--width", str(WIDTH), "--batch", str(BATCH), *(["--fsdp"] if wrapper == "fsdp" else [])]
    traced = how == "launch" and wrapper == "ddp"
    if how == "launch":
        done = run_cli("launch", "--nproc", "2", "--json", *(["--trace"] if traced else []), str(EXAMPLE), "--", *args,
                       cwd=tmp_path, timeout_s=240)
        assert done.returncode == 0, done.stderr[-2000:]
        summary = json.loads(done.stdout)
    else:
        done = torchrun(tmp_path, *args)
        assert done.returncode == 0, "\n".join(line for line in done.stderr.splitlines() if "socket.cpp" not in line)
        shown = run_cli("show", "1", "--json", cwd=tmp_path)
        assert shown.returncode == 0, shown.stderr
        summary = json.loads(shown.stdout)
    run = summary["run"]
    assert run["status"] == "finished" and run["strategy"] == wrapper and run["world_size"] == 2
    assert run["workload"] == "attached:Sequential"

    rows = step_rows(tmp_path / "ddlscope.db")
    assert [(r["rank"], r["step"]) for r in rows] == [(rank, s) for rank in (0, 1) for s in range(steps)]
    assert assert_store_phases(tmp_path / "ddlscope.db") == {wrapper}
    for r in rows:
        assert r["forward_s"] > 0 and r["backward_s"] > 0, r
        assert r["samples"] == BATCH and r["loss"] > 0
    gradient_bytes = 4 * PARAMS
    if wrapper == "ddp":  # DDP all-reduces every gradient once per step
        assert {r["bytes_sent"] for r in rows} == {gradient_bytes}
    else:  # FSDP2: every unit's full gradients reduce-scattered, plus the shards all-gathered (one or two times)
        assert all(gradient_bytes + gradient_bytes / 2 <= r["bytes_sent"] <= gradient_bytes * 2 + 64 for r in rows), \
            [r["bytes_sent"] for r in rows]

    # Model FLOPs, counted over the first step: 3 GEMMs forward, and backward's 2 per layer but the first
    # layer's input gradient (the data needs none): FlopCounterMode's 2 x M x N x K each.
    forward = 2 * BATCH * (32 * WIDTH + WIDTH * WIDTH + WIDTH * 4)
    assert summary["model_flops_per_step"] == 3 * forward - 2 * BATCH * 32 * WIDTH
    assert 0 < summary["mfu"] < 1
    memory = summary["memory_bytes_by_rank"]["0"]
    assert memory["parameters"] == (gradient_bytes if wrapper == "ddp" else pytest.approx(gradient_bytes / 2, rel=0.05))
    assert memory["optimizer"] == memory["parameters"]  # SGD with momentum: one buffer per parameter
    assert memory["activations"] > 0

    if traced:  # steps 1-3 profiled on each rank, the attached phases labelled as a run's are
        merged = run_cli("trace", "1", "-o", "t.json", cwd=tmp_path)
        assert merged.returncode == 0, merged.stderr
        events = json.loads((tmp_path / "t.json").read_text())
        events = events["traceEvents"] if isinstance(events, dict) else events
        labels = {e.get("name") for e in events if str(e.get("name", "")).startswith("ddlscope.")}
        assert {"ddlscope.forward", "ddlscope.backward", "ddlscope.optimizer", "ddlscope.data"} <= labels
        assert len({e.get("pid") for e in events if e.get("name") == "ddlscope.forward"}) == 2  # a track per rank

    report = run_cli("report", "1", "-o", "r.html", cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    assert "attached:Sequential" in (tmp_path / "r.html").read_text()


# ---------------------------------------------------------------------------- one process, in this one
def test_the_phases_follow_the_hooks_in_one_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ddlscope
    from ddlscope.runtime import attach as attach_module

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv(attach_module.RUN_DIR_ENV, raising=False)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.Adam(model.parameters())
    meter = ddlscope.attach(model, optimizer, run="inline", db=tmp_path / "x.db")
    settles = []  # close lets the backend's threads drop their callbacks (test_comm_settle.py says why)
    monkeypatch.setattr(meter.comm, "settle", lambda: settles.append(True))
    with pytest.raises(ddlscope.AttachError, match="called twice"):
        ddlscope.attach(model, optimizer)
    # distinct magnitudes, so that time put in the wrong phase shows whatever the machine's noise
    sleeps = {"data": 0.05, "forward": 0.1, "backward": 0.02, "optimizer": 0.2}
    for _ in range(3):
        time.sleep(sleeps["data"])  # the loader's wait, before the step
        with meter.step(samples=4) as step:
            out = model(torch.randn(4, 8))
            loss = out.square().mean()
            time.sleep(sleeps["forward"])  # the loss: in forward, before backward starts
            loss.backward()
            time.sleep(sleeps["backward"])  # after backward, before the optimizer: synchronize
            optimizer.step()
            time.sleep(sleeps["optimizer"])
            optimizer.zero_grad()
            step.loss = loss
    meter.close()
    assert settles == [True]
    rows = step_rows(tmp_path / "x.db")
    assert len(rows) == 3
    for r in rows[1:]:  # the first step began at its `with`: no data phase of its own
        assert sleeps["data"] <= r["data_s"] < sleeps["data"] + 0.04
        assert sleeps["forward"] <= r["forward_s"] < sleeps["forward"] + 0.04
        assert sleeps["backward"] <= r["comm_wait_s"] < sleeps["backward"] + 0.04  # no collective: synchronize
        assert sleeps["optimizer"] <= r["optimizer_s"] < sleeps["optimizer"] + 0.04
    assert_step_phases(rows, "single")
    with sqlite3.connect(tmp_path / "x.db") as conn:
        strategy, status = conn.execute("SELECT strategy, status FROM runs").fetchone()
        memory = dict(conn.execute("SELECT category, bytes FROM memory WHERE run_id=1").fetchall())
    assert (strategy, status) == ("single", "finished")
    params = 4 * (8 * 16 + 16 + 16 * 2 + 2)
    assert memory["parameters"] == memory["gradients"] == params and memory["optimizer"] == 2 * params  # Adam: two moments


def test_attach_refuses_what_it_cannot_measure(monkeypatch: pytest.MonkeyPatch) -> None:
    import ddlscope

    model = nn.Linear(2, 2)
    with pytest.raises(ddlscope.AttachError, match="must be a torch.nn.Module"):
        ddlscope.attach("model", torch.optim.SGD(model.parameters(), lr=0.1))  # type: ignore[arg-type]
    with pytest.raises(ddlscope.AttachError, match="must be a torch.optim.Optimizer"):
        ddlscope.attach(model, object())  # type: ignore[arg-type]
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ddlscope.AttachError, match="init_process_group before attach"):
        ddlscope.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))


# ---------------------------------------------------------------------------- bad scripts
@pytest.mark.parametrize("script,expected", [
    ("missing.py", "missing.py: no such file"),
    ("raises.py", "raises.py failed before its first measured step: rank "),
    ("plain.py", "plain.py ended without measuring a step"),
    ("twice.py", "twice.py failed before its first measured step: rank 0: AttachError: ddlscope.attach was called twice"),
])
def test_launch_refuses_a_bad_script_in_one_line_and_stores_nothing(script: str, expected: str, tmp_path: Path) -> None:
    (tmp_path / "raises.py").write_text("raise ValueError('broken at import')\n")
    (tmp_path / "plain.py").write_text("print('training without ddlscope')\n")
    (tmp_path / "twice.py").write_text("import torch, ddlscope\ntorch.distributed.init_process_group('gloo')\nm = torch.nn.Linear(2, 2)\no = torch.optim.SGD(m.parameters())\n"
                                       "ddlscope.attach(m, o)\nddlscope.attach(m, o)\n")
    done = run_cli("launch", "--nproc", "2", script, cwd=tmp_path, timeout_s=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], done.stderr
    if script == "raises.py":
        assert "ValueError: broken at import" in lines[0]
    assert not (tmp_path / "ddlscope.db").exists() or not sqlite3.connect(tmp_path / "ddlscope.db").execute(
        "SELECT COUNT(*) FROM runs").fetchone()[0]
    assert not any((tmp_path / "ddlscope-runs").glob("*")) if (tmp_path / "ddlscope-runs").exists() else True


# ---------------------------------------------------------------------------- killed, stopped
def _attached_pids(folder: Path) -> list[int]:
    pids = []
    for rank in (0, 1):
        attached = [r for r in records(folder / f"rank-{rank}.jsonl") if r.get("event") == "attached"]
        pids += [json.loads(attached[0]["message"])["pid"]] if attached else []
    return pids


def _launched_folder(tmp_path: Path) -> Path:
    folders = list((tmp_path / "ddlscope-runs").glob("*")) if (tmp_path / "ddlscope-runs").exists() else []
    return folders[0] if len(folders) == 1 else Path("/nonexistent")


def _steps(folder: Path, rank: int) -> int:
    return sum(1 for r in records(folder / f"rank-{rank}.jsonl") if r.get("kind") == "step")


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_killed_launcher_leaves_its_rows_for_the_next_command(tmp_path: Path) -> None:
    proc = start(tmp_path, "launch", "--nproc", "2", "--quiet", str(EXAMPLE), "--", "--steps", "100000")
    wait_until(lambda: _steps(_launched_folder(tmp_path), 1) >= 10, 120, "10 attached steps")
    pids = _attached_pids(_launched_folder(tmp_path))
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    wait_until(lambda: no_process_left(pids), 30, "the ranks to die with their launcher")
    shown = run_cli("show", "1", "--json", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    summary = json.loads(shown.stdout)
    assert summary["run"]["status"] == "failed" and "launcher died" in summary["run"]["error"]
    assert summary["steps_recorded"] >= 10


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_stopped_rank_of_a_launched_script_is_named_by_the_watchdog(tmp_path: Path) -> None:
    proc = start(tmp_path, "launch", "--nproc", "2", "--quiet", "--hang-timeout", "3", str(EXAMPLE), "--",
                 "--steps", "100000")
    wait_until(lambda: _steps(_launched_folder(tmp_path), 1) >= 10, 120, "10 attached steps")
    pids = _attached_pids(_launched_folder(tmp_path))
    os.kill(pids[1], signal.SIGSTOP)
    try:
        code, _, err = finish(proc, 90)
    finally:
        kill_all(pids)
    assert code == 1
    message = err.strip().splitlines()[-1]
    assert "hang" in message and "rank 1 (process stopped: SIGSTOP?)" in message, message
    with sqlite3.connect(tmp_path / "ddlscope.db") as conn:
        status, error = conn.execute("SELECT status, error FROM runs").fetchone()
    assert status == "failed" and "rank 1" in error


def test_launch_keeps_the_rows_when_another_store_was_renamed_over_its_own(tmp_path: Path) -> None:
    """`ddlscope launch` opens the store again by path when the job ends: a store renamed over it meanwhile
    holds another run under that id, which must not receive this run's rows; the folder stays and is named."""
    from ddlscope.runtime.rows import run_dir_for
    from ddlscope.runtime.script import _store
    from ddlscope.store import Store, StoreError

    db = tmp_path / "ddlscope.db"
    with Store(db) as other:  # the store now at the path: its run 1 is somebody else's
        other.create_run(uuid="f" * 32, name="other", workload="w", strategy="s", world_size=1, config={},
                         code_version="x", seed=0, environment={})
    run_dir = run_dir_for(db, "a" * 32)
    run_dir.mkdir(parents=True)
    (run_dir / "rank-0.jsonl").write_text("")
    with pytest.raises(StoreError, match=f"kept in {run_dir}"):
        _store(db, 1, run_dir, 1, "finished", None, None)
    assert run_dir.is_dir()
    with Store(db) as other:
        assert other.get_run(1).status != "finished" and other.count_steps(1) == 0
