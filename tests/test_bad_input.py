"""Bad input is refused before any process starts: one line, exit 2, nothing stored."""

import pytest

CASES = {
    "unknown field": (["--set", "strategy.bucket_size=5"], "strategy.bucket_size"),
    "wrong type": (["--set", "workload.batch_size=\"many\""], "workload.batch_size"),
    "out of range": (["--set", "strategy.bucket_mb=-1"], "strategy.bucket_mb"),
    "unknown strategy": (["--strategy", "horovod"], "strategy.name"),
    "unknown workload": (["--workload", "imagenet"], "workload.name"),
    "world size below 1": (["--world-size", "0"], "cluster.world_size"),
    "batch not divisible": (["--world-size", "3", "--batch-size", "64"], "workload.batch_size"),
    "single with several ranks": (["--strategy", "single", "--world-size", "2"], "cluster.world_size"),
    "unknown section": (["--set", "optimizer.lr=1"], "optimizer"),
    "bad comm hook": (["--set", "strategy.comm_hook=bf16"], "strategy.comm_hook"),
    "option not an int": (["--world-size", "four"], "world-size"),
    "missing config file": (["nope.toml"], "nope.toml"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_line_and_exit_2(case, cli, tmp_path):
    args, field = CASES[case]
    result = cli("run", *args, timeout_s=60)
    assert result.returncode == 2, result
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert field in lines[0]
    assert "Traceback" not in result.stderr + result.stdout
    assert not (tmp_path / "ddlscope.db").exists(), "nothing may be stored for refused input"


def test_message_names_value_and_what_is_allowed(cli):
    result = cli("run", "--set", "strategy.comm_hook=bf16", timeout_s=60)
    assert "'bf16'" in result.stderr and "fp16" in result.stderr and "powersgd" in result.stderr
    result = cli("run", "--strategy", "horovod", timeout_s=60)
    assert "'horovod'" in result.stderr and "ddp" in result.stderr and "single" in result.stderr
    result = cli("run", "--set", "strategy.bucket_size=5", timeout_s=60)
    assert "bucket_mb" in result.stderr  # the allowed fields are listed


def test_invalid_toml_is_refused(cli, tmp_path):
    (tmp_path / "bad.toml").write_text("[workload\nname = 1\n")
    result = cli("run", "bad.toml", timeout_s=60)
    assert result.returncode == 2 and "not valid TOML" in result.stderr


def test_show_of_unknown_run_is_one_line(cli, tmp_path):
    result = cli("show", "42", timeout_s=60)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args", [["--repeats", "0"], ["--repeats", "11"]])
def test_study_refuses_repeats_out_of_range(cli, tmp_path, args):
    result = cli("study", "paper", "--quick", *args, timeout_s=60)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "--repeats" in result.stderr and "between 1 and 10" in result.stderr
    assert not (tmp_path / "ddlscope.db").exists()
