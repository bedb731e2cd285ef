"""benchmarks/kernel_rates.py, the GPU session's kernel check, runs here on the CPU (its times mean
nothing against a GPU's catalogue entry: this checks the script and that it prices what the model
prices)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ddlscope.predict import ModelSpec, compute, parse_cluster
from ddlscope.predict.catalogue import load_catalogue
from ddlscope.predict.model import _kernel_times_s

ROOT = Path(__file__).resolve().parents[1]


def test_the_kernel_check_runs_on_the_cpu_and_prices_each_kernel_as_the_model_does(tmp_path):
    out = tmp_path / "kernels.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_rates.py"), "--device", "cpu",
                           "--against", "h100", "--quick", "--repeats", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    kinds = {k["kind"] for k in result["kernels"]}
    assert {"gemm", "element-wise", "copy", "adam", "layer"} <= kinds
    assert all(k["measured_s"] > 0 and k["predicted_s"] > 0 for k in result["kernels"])
    h100 = load_catalogue().devices["h100"]
    first = result["kernels"][0]  # the 1.7B layer's QKV forward GEMM: 512 tokens x 3h x h
    assert first["shape"].endswith("512x6912x2304")
    assert first["predicted_s"] == compute.gemm_s(512, 6912, 2304, h100, h100.peak("bf16"))
    copy = next(k for k in result["kernels"] if k["kind"] == "copy")
    assert copy["predicted_s"] == 8 * 2**20 / (h100.memory_bandwidth_bytes_per_s * h100.efficiency.memory_fraction)
    assert set(result["summary"]) == kinds
    # The whole block is priced as the step model prices a layer's micro-batch (forward + backward).
    layer = next(k for k in result["kernels"] if k["kind"] == "layer")
    assert layer["shape"].startswith("1.7B (h 2304) block, b1 x seq 256")
    model = ModelSpec(hidden=2304, heads=24, layers=1, seq=256, vocab=1, global_batch=1, attention="flash")
    forward, backward = _kernel_times_s(model, parse_cluster("h100:1x1"), 1, 1, np.array(False), 1,
                                        h100.peak("bf16"))[:2]
    assert layer["predicted_s"] == pytest.approx(float(forward + backward), rel=1e-12)
    # ... and split into the model's parts: each priced as the model prices it, each measured by name.
    profile = result["layer_profiles"][0]
    assert profile["shape"] == layer["shape"]
    assert list(profile["predicted_s"]) == ["GEMMs", "attention", "element-wise", "idle"]
    assert sum(profile["predicted_s"].values()) == pytest.approx(layer["predicted_s"], rel=1e-12)
    assert profile["predicted_s"]["idle"] == pytest.approx(36 * h100.efficiency.kernel_overhead_s)
    measured = profile["measured_s"]
    assert min(measured["GEMMs"], measured["attention"], measured["element-wise"]) > 0
    # the block's matmuls are most of its work on a CPU, far more than its layer norms, GeLU and adds
    assert measured["GEMMs"] > measured["element-wise"]
