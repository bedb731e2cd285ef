"""`ddlscope slurm` writes an sbatch script that starts the same run with srun + the elastic launcher."""

import shutil
import subprocess

import pytest


def test_sbatch_script(cli, tmp_path):
    cfg = tmp_path / "exp.toml"
    cfg.write_text('[workload]\nname = "gpt-char"\nbatch_size = 64\n[strategy]\nname = "ddp"\n')
    result = cli("slurm", "exp.toml", "--nodes", "4", "--procs-per-node", "8", "--set", "strategy.bucket_mb=5",
                 "-o", "job.sbatch", timeout_s=60)
    assert result.returncode == 0, result.stderr
    script = (tmp_path / "job.sbatch").read_text()
    assert "#SBATCH --nodes=4" in script and "srun" in script
    assert "--nnodes 4 --procs-per-node 8" in script and '--node-rank "$SLURM_NODEID"' in script
    assert "strategy.bucket_mb=5" in script and str(cfg.resolve()) in script
    if shutil.which("bash"):
        assert subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")]).returncode == 0


def test_sbatch_refuses_bad_config(cli, tmp_path):
    (tmp_path / "exp.toml").write_text('[workload]\nname = "mlp-digits"\nbatch_size = 30\n')
    result = cli("slurm", "exp.toml", "--nodes", "2", "--procs-per-node", "4", timeout_s=60)
    assert result.returncode == 2 and "divisible" in result.stderr
