"""The time breakdown: overlap shows on a model large enough to overlap, and a slow
network exposes more communication than the local one."""

import json

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.cli_in_this_process]


GPT = ["--workload", "gpt-char", "--strategy", "ddp", "--world-size", "2", "--steps", "8", "--batch-size", "8",
       "--set", "workload.layers=2", "--set", "workload.hidden=128", "--set", "workload.seq_len=32",
       "--set", "strategy.bucket_mb=0.25", "--quiet", "--json"]


def _summary(cli, *extra):
    result = cli("run", *GPT, *extra, timeout_s=180)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.timeout(240)
def test_overlap_and_exposed_communication_direction(cli, db_rows):
    local = _summary(cli)
    slow = _summary(cli, "--set", "cluster.network.profile=slow", "--set", "cluster.network.scaled=true")
    # several buckets: the first ones' all-reduce runs while backward still computes
    assert local["comm"]["overlap_fraction"] > 0
    assert slow["breakdown_mean_s"]["comm_wait_s"] > local["breakdown_mean_s"]["comm_wait_s"]
    # The direction alone passes on noise (tens of microseconds either way). On the slow link this
    # step is communication-bound: the last bucket's all-reduce leaves backward waiting for most of
    # the step (measured ~95% per rank). A wait booked as backward compute leaves comm_wait_s near 0.
    slow_run = "(SELECT MAX(id) FROM runs)"
    per_rank = db_rows(f"SELECT rank, SUM(comm_wait_s), SUM(step_s) FROM steps WHERE run_id={slow_run} GROUP BY rank")
    assert len(per_rank) == 2
    for rank, wait_s, step_s in per_rank:
        assert wait_s > 0.5 * step_s, f"rank {rank}: exposed wait {wait_s:.3f} s of {step_s:.3f} s of steps"
    for summary in (local, slow):
        parts = sum(summary["breakdown_mean_s"].values())
        assert parts == pytest.approx(sum(summary["breakdown_fraction"].values()) * parts)
        assert sum(summary["straggler_steps"].values()) == summary["steps_recorded"] - 1
