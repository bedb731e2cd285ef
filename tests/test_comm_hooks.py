"""DDP comm hooks: torch's fp16 and PowerSGD hooks run and send fewer bytes than plain all-reduce."""

import json

import pytest

pytestmark = pytest.mark.multiprocess


def _bytes_per_step(cli, hook: str, run_no: int) -> float:
    result = cli("run", "--strategy", "ddp", "--world-size", "2", "--steps", "6", "--quiet",
                 "--set", "workload.hidden=256", "--set", f"strategy.comm_hook=\"{hook}\"", "--json",
                 timeout_s=180)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["run"]["id"] == run_no and summary["run"]["status"] == "finished"
    return summary["comm"]["bytes_sent_per_step"]


def test_compression_hooks_send_fewer_bytes(cli):
    plain = _bytes_per_step(cli, "none", 1)
    fp16 = _bytes_per_step(cli, "fp16", 2)
    powersgd = _bytes_per_step(cli, "powersgd(2)", 3)
    assert fp16 == pytest.approx(plain / 2, rel=0.01)
    # PowerSGD starts compressing at iteration 2; steps 1..5 average in the uncompressed step 1
    assert powersgd < 0.5 * plain
