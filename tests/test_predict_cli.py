"""`ddlscope predict` / `ddlscope plan` through the ddlscope typer app (`ddlscope.cli.predict`)."""

import json

import pytest
from typer.testing import CliRunner

from ddlscope import cli
from ddlscope.specs import ConfigError

FLAGS = ("predict --cluster a100-80gb:8x8 --model gpt --hidden 3072 --heads 32 --layers 30 --seq 2048 --vocab 51200 "
         "--global-batch 512 --micro-batch 8 --tp 1 --pp 1 --dp 64 --recompute full --zero 0").split()
REQUIRED_KEYS = {"step_time_s", "tflops_per_gpu", "mfu", "memory_gb_per_gpu", "memory_breakdown_gb", "fits",
                 "energy_kwh_per_step", "cost_usd_per_step", "breakdown_s"}


@pytest.fixture
def app():
    return cli.app


@pytest.fixture
def run(app):
    runner = CliRunner()

    def invoke(*args: str):
        return runner.invoke(app, list(args), terminal_width=200)

    return invoke


@pytest.fixture
def main(capsys):
    """cli.main(): ConfigError -> one line on stderr, status 2."""

    def call(*args: str):
        code = cli.main(list(args))
        out = capsys.readouterr()
        return code, out.out, out.err

    return call


def test_flag_form_prints_one_json_object(run):
    result = run(*FLAGS, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert REQUIRED_KEYS <= set(data)
    assert isinstance(data["memory_gb_per_gpu"], float) and isinstance(data["fits"], bool)
    assert set(data["memory_breakdown_gb"]) == {"parameters", "gradients", "optimizer", "activations", "other"}
    assert {"compute", "tp_comm", "pp_p2p", "dp_grad_sync", "bubble"} <= set(data["breakdown_s"])
    assert 0 < data["mfu"] < 1 and data["tflops_per_gpu"] > data["mfu"] * 312  # recompute counted in TFLOP/s


def test_all_flags_of_the_issue(run):
    args = [a for a in FLAGS]
    args[args.index("--tp") + 1], args[args.index("--pp") + 1], args[args.index("--dp") + 1] = "2", "2", "16"
    args[args.index("--recompute") + 1], args[args.index("--zero") + 1] = "selective", "1"
    result = run(*args, "--sequence-parallel", "--interleave", "3", "--micro-batch", "1", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["parallel"]["sequence_parallel"] is True and data["parallel"]["interleave"] == 3


def test_readable_table(run):
    result = run(*FLAGS)
    assert result.exit_code == 0, result.output
    for word in ("step time", "MFU", "fits", "bubble", "activations", "kWh"):
        assert word in result.output


def test_toml_config_form_and_flags_override_it(run, tmp_path):
    cfg = tmp_path / "gpt.toml"
    cfg.write_text('cluster = "a100-80gb:8x8"\n[model]\nname = "gpt"\nhidden = 3072\nheads = 32\nlayers = 30\n'
                   'seq = 2048\nvocab = 51200\nglobal_batch = 512\n[parallel]\ntp = 2\npp = 1\nmicro_batch = 4\n'
                   'recompute = "selective"\nzero = 1\nsequence_parallel = true\n')
    from_file = json.loads(run("predict", str(cfg), "--json").output)
    assert from_file["parallel"]["tp"] == 2 and from_file["parallel"]["dp"] == 32  # dp defaults to GPUs/(tp pp)
    overridden = json.loads(run("predict", str(cfg), "--tp", "4", "--json").output)
    assert overridden["parallel"]["tp"] == 4 and overridden["parallel"]["dp"] == 16
    planned = run("plan", str(cfg), "--top", "3", "--json")
    assert planned.exit_code == 0, planned.output
    assert len(json.loads(planned.output)["top"]) == 3


def test_plan_table_and_json(run):
    args = ("plan --cluster a100-80gb:8x8 --model gpt --hidden 3072 --heads 32 --layers 30 --seq 2048 "
            "--vocab 51200 --global-batch 512").split()
    table = run(*args, "--top", "3")
    assert table.exit_code == 0, table.output
    assert "#1" in table.output and "beats next" in table.output
    assert "recompute=" in table.output and "\u2026" not in table.output  # configurations whole, wrapped
    data = json.loads(run(*args, "--by", "cost", "--json").output)
    assert data["by"] == "cost" and data["evaluated"] > 0 and len(data["top"]) == 5
    assert [r["rank"] for r in data["top"]] == [1, 2, 3, 4, 5]


BAD = {
    "more GPUs than the cluster": (["--dp", "128"], "tp x pp x dp"),
    "odd tp, too many GPUs": (["--tp", "3", "--dp", "22"], "tp x pp x dp"),
    "heads % tp": (["--tp", "64", "--dp", "1"], "heads"),
    "layers % pp": (["--pp", "4", "--dp", "16"], "layers"),
    "batch": (["--micro-batch", "3"], "global_batch"),
    "recompute": (["--recompute", "some"], "recompute"),
    "zero": (["--zero", "4"], "zero"),
    "interleave without pp": (["--interleave", "2"], "interleave"),
    "cluster string": (["--cluster", "a100:lots"], "cluster"),
    "unknown cluster": (["--cluster", "tpu-v4:8x8"], "tpu-v4"),
    "model": (["--model", "bert"], "model"),
    "sp without tp": (["--sequence-parallel"], "sequence_parallel"),
    "sustained fraction above the peak": (["--sustained-fraction", "1.5"], "sustained_fraction"),
    "sustained fraction zero": (["--sustained-fraction", "0"], "sustained_fraction"),
    "measured step faster than the peak": (["--measured-step-s", "0.001"], "datasheet peak"),
    "measured step and fraction": (["--measured-step-s", "3", "--sustained-fraction", "0.8"], "not both"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_on_stderr_and_exit_2(main, case):
    extra, needle = BAD[case]
    args = list(FLAGS)
    for flag, value in zip(extra[::2], extra[1::2]) if len(extra) > 1 else []:
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    if len(extra) == 1:
        args += extra
    code, out, err = main(*args, "--json")
    assert code == 2, (out, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert needle in lines[0] and "Traceback" not in err


def test_missing_model_field_and_bad_file(main, tmp_path):
    code, _, err = main("predict", "--cluster", "h100:1x8", "--hidden", "1024")
    assert code == 2 and "--heads" in err
    (tmp_path / "bad.toml").write_text("[model\nhidden = 1\n")
    code, _, err = main("predict", str(tmp_path / "bad.toml"))
    assert code == 2 and "not valid TOML" in err and len(err.strip().splitlines()) == 1
    (tmp_path / "extra.toml").write_text('cluster = "h100:1x8"\n[model]\nhidden = 1024\nwidth = 3\n')
    code, _, err = main("predict", str(tmp_path / "extra.toml"))
    assert code == 2 and "model.width" in err and "allowed" in err


def test_config_errors_are_value_errors(run):
    result = run("predict", "--cluster", "nope")
    assert isinstance(result.exception, ConfigError) and isinstance(result.exception, ValueError)


def test_the_issue_example_runs_on_a_subset_of_the_cluster():
    """The documented flag form, verbatim: 64 data-parallel GPUs of a 512-GPU cluster."""
    import json
    import subprocess
    import sys

    args = ("predict --cluster a100-80gb:64x8 --model gpt --hidden 3072 --heads 32 --layers 30 --seq 2048 "
            "--vocab 51200 --global-batch 512 --micro-batch 8 --tp 1 --pp 1 --dp 64 --recompute full --zero 1 --json")
    proc = subprocess.run([sys.executable, "-m", "ddlscope", *args.split()], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    for key in ("step_time_s", "tflops_per_gpu", "mfu", "memory_gb_per_gpu", "memory_breakdown_gb", "fits",
                "energy_kwh_per_step", "cost_usd_per_step", "breakdown_s"):
        assert key in out
    assert 0 < out["mfu"] < 1 and any("64 of the cluster's 512 GPUs" in n for n in out["notes"])


# A profile as `ddlscope calibrate` writes it (the fields local:1xN reads), numbers of this machine's order.
LOCAL_PROFILE = {
    "meta": {"host": "h", "cores": 2, "memory_bytes": 24 * 2**30},
    "compute": {"peak_flops": 1.6e11, "matmul": {"sizes": [64, 128, 256, 512], "flops": [4e10, 1.2e11, 1.6e11, 1.4e11]},
                "bf16": {"size": 512, "flops": 1.1e12}, "memory_bandwidth_bytes_per_s": 1.7e10,
                "op_overhead_s": 2.4e-6},
    "collectives": {f"ws{n}": {"all_reduce": {"alpha_s": 3e-4 * (n - 1), "beta_bytes_per_s": 1.2e9 / (n - 1)}}
                    for n in (2, 4)},
}


def test_local_cluster_comes_from_the_calibration():
    from ddlscope.predict import ModelSpec, ParallelSpec, predict
    from ddlscope.predict.catalogue import ClusterStringError, parse_cluster

    cluster = parse_cluster("local:1x2", local_profile=LOCAL_PROFILE)
    dev = cluster.device
    assert dev.peak("fp32") == 1.6e11 and dev.peak("bf16") == 1.1e12
    assert dev.memory_bytes == 12 * 2**30  # two ranks share the machine's memory
    assert dev.efficiency.gemm_kernel_fraction == dev.efficiency.sustained_fraction == 1.0
    assert 0 < dev.efficiency.gemm_half_dim < 128  # 64 runs at a quarter of the peak: sat(64) = 1/2 -> d = 64
    # the ring model over 2 ranks gives back the calibrated all-reduce: alpha + bytes / beta
    link = cluster.node.intra
    assert 2 * link.alpha_s + 1e6 / link.achieved_bytes_per_s == pytest.approx(3e-4 + 1e6 / 1.2e9)
    small = ModelSpec(hidden=256, heads=4, layers=2, seq=128, vocab=65, global_batch=16, dtype="fp32")
    result = predict(small, ParallelSpec(dp=2, micro_batch=8), cluster)
    assert result.fits and 0 < result.step_time_s < 10 and result.cost_usd_per_step == 0.0
    with pytest.raises(ClusterStringError, match="use local:1xN"):
        parse_cluster("local:2x2", local_profile=LOCAL_PROFILE)
    with pytest.raises(ClusterStringError, match="calibrate"):
        parse_cluster("local:1x2")


def test_local_cluster_on_the_command_line(main, tmp_path, monkeypatch):
    from ddlscope.calibrate import write_profile

    monkeypatch.chdir(tmp_path)
    args = ("predict", "--cluster", "local:1x2", "--model", "gpt", "--hidden", "256", "--heads", "4", "--layers",
            "2", "--seq", "128", "--vocab", "65", "--global-batch", "16", "--micro-batch", "8", "--dtype", "fp32",
            "--json")
    code, _, err = main(*args)  # no calibration anywhere: one line, exit 2
    assert code == 2 and "ddlscope calibrate" in err and len(err.strip().splitlines()) == 1
    write_profile(LOCAL_PROFILE, tmp_path / "ddlscope-calibration.toml")
    code, out, err = main(*args)
    assert code == 0, err
    assert json.loads(out)["cluster"] == "local:1x2"


def test_sustained_fraction_from_a_measured_step_reproduces_it(run, tmp_path):
    """One measured run of a stack sets its constant; predict with it elsewhere gives the same numbers."""
    at_08 = json.loads(run(*FLAGS, "--sustained-fraction", "0.8", "--json").output)
    assert at_08["sustained_fraction"] == 0.8
    default = json.loads(run(*FLAGS, "--json").output)
    assert at_08["step_time_s"] > default["step_time_s"]  # less of the tensor cores (catalogue: 1): a longer step
    fitted = json.loads(run(*FLAGS, "--measured-step-s", str(at_08["step_time_s"]), "--json").output)
    assert fitted["sustained_fraction"] == pytest.approx(0.8, abs=1e-6)
    assert fitted["fitted_to_step_s"] == at_08["step_time_s"]
    assert fitted["step_time_s"] == pytest.approx(at_08["step_time_s"], rel=1e-9)
    text = run(*FLAGS, "--measured-step-s", str(at_08["step_time_s"])).output
    assert "--sustained-fraction 0.800" in text
    # the config file's key, and plan
    (tmp_path / "stack.toml").write_text('cluster = "a100-80gb:8x8"\nsustained_fraction = 0.8\n[model]\nhidden = 3072\n'
                                         'heads = 32\nlayers = 30\nseq = 2048\nvocab = 51200\nglobal_batch = 512\n'
                                         '[parallel]\ntp = 1\npp = 1\ndp = 64\nmicro_batch = 8\nrecompute = "full"\n')
    from_file = json.loads(run("predict", str(tmp_path / "stack.toml"), "--json").output)
    assert from_file["step_time_s"] == pytest.approx(at_08["step_time_s"], rel=1e-12)
    plans = [json.loads(run("plan", "--cluster", "a100-80gb:8x8", "--hidden", "3072", "--heads", "32", "--layers",
                            "30", "--seq", "2048", "--vocab", "51200", "--global-batch", "512", *extra,
                            "--json").output)["top"][0]["step_time_s"] for extra in ([], ["--sustained-fraction", "0.8"])]
    assert plans[1] > plans[0]


def test_gradient_reduction_and_accumulation_flags_match_the_toml_keys(run, main, tmp_path):
    """--no-overlap-grad-reduce leaves the whole data-parallel all-reduce after the backward;
    --fused-grad-accumulation removes the per-micro-batch accumulation pass; the TOML keys do the same."""
    def breakdown(*extra: str) -> dict:
        result = run(*FLAGS, *extra, "--json")
        assert result.exit_code == 0, result.output
        return json.loads(result.output)["breakdown_s"]

    default = breakdown()
    waited = breakdown("--no-overlap-grad-reduce")
    fused = breakdown("--fused-grad-accumulation")
    assert waited["dp_grad_sync"] > 2 * default["dp_grad_sync"] > 0
    assert default["grad_accumulation"] > 0 and fused["grad_accumulation"] == 0
    assert fused["dp_grad_sync"] == default["dp_grad_sync"]
    config = tmp_path / "p.toml"
    config.write_text("[parallel]\noverlap_grad_reduce = false\nfused_grad_accumulation = true\n")
    both = run(*FLAGS[:1], str(config), *FLAGS[1:], "--json")
    assert both.exit_code == 0, both.output
    data = json.loads(both.output)["breakdown_s"]
    assert data["dp_grad_sync"] == waited["dp_grad_sync"] and data["grad_accumulation"] == 0
    config.write_text("[parallel]\nfused_grad_accumulation = 3\n")
    code, _, err = main(*FLAGS[:1], str(config), *FLAGS[1:])
    assert code == 2 and "parallel.fused_grad_accumulation = 3: must be true or false" in err
    assert len(err.strip().splitlines()) == 1


def test_plan_keeps_the_stacks_gradient_handling_for_every_layout(run, main, tmp_path):
    """plan --no-overlap-grad-reduce (or the [parallel] key) prices each layout it ranks as predict does with
    the same key; a CNN's plan refuses fused_grad_accumulation, in one line."""
    model = ("--cluster a100-80gb:8x8 --hidden 3072 --heads 32 --layers 30 --seq 2048 --vocab 51200 "
             "--global-batch 512").split()
    config = tmp_path / "p.toml"
    config.write_text("[parallel]\noverlap_grad_reduce = false\n")
    ranked = json.loads(run("plan", *model, "--top", "20", "--json", "--no-overlap-grad-reduce").output)["top"]
    assert json.loads(run("plan", str(config), *model, "--top", "20", "--json").output)["top"] == ranked
    # a layout whose gradients are all-reduced at the end of the step (ZeRO 0/1 over dp > 1)
    row = next(r for r in ranked if r["parallel"]["zero"] <= 1 and r["parallel"]["dp"] > 1)
    layout = [f"--{k.replace('_', '-')}={v}" for k, v in row["parallel"].items()
              if k in ("tp", "cp", "pp", "dp", "micro_batch", "zero", "recompute", "interleave", "schedule")]
    layout += ["--sequence-parallel"] if row["parallel"]["sequence_parallel"] else []
    waited, overlapped = (run("predict", *extra, *model, *layout, "--json") for extra in ([str(config)], []))
    assert waited.exit_code == 0 and overlapped.exit_code == 0, waited.output + overlapped.output
    assert json.loads(waited.output)["step_time_s"] == pytest.approx(row["step_time_s"], rel=1e-9)
    assert json.loads(overlapped.output)["breakdown_s"]["dp_grad_sync"] < row["breakdown_s"]["dp_grad_sync"]
    code, _, err = main("plan", "--cluster", "a100-80gb:1x8", "--model", "resnet50", "--global-batch", "256",
                        "--fused-grad-accumulation")
    assert code == 2 and "fused_grad_accumulation is a GPT option" in err and len(err.strip().splitlines()) == 1
