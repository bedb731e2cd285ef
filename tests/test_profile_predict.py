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
    assert p["device"]["dtype"] == "fp32" and p["device"]["tf32"] is torch.backends.cuda.matmul.allow_tf32
    assert p["untimed"] == []  # every piece of the split was timed
    assert p["batch"] == 4 and p["workload"]["name"] == "gpt-synthetic"
    assert p["step_by_batch"]["batch"] == [1, 2, 4]  # what 4 and 2 data-parallel ranks each compute, and 1
    assert p["step_by_batch"]["forward_s"][-1] == p["step"]["forward_s"]


def _residual(blocks: int) -> "torch.nn.Module":
    """A model that is no chain: a Linear in, `blocks` residual Linear layers in a ModuleList (which has no
    forward of its own), a Linear out."""
    import torch
    from torch import nn

    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(8, 16)
            self.body = nn.ModuleList(nn.Linear(16, 16) for _ in range(blocks))
            self.out = nn.Linear(16, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inp(x)
            for layer in self.body:
                h = h + layer(h).relu()
            return self.out(h)

    return Residual()


def test_a_model_that_is_no_chain_is_profiled_by_its_children():
    """Hooks capture each child's input in the model's own forward: a residual model's opened ModuleList."""
    import torch
    from torch import nn
    from torch.utils.flop_counter import FlopCounterMode

    from ddlscope.runtime.profiler import model_split, profile_modules

    model, loss_fn = _residual(blocks=2), nn.functional.cross_entropy
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


def test_another_device_is_scaled_like_with_like():
    """Another host's CPU: its times x its 1024^2 matmul rate / this machine's at that size (else its peak);
    a catalogue GPU to another: their catalogue peaks at the profile's precision; the GPU the profile was
    taken on: as measured. A CPU profile on a GPU cluster, or a GPU one on this CPU, is refused."""
    from ddlscope.predict.catalogue import parse_cluster
    from ddlscope.specs import ConfigError

    here = predict_local_from_profile(_synthetic(), {"name": "ddp"}, 2, CALIBRATION)
    there = predict_local_from_profile(_synthetic(host="elsewhere"), {"name": "ddp"}, 2, CALIBRATION)
    assert there["profile"]["scale"] == pytest.approx(0.5)  # 5e10 over the calibration's peak 1e11
    assert there["breakdown_s"]["forward_s"] == pytest.approx(0.5 * here["breakdown_s"]["forward_s"])
    assert step_at(_synthetic(), 3, 0.5)["backward_s"] == pytest.approx(0.5 * 2.5e-3)  # interpolated, then scaled
    at_1024 = {**CALIBRATION, "compute": {**CALIBRATION["compute"], "matmul": {
        "peak_flops": 1e11, "sizes": [512, 1024], "flops": [1e11, 2e10]}}}
    assert predict_local_from_profile(_synthetic(host="elsewhere"), {"name": "ddp"}, 2, at_1024)["profile"][
        "scale"] == pytest.approx(2.5)  # the same probe's size on both CPUs, not this machine's best size

    a100 = parse_cluster("a100-80gb:1x8")
    same = predict_cluster_from_profile(_synthetic(device_type="cuda", name="cuda: NVIDIA A100-SXM4-80GB"),
                                        {"name": "ddp"}, a100, global_batch=32)
    assert same.compute_s == pytest.approx(1.5e-3 + 3e-3)
    h100 = _synthetic(device_type="cuda", name="cuda: NVIDIA H100 80GB HBM3")
    on_a100 = predict_cluster_from_profile(h100, {"name": "ddp"}, a100, global_batch=32)
    assert on_a100.compute_s == pytest.approx((1.5e-3 + 3e-3) * 67.0 / 19.5)  # fp32, TF32 off: slower on an A100
    h100["device"]["tf32"] = True
    assert predict_cluster_from_profile(h100, {"name": "ddp"}, a100, global_batch=32).compute_s == \
        pytest.approx((1.5e-3 + 3e-3) * 494.0 / 156.0)
    with pytest.raises(ConfigError, match="not on a catalogue GPU"):
        predict_cluster_from_profile(_synthetic(), {"name": "ddp"}, a100, global_batch=32)
    with pytest.raises(ConfigError, match="do not scale to a CPU"):
        predict_local_from_profile(h100, {"name": "ddp"}, 2, CALIBRATION)
    for strategy in ("fsdp", "pipeline", "localsgd"):  # the catalogue's H100 nodes have no host figure: no server
        assert predict_cluster_from_profile(h100, {"name": strategy}, parse_cluster("h100:1x2")).step_s > 0


def _measured_at(batches: list[int], forward_s: list[float], device_type: str = "cpu",
                 name: str = "cpu: X") -> dict:
    """A profile whose whole step was measured at `batches` (backward twice the forward)."""
    profile = _synthetic(device_type=device_type, name=name)
    profile["step_by_batch"] = {"batch": batches, "forward_s": forward_s, "backward_s": [2 * f for f in forward_s],
                                "data_s": [1e-5] * len(batches), "optimizer_s": [4e-4] * len(batches)}
    return profile


def test_outside_the_measured_batches_the_time_per_sample_of_the_nearest():
    """Measured at 4/8/16 (1/3/7 ms): batch 1 is batch 4's a quarter (the end segment continued gave 0 s,
    and a ZeroDivisionError on a cluster); batch 32 twice batch 16's; a noisy pair (the smaller batch slower)
    or a single point does not go negative. The optimizer step stays the nearest's. The notes say so."""
    from ddlscope.predict.catalogue import parse_cluster
    from ddlscope.specs import ConfigError

    profile = _measured_at([4, 8, 16], [1e-3, 3e-3, 7e-3])
    assert step_at(profile, 1)["forward_s"] == pytest.approx(0.25e-3)
    assert step_at(profile, 32)["backward_s"] == pytest.approx(2 * 2 * 7e-3)
    assert step_at(profile, 1)["optimizer_s"] == pytest.approx(4e-4)
    assert step_at(profile, 6)["forward_s"] == pytest.approx(2e-3)  # inside: interpolated as before
    assert step_at(_measured_at([2, 4], [2e-3, 1e-3]), 1)["forward_s"] == pytest.approx(1e-3)
    assert step_at(_measured_at([1], [2e-3]), 3)["forward_s"] == pytest.approx(6e-3)
    local = predict_local_from_profile(profile, {"name": "ddp"}, 4, CALIBRATION, global_batch=4)
    assert local["breakdown_s"]["forward_s"] > 0 and any("outside the batches" in n for n in local["notes"])
    gpu = _measured_at([4, 8, 16], [1e-3, 3e-3, 7e-3], "cuda", "cuda: NVIDIA A100-SXM4-80GB")
    estimate = predict_cluster_from_profile(gpu, {"name": "ddp"}, parse_cluster("a100-80gb:1x8"), global_batch=8)
    assert estimate.compute_s == pytest.approx(0.75e-3) and any("outside the batches" in n for n in estimate.notes)
    with pytest.raises(ConfigError, match="forward \\+ backward at 4 samples"):
        step_at(_measured_at([4, 8], [0.0, 0.0]), 4)


def test_the_steps_are_the_runs_not_the_profiles():
    """A 12-step localsgd run of period 4 averages at steps 3, 7 and 11, 2 of them in the mean over steps
    1-11: priced as predict_local prices that run, not with the profile's workload default of 100 steps."""
    profile = _synthetic()
    profile["workload"] = {**profile["workload"], "steps": 100}
    kernels = {key: profile["step_by_batch"][key][1] for key in ("forward_s", "backward_s", "data_s", "optimizer_s")}
    facts = {**FACTS, "flops": FACTS["flops"] * 4 / 8, "per_rank_batch": 4, "kernels": {**kernels, "steps": 3}}
    strategy = {"name": "localsgd", "period": 4}
    for steps in (12, None):
        workload = {**profile["workload"], "steps": steps} if steps else \
            {k: v for k, v in profile["workload"].items() if k != "steps"}
        config = {"workload": workload, "strategy": strategy, "cluster": {"world_size": 2}}
        direct = predict_local(config, {}, facts, CALIBRATION)
        assert predict_local_from_profile(profile, strategy, 2, CALIBRATION, steps=steps)["step_s"] == \
            pytest.approx(direct["step_s"], rel=1e-12)
    assert predict_local_from_profile(profile, strategy, 2, CALIBRATION, steps=12)["step_s"] != \
        pytest.approx(predict_local_from_profile(profile, strategy, 2, CALIBRATION, steps=100)["step_s"], rel=1e-6)


def test_a_long_list_of_blocks_is_timed_in_groups():
    """70 residual blocks in a ModuleList, more than the 64 pieces: contiguous groups timed as one in the model's
    own forward and backward (a ModuleList has no forward to hook: it was dropped, its compute in the
    overhead), their FLOPs those of their blocks."""
    import torch
    from torch import nn
    from torch.utils.flop_counter import FlopCounterMode

    from ddlscope.runtime.profiler import ModuleGroup, model_split, profile_modules

    model, loss_fn = _residual(blocks=70), nn.functional.cross_entropy
    x, y = torch.randn(5, 8), torch.randint(0, 3, (5,))
    _, pieces = model_split(model, most=8)
    names = [name for name, _ in pieces]
    assert len(pieces) <= 8 and names[0] == "inp" and names[-1] == "out" and names[1] == "body.0-11"
    assert sum(len(m.members) for _, m in pieces if isinstance(m, ModuleGroup)) == 70
    timed = profile_modules(model, loss_fn, x, y, pieces, chain=False, repeats=1, warmup=0)
    assert [t.name for t in timed] == names + ["loss"]
    assert all(t.forward_s > 0 and t.backward_s > 0 and t.activation_bytes > 0 for t in timed[1:-2])
    counter = FlopCounterMode(display=False)
    with counter:
        loss_fn(model(x), y).backward()
    assert sum(t.flops for t in timed) == counter.get_total_flops()
    assert len(model_split(model)[1]) <= 64


def test_predict_profile_on_the_command_line(gpt_profile: tuple[Path, dict], tmp_path: Path):
    from conftest import run_cli_here

    path, profile = gpt_profile
    write_profile(CALIBRATION, tmp_path / "cal.toml")
    result = run_cli_here("predict", "--profile", str(path), "--strategy", "localsgd", "--set", "strategy.period=2",
                          "--world-size", "2", "--steps", "12", "--calibration", "cal.toml", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    expected = predict_local_from_profile(profile, {"name": "localsgd", "period": 2}, 2,
                                          CalibrationProfile.load(tmp_path / "cal.toml"), steps=12)
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
     "must be divisible by cluster.world_size"),  # run's own check
    (["predict", "--profile", "p.toml", "--model", "gpt"], "--profile"),
    (["predict", "--profile", "broken.json"], "not a readable JSON"),
    (["predict", "--profile", "p.toml", "--strategy", "gossip", "--world-size", "1", "--calibration", "cal.toml"],
     "needs at least 2 ranks"),  # the experiment's checks, as `run` applies them
    (["predict", "--profile", "p.toml", "--stack", "ideal", "--zero", "1", "--dtype", "bf16", "--spot", "--tp", "2"],
     "does not use --tp, --zero, --dtype, --spot, --stack"),
    (["predict", "--steps", "12", "--hidden", "8"], "--steps"),
    (["predict", "--profile", "p.toml", "--cluster", "a100-80gb:1x2"], "not on a catalogue GPU"),
    (["calibrate", "--model", "gpt-synthetic", "--quick", "--world-sizes", "2", "--db", "s.db"],
     "does not use --world-sizes, --quick, --db"),
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
