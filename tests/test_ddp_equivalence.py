"""2-rank DDP with per-rank batch b == single with batch 2b on the same samples."""

import pytest
import torch

pytestmark = pytest.mark.multiprocess

STEPS = 6


def _train(cli, tmp_path, strategy: str, world: int, out: str, extra=()):
    result = cli("run", "--workload", "mlp-digits", "--strategy", strategy, "--world-size", str(world),
                 "--steps", str(STEPS), "--batch-size", "32", "--seed", "3", "--set", "workload.lr=0.2",
                 "--set", f"save_model_path=\"{tmp_path / out}\"", "--quiet", *extra, timeout_s=180)
    assert result.returncode == 0, result.stderr
    return torch.load(tmp_path / out)


def test_ddp_matches_single_with_double_batch(cli, tmp_path):
    single = _train(cli, tmp_path, "single", 1, "single.pt")
    ddp = _train(cli, tmp_path, "ddp", 2, "ddp.pt")
    assert single.keys() == ddp.keys()
    for name in single:
        torch.testing.assert_close(ddp[name], single[name], atol=1e-5, rtol=0)
    # Training really moved the parameters, so the comparison is not trivially true:
    # a run with a tiny learning rate stays near the initial weights, far from both.
    barely_trained = _train(cli, tmp_path, "single", 1, "barely.pt", extra=("--set", "workload.lr=0.0001"))
    assert max((barely_trained[n] - single[n]).abs().max().item() for n in single) > 1e-3


def test_speedup_appears_once_a_single_baseline_exists(cli, tmp_path):
    import json

    for strategy, world in (("single", 1), ("ddp", 2)):
        assert cli("run", "--strategy", strategy, "--world-size", str(world), "--steps", "5", "--quiet",
                   timeout_s=180).returncode == 0
    summary = json.loads(cli("show", "2", "--json", timeout_s=60).stdout)
    assert summary["baseline_run_id"] == 1
    assert summary["speedup_vs_single"] > 0
    assert summary["scaling_efficiency"] == pytest.approx(summary["speedup_vs_single"] / 2)
