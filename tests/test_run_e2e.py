"""A run as a new user does it: run, then read it back with show/export/runs."""

import csv
import io
import json

import pytest

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def ddp4(tmp_path_factory):
    from conftest import run_cli

    home = tmp_path_factory.mktemp("e2e")
    result = run_cli("run", "--workload", "mlp-digits", "--strategy", "ddp", "--world-size", "4", "--steps", "50",
                     "--name", "e2e", cwd=home, timeout_s=240)
    return home, result


def test_run_prints_summary_and_stores_every_row(ddp4):
    import sqlite3

    home, result = ddp4
    assert result.returncode == 0, result.stderr
    assert "status finished" in result.stdout
    assert "throughput" in result.stdout and "time breakdown" in result.stdout and "memory by category" in result.stdout
    with sqlite3.connect(home / "ddlscope.db") as conn:
        (run_id, status), = conn.execute("SELECT id, status FROM runs").fetchall()
        assert status == "finished"
        assert conn.execute("SELECT COUNT(*) FROM steps WHERE run_id=?", (run_id,)).fetchone()[0] == 4 * 50
        per_rank = conn.execute("SELECT rank, COUNT(DISTINCT step) FROM steps GROUP BY rank").fetchall()
        assert per_rank == [(r, 50) for r in range(4)]
        categories = {c for (c,) in conn.execute("SELECT DISTINCT category FROM memory")}
        assert {"parameters", "gradients", "optimizer", "activations", "peak_rss"} <= categories
        assert conn.execute("SELECT COUNT(*) FROM evals").fetchone()[0] >= 1
    assert not (home / "ddlscope-runs").exists() or not any((home / "ddlscope-runs").iterdir())


def test_step_parts_add_up_to_step_time(ddp4):
    import sqlite3

    from phase_checks import assert_store_phases

    home, _ = ddp4
    assert assert_store_phases(home / "ddlscope.db") == {"ddp"}
    with sqlite3.connect(home / "ddlscope.db") as conn:
        rows = conn.execute("SELECT bytes_sent, samples FROM steps").fetchall()
    for bytes_sent, samples in rows:
        assert samples == 64 // 4
        assert bytes_sent > 0  # DDP all-reduces every step


def test_show_json_and_export(ddp4):
    from conftest import run_cli

    home, _ = ddp4
    shown = run_cli("show", "e2e", "--json", cwd=home, timeout_s=60)
    assert shown.returncode == 0, shown.stderr
    summary = json.loads(shown.stdout)
    assert summary["run"]["status"] == "finished" and summary["steps_recorded"] == 50
    assert summary["ranks_recorded"] == 4 and summary["throughput_samples_per_s"] > 0
    assert summary["final_eval"]["metric_name"] == "accuracy"
    assert set(summary["memory_bytes_by_rank"]) == {"0", "1", "2", "3"}
    # parameters are replicated under DDP: every rank holds the same bytes
    assert len({m["parameters"] for m in summary["memory_bytes_by_rank"].values()}) == 1

    exported = run_cli("export", "1", "--format", "csv", cwd=home, timeout_s=60)
    assert exported.returncode == 0, exported.stderr
    rows = list(csv.DictReader(io.StringIO(exported.stdout)))
    assert len(rows) == 200 and {"rank", "step", "forward_s", "comm_wait_s"} <= set(rows[0])

    exported = run_cli("export", "1", "--format", "json", cwd=home, timeout_s=60)
    data = json.loads(exported.stdout)
    assert len(data["steps"]) == 200 and data["run"]["status"] == "finished" and data["memory"]

    listed = run_cli("runs", cwd=home, timeout_s=60)
    assert listed.returncode == 0 and "e2e" in listed.stdout and "finished" in listed.stdout

    human = run_cli("show", "1", cwd=home, timeout_s=60)
    assert human.returncode == 0 and "time breakdown" in human.stdout

    # an 80-column log holds the tables whole: nothing cut to "…"
    narrow_runs = run_cli("runs", cwd=home, timeout_s=60, columns=80)
    scaled = run_cli("scaling", "1", cwd=home, timeout_s=60, columns=80)
    assert scaled.returncode == 0 and "samples/s" in scaled.stdout and "comm ms" in scaled.stdout
    assert "\u2026" not in scaled.stdout + narrow_runs.stdout


def test_catalogues_list_registered_plugins(cli):
    strategies = cli("strategies", timeout_s=60)
    assert strategies.returncode == 0 and "ddp" in strategies.stdout and "single" in strategies.stdout
    assert "bucket_mb" in strategies.stdout
    # each strategy's traits, as its spec declares them
    assert "server, async, optimizer on servers" in strategies.stdout
    assert "collective, sync, sharded states" in strategies.stdout
    workloads = cli("workloads", timeout_s=60)
    for name in ("mlp-digits", "cnn-digits", "gpt-char", "gpt-synthetic"):
        assert name in workloads.stdout
