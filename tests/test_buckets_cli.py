"""One DDP run with MG-WFBP buckets and top-k compression on the emulated slow network: the plan DDP applied
is the one `ddlscope buckets RUN` prints, it predicts no more exposed communication than the baselines, and
the run sent top-k's share of the bytes."""

import json

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.cli_in_this_process]


@pytest.mark.timeout(240)
def test_mgwfbp_run_and_buckets_command(cli):
    result = cli("run", "-w", "cnn-digits", "-s", "ddp", "-n", "2", "--steps", "6", "--batch-size", "64", "--quiet",
                 "--json", "--set", 'strategy.buckets="mgwfbp"', "--set", 'strategy.comm_hook="topk"',
                 "--set", "strategy.topk_ratio=0.1", "--set", 'cluster.network.profile="slow"',
                 "--set", "cluster.network.scaled=true", timeout_s=200)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    shown = cli("buckets", str(summary["run"]["id"]), "--json")
    assert shown.returncode == 0, shown.stderr
    report = json.loads(shown.stdout)
    optimal, per_layer, size = report["plans"]
    assert report["used"]["buckets"] == optimal["buckets"]  # the run applied the plan the command reprices
    assert report["used"]["predicted_exposed_s"] == pytest.approx(optimal["predicted_exposed_s"])
    assert optimal["predicted_exposed_s"] <= min(per_layer["predicted_exposed_s"], size["predicted_exposed_s"])
    assert len(size["buckets"]) == 1 and len(per_layer["buckets"]) == len(report["layers"]) == 4  # conv, conv, fc, fc
    param_bytes = sum(layer["grad_bytes"] for layer in report["layers"])
    assert sum(optimal["bucket_bytes"]) == param_bytes
    # top-k at 10%: values + indices are 20% of the fp32 gradient, one ceil per bucket over (+ step 0's one bucket)
    assert summary["comm"]["bytes_sent_per_step"] / param_bytes == pytest.approx(0.2, rel=0.05)
    assert report["measured_exposed_s"] is not None and report["measured_exposed_s"] >= 0
    assert report["alpha_s"] > 0 and report["beta_s_per_byte"] > 0
    missing = cli("buckets", "99")
    assert missing.returncode == 2 and missing.stderr.strip().count("\n") == 0 and "99" in missing.stderr

