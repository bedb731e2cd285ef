"""The local predictor: torch-free model, strategy accounting, predict-run on a stored run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SRC

from ddlscope.calibrate import write_profile
from ddlscope.predict.local import message_s, model_state_bytes, predict_local

PROFILE = {
    "meta": {"cores": 8},
    "compute": {"matmul": {"peak_flops": 1e11}, "peak_flops": 1e11, "op_overhead_s": 2e-6,
                "optimizer_tensor_s": 3e-6, "memory_bandwidth_bytes_per_s": 1e10, "threads": 1},
    "collectives": {f"ws{n}": {op: {"alpha_s": 1e-4, "beta_bytes_per_s": 1e9, "r2": 1.0, "r2_all": 1.0}
                               for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p")}
                    for n in (2, 4)},
}
FACTS = {"flops": 10**9, "ops": 100, "param_numel": [4096, 64, 640, 10], "param_dim0": [64, 64, 10, 10],
         "param_bytes": 4 * (4096 + 64 + 640 + 10), "fsdp_units": [4 * 4160, 4 * 650, 0],
         "optimizer": "sgd", "momentum": 0.0, "per_rank_batch": 32}


def _config(strategy: str, world: int = 2, **extra) -> dict:
    return {"workload": {"name": "mlp-digits", "optimizer": "sgd"}, "strategy": {"name": strategy, **extra},
            "cluster": {"world_size": world}}


def test_predict_package_stays_torch_free():
    code = "import sys, ddlscope.predict, ddlscope.predict.local; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(SRC)}, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


def test_emulated_link_sets_the_floor():
    fast = message_s(PROFILE, "all_reduce", 1e6, 2, None)
    assert fast == pytest.approx(1e-4 + 1e6 / 1e9)
    slow = message_s(PROFILE, "all_reduce", 1e6, 2, (50e-6, 1e7))  # wire bytes = payload at 2 ranks
    assert slow == pytest.approx(50e-6 + 1e6 / 1e7)


def test_memory_by_strategy():
    full = FACTS["param_bytes"]
    assert model_state_bytes(_config("ddp"), FACTS)["worker"] == {"parameters": full, "gradients": full, "optimizer": 0}
    adam = {**FACTS, "optimizer": "adamw"}
    assert model_state_bytes(_config("ddp"), adam)["worker"]["optimizer"] == 2 * full
    fsdp = model_state_bytes(_config("fsdp", 4), adam)["worker"]
    shard = 4 * (16 * 64 + 16 + 3 * 64 + 3)  # dim-0 shards padded to ceil(dim0 / 4)
    assert fsdp == {"parameters": shard, "gradients": shard, "optimizer": 2 * shard}
    ps = model_state_bytes(_config("ps-sync", 2, servers=2), adam)
    assert ps["worker"]["optimizer"] == 0 and ps["server"]["optimizer"] == 2 * ps["server"]["parameters"]


def test_prediction_shape_and_strategy_ordering():
    ddp = predict_local(_config("ddp"), {}, FACTS, PROFILE)
    assert set(ddp) >= {"step_s", "breakdown_s", "memory_bytes", "model_state_bytes", "notes"}
    assert ddp["step_s"] == pytest.approx(sum(ddp["breakdown_s"].values()))
    emulated = {"network": {"emulated": True, "alpha_s": 5e-3, "bandwidth_bytes_per_s": 1e6}}
    assert predict_local(_config("ddp"), emulated, FACTS, PROFILE)["step_s"] > ddp["step_s"] + 5e-3
    sync4 = predict_local(_config("ps-sync", 4, servers=1), emulated, FACTS, PROFILE)
    sync2 = predict_local(_config("ps-sync", 2, servers=1), emulated, FACTS, PROFILE)
    assert sync4["breakdown_s"]["comm_wait_s"] > 1.9 * sync2["breakdown_s"]["comm_wait_s"]


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_predict_run_on_a_stored_ddp_run(tmp_path: Path):
    from ddlscope.runtime.config import load_experiment
    from ddlscope.runtime.launcher import launch

    db = tmp_path / "ddlscope.db"
    exp = load_experiment(None, {"strategy.name": "ddp", "cluster.world_size": 2, "workload.steps": 3,
                                 "workload.optimizer": "adamw", "workload.lr": 1e-3})
    assert launch(exp, db).status == "finished"
    write_profile(PROFILE, tmp_path / "cal.toml")
    code = ("import sys; from ddlscope.cli import app, main; from ddlscope.cli_calibrate import register; "
            "names = {c.name or c.callback.__name__ for c in app.registered_commands}; "
            "'calibrate' in names or register(app); sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, "predict-run", "1", "--calibration", "cal.toml", "--json"],
                          cwd=tmp_path, env={"PYTHONPATH": str(SRC), "COLUMNS": "200"}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert set(result) == {"run", "predicted", "measured", "error"}
    assert set(result["predicted"]["breakdown_s"]) == {"data_s", "forward_s", "backward_s", "comm_wait_s",
                                                       "optimizer_s"}
    assert result["predicted"]["step_s"] > 0 and result["measured"]["step_s"] > 0
    predicted, measured = result["predicted"]["model_state_bytes"], result["measured"]["model_state_bytes"]
    assert measured > 0 and abs(predicted - measured) / measured <= 0.05
    assert abs(result["error"]["model_state_error"]) <= 0.05

    missing = subprocess.run([sys.executable, "-c", code, "predict-run", "1", "--calibration", "nope.toml"],
                             cwd=tmp_path, env={"PYTHONPATH": str(SRC)}, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and missing.stderr.startswith("error: calibration file")
