"""A rank that dies: rows written before the crash are kept, the run is never shown as finished."""

import json
import sqlite3

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.cli_in_this_process]


def test_crashed_rank_fails_the_run_and_keeps_its_rows(cli, tmp_path):
    result = cli("run", "--strategy", "ddp", "--world-size", "2", "--steps", "20", "--quiet",
                 "--set", "cluster.faults=[{rank = 1, step = 5}]", timeout_s=240)
    assert result.returncode == 1
    assert "failed" in result.stderr and "rank 1" in result.stderr
    with sqlite3.connect(tmp_path / "ddlscope.db") as conn:
        status, error = conn.execute("SELECT status, error FROM runs").fetchone()
        rank1_steps = [s for (s,) in conn.execute("SELECT step FROM steps WHERE rank=1 ORDER BY step")]
        events = [k for (k,) in conn.execute("SELECT kind FROM events WHERE rank=1")]
    assert status == "failed" and error
    assert rank1_steps == [0, 1, 2, 3, 4]
    assert "fault" in events
    listed = cli("runs", timeout_s=60)
    assert "failed" in listed.stdout and "finished" not in listed.stdout
    shown = json.loads(cli("show", "1", "--json", timeout_s=60).stdout)
    assert shown["run"]["status"] == "failed"


def test_run_left_running_by_a_dead_launcher_shows_as_died(tmp_path):
    from ddlscope.store import Store

    with Store(tmp_path / "x.db") as store:
        run_id = store.create_run(uuid="u" * 32, name="", workload="mlp-digits", strategy="ddp", world_size=2,
                                  config={}, code_version="test", seed=0, environment={})
        store.mark_running(run_id)
        store.conn.execute("UPDATE runs SET launcher_pid=? WHERE id=?", (2**22 + 12345, run_id))
        assert store.get_run(run_id).shown_status == "died"


def test_ranks_that_finished_but_hang_at_exit_are_killed(tmp_path):
    """torch/gloo's teardown rarely hangs after a rank has finished: the launcher must not wait forever."""
    import subprocess
    import sys

    from ddlscope.runtime.launcher import ExitReaper
    from ddlscope.runtime.rows import leave_done_marker

    hung = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        leave_done_marker(tmp_path, 0, hung[0].pid)
        waiting = ExitReaper(tmp_path, ranks=2, grace_s=0.2, poll_s=0.05)
        waiting.start()
        waiting.join(timeout=1.0)
        assert waiting.is_alive() and not waiting.killed  # one rank is not done: nobody is killed
        assert hung[0].poll() is None
        leave_done_marker(tmp_path, 1, hung[1].pid)
        waiting.join(timeout=10)
        assert not waiting.is_alive() and sorted(waiting.killed) == sorted(p.pid for p in hung)
        assert [p.wait(timeout=10) for p in hung] == [-9, -9]
    finally:
        for p in hung:
            p.kill()
