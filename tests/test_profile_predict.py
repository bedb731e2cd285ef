"""`ddlscope calibrate --model` (calibrate/layer_profile.py) and `predict --profile` (predict/from_profile.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SRC
from test_predict_local import FACTS, PROFILE, _config

from ddlscope.calibrate.profile import CalibrationProfile, write_profile
from ddlscope.predict.from_profile import (
    PROFILE_KIND, load_model_profile, predict_cluster_from_profile, predict_local_from_profile, step_at)
from ddlscope.predict.local import predict_local

TINY_GPT = ["--set", "workload.layers=1", "--set", "workload.hidden=32", "--set", "workload.heads=2",
            "--set", "workload.seq_len=16"]
CALIBRATION = {**PROFILE, "meta": {**PROFILE["meta"], "host": "here"}}


@pytest.fixture(scope="module")
def gpt_profile(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A tiny GPT profiled once for the module, through the CLI as a user runs it."""
    from conftest import run_cli_here

    folder = tmp_path_factory.mktemp("profile")
    result = run_cli_here("calibrate", "--model", "gpt-synthetic", *TINY_GPT, "--batch", "4", "--repeats", "1",
                          "-o", "p.toml", cwd=folder)
    assert result.returncode == 0, result.stderr
    return folder / "p.toml", load_model_profile(folder / "p.toml")


def test_profile_holds_layers_whole_step_flops_and_device(gpt_profile: tuple[Path, dict]):
    import torch

    _, p = gpt_profile
    layers = p["layers"]
    assert p["split"].startswith("layer sequence") and layers["name"][-1] == "loss"
    assert len(layers["name"]) == 4  # embedding, one block, head, and the loss
    assert all(t > 0 for t in layers["forward_s"] + layers["backward_s"])
    whole_s = p["step"]["forward_s"] + p["step"]["backward_s"]
    assert p["layers_sum_s"] == pytest.approx(sum(layers["forward_s"]) + sum(layers["backward_s"]))
    assert p["overhead_s"] == pytest.approx(whole_s - p["layers_sum_s"])  # the overhead beside the layers' sum
    # the layers' FLOPs add up to FlopCounterMode's count of the whole model's step (the step profiler's)
    assert sum(layers["flops"]) == pytest.approx(p["facts"]["flops"], rel=0.01)
    assert layers["output_bytes"][1] == layers["input_bytes"][2]  # what the block sends, the head receives
    assert p["device"]["name"].startswith("cpu: ") and p["meta"]["torch"] == torch.__version__
    assert p["device"]["matmul_flops"] > 0
    assert p["batch"] == 4 and p["workload"]["name"] == "gpt-synthetic"
    assert p["step_by_batch"]["batch"] == [1, 2, 4]  # what 4 and 2 data-parallel ranks each compute, and 1
    assert p["step_by_batch"]["forward_s"][-1] == p["step"]["forward_s"]


def test_a_model_that_is_no_chain_is_profiled_by_its_children():
    """Hooks capture each child's input in the model's own forward: a residual model's opened ModuleList."""
    import torch
    from torch import nn
    from torch.utils.flop_counter import FlopCounterMode

    from ddlscope.runtime.profiler import model_split, profile_modules

    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(8, 16)
            self.body = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
            self.out = nn.Linear(16, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inp(x)
            for layer in self.body:
                h = h + layer(h).relu()
            return self.out(h)

    model, loss_fn = Residual(), nn.functional.cross_entropy
    x, y = torch.randn(5, 8), torch.randint(0, 3, (5,))
    split, pieces = model_split(model)
    assert split.startswith("children") and [name for name, _ in pieces] == ["inp", "body.0", "body.1", "out"]
    timed = profile_modules(model, loss_fn, x, y, pieces, chain=False, repeats=1, warmup=0)
    counter = FlopCounterMode(display=False)
    with counter:
        loss_fn(model(x), y).backward()
    assert sum(t.flops for t in timed) == counter.get_total_flops()  # the input x needs no gradient: not counted
    assert [t.name for t in timed][-1] == "loss" and timed[0].param_bytes == 4 * (8 * 16 + 16)


def _synthetic(host: str = "here", device_type: str = "cpu", name: str = "cpu: X") -> dict:
    by_batch = {"batch": [2, 4, 8], "forward_s": [1e-3, 1.5e-3, 2.5e-3], "backward_s": [2e-3, 3e-3, 5e-3],
                "data_s": [1e-5, 2e-5, 4e-5], "optimizer_s": [4e-4, 4e-4, 4e-4]}
    return {"kind": PROFILE_KIND, "batch": 8, "split": "layer sequence", "workload": {"name": "mlp-digits",
            "batch_size": 8, "optimizer": "sgd"}, "meta": {"host": host, "device_type": device_type},
            "device": {"name": name, "matmul_flops": 5e10},
            "step": {key: values[-1] for key, values in by_batch.items() if key != "batch"} | {"steps": 3},
            "step_by_batch": by_batch, "layers": {"activation_bytes": [1000, 2000]}, "facts": FACTS}


@pytest.mark.parametrize("strategy,rank_batch,index", [("ddp", 4, 1), ("fsdp", 4, 1), ("pipeline", 8, 2),
                                                       ("localsgd", 4, 1)])
def test_the_profile_replaces_the_compute_and_local_py_does_the_rest(strategy: str, rank_batch: int, index: int):
    """Where the profile's compute is the facts' kernels, predict --profile is predict_local exactly."""
    profile = _synthetic()
    by_batch = profile["step_by_batch"]
    kernels = {key: by_batch[key][index] for key in ("forward_s", "backward_s", "data_s", "optimizer_s")}
    facts = {**FACTS, "flops": FACTS["flops"] * rank_batch / 8, "per_rank_batch": rank_batch,
             "kernels": {**kernels, "steps": 3}}
    direct = predict_local({**_config(strategy), "workload": profile["workload"]}, {}, facts, CALIBRATION)
    from_profile = predict_local_from_profile(profile, {"name": strategy}, 2, CALIBRATION)
    assert from_profile["step_s"] == pytest.approx(direct["step_s"], rel=1e-12)
    assert from_profile["breakdown_s"] == pytest.approx(direct["breakdown_s"], rel=1e-12)
    assert from_profile["profile"]["rank_batch"] == rank_batch and from_profile["profile"]["scale"] == 1.0


def test_another_device_divides_the_times_by_the_rate_ratio():
    """Another host's profile: its times x its matmul rate / this machine's (5e10 / 1e11 here); a catalogue
    GPU: / the GPU's dense peak; the GPU the profile was taken on: as measured."""
    from ddlscope.predict.catalogue import parse_cluster

    here = predict_local_from_profile(_synthetic(), {"name": "ddp"}, 2, CALIBRATION)
    there = predict_local_from_profile(_synthetic(host="elsewhere"), {"name": "ddp"}, 2, CALIBRATION)
    assert there["profile"]["scale"] == pytest.approx(0.5)
    assert there["breakdown_s"]["forward_s"] == pytest.approx(0.5 * here["breakdown_s"]["forward_s"])
    assert step_at(_synthetic(), 3, 0.5)["backward_s"] == pytest.approx(0.5 * 2.5e-3)  # interpolated, then scaled

    cluster = parse_cluster("a100-80gb:1x8")
    peak = cluster.device.peak_flops.get("tf32") or cluster.device.peak("fp32")
    scaled = predict_cluster_from_profile(_synthetic(), {"name": "ddp"}, cluster, global_batch=32)
    assert scaled.compute_s == pytest.approx((1.5e-3 + 3e-3) * 5e10 / peak)
    same = predict_cluster_from_profile(_synthetic(device_type="cuda", name="cuda: NVIDIA A100-SXM4-80GB"),
                                        {"name": "ddp"}, cluster, global_batch=32)
    assert same.compute_s == pytest.approx(1.5e-3 + 3e-3)
    for strategy in ("fsdp", "pipeline", "localsgd"):  # the catalogue's H100 nodes have no host figure: no server
        assert predict_cluster_from_profile(_synthetic(), {"name": strategy}, parse_cluster("h100:1x2")).step_s > 0


def test_predict_profile_on_the_command_line(gpt_profile: tuple[Path, dict], tmp_path: Path):
    from conftest import run_cli_here

    path, profile = gpt_profile
    write_profile(CALIBRATION, tmp_path / "cal.toml")
    result = run_cli_here("predict", "--profile", str(path), "--strategy", "localsgd", "--set", "strategy.period=2",
                          "--world-size", "2", "--calibration", "cal.toml", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    expected = predict_local_from_profile(profile, {"name": "localsgd", "period": 2}, 2,
                                          CalibrationProfile.load(tmp_path / "cal.toml"))
    assert out["step_s"] == pytest.approx(expected["step_s"]) and out["world_size"] == 2
    from ddlscope.calibrate.layer_profile import write_model_profile  # a .json path: the same profile as JSON

    write_model_profile(profile, tmp_path / "p.json")
    assert json.loads((tmp_path / "p.json").read_text()) == load_model_profile(tmp_path / "p.json") == profile


@pytest.mark.parametrize("argv,names", [
    (["calibrate", "--set", "workload.hidden=8"], "--model"),
    (["calibrate", "--model", "gpt-synthetic", "--repeats", "0"], "--repeats"),
    (["predict", "--profile", "p.toml", "--set", "workload.hidden=8"], "strategy.KEY=VALUE"),
    (["predict", "--profile", "p.toml", "--world-size", "0"], "--world-size"),
    (["predict", "--profile", "p.toml", "--global-batch", "1", "--world-size", "2", "--calibration", "cal.toml"],
     "fewer than one sample"),
    (["predict", "--profile", "p.toml", "--model", "gpt"], "--profile"),
    (["predict", "--profile", "broken.json"], "not a readable JSON"),
])
def test_bad_input_is_one_line(argv: list[str], names: str, gpt_profile: tuple[Path, dict], tmp_path: Path):
    from conftest import run_cli_here

    (tmp_path / "p.toml").write_text(gpt_profile[0].read_text())
    (tmp_path / "broken.json").write_text("{")
    write_profile(CALIBRATION, tmp_path / "cal.toml")
    before = sorted(p.name for p in tmp_path.iterdir())
    result = run_cli_here(*argv, cwd=tmp_path)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and names in lines[0], result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_from_profile_stays_torch_free():
    code = "import sys, ddlscope.predict.from_profile; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(SRC)}, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr
