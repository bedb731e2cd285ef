"""predict, plan, advise and the local predictor give the numbers they gave before the redesign.

The set below was recorded (tests/data/regression_numbers.json) before the
architecture issue moved any code; every number must match to 1e-9
(relative). Re-record only for a deliberate change of the models:

    python tests/test_regression_numbers.py --record
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

RECORD = Path(__file__).parent / "data" / "regression_numbers.json"
# Wall-clock figures of the search itself: not model output.
VOLATILE_KEYS = {"search_s", "configs_per_s"}

GPT_1B = ["--model", "gpt", "--hidden", "2048", "--heads", "16", "--layers", "24", "--seq", "2048",
          "--vocab", "51200", "--global-batch", "256"]
GPT_175B = ["--model", "gpt", "--hidden", "12288", "--heads", "96", "--layers", "96", "--seq", "2048",
            "--vocab", "51200", "--global-batch", "1536"]
LLAMA_8B = ["--model", "gpt", "--hidden", "4096", "--heads", "32", "--kv-heads", "8", "--layers", "32",
            "--seq", "8192", "--vocab", "128256", "--ffn-hidden", "14336", "--gated-mlp", "--global-batch", "512"]

CLI_CASES: dict[str, list[str]] = {
    "predict-1b-dp16-zero0": ["predict", "--cluster", "a100-80gb:2x8", *GPT_1B, "--micro-batch", "4"],
    "predict-1b-dp16-zero3": ["predict", "--cluster", "a100-80gb:2x8", *GPT_1B, "--micro-batch", "4", "--zero", "3"],
    "predict-1b-tp2-zero1": ["predict", "--cluster", "h100:2x8", *GPT_1B, "--micro-batch", "2", "--tp", "2",
                             "--zero", "1", "--recompute", "selective"],
    "predict-175b-3d": ["predict", "--cluster", "a100-80gb:96x8", *GPT_175B, "--micro-batch", "1", "--tp", "8",
                        "--pp", "12", "--recompute", "full", "--attention", "unfused"],
    "predict-175b-interleave": ["predict", "--cluster", "a100-80gb:96x8", *GPT_175B, "--micro-batch", "1", "--tp",
                                "8", "--pp", "12", "--interleave", "2", "--sequence-parallel",
                                "--recompute", "selective"],
    "predict-175b-gpipe-spot": ["predict", "--cluster", "h100:64x8", *GPT_175B, "--micro-batch", "2", "--tp", "8",
                                "--pp", "8", "--schedule", "gpipe", "--recompute", "full", "--spot"],
    "predict-llama8b-fp16": ["predict", "--cluster", "h100:4x8", *LLAMA_8B, "--micro-batch", "1", "--tp", "4",
                             "--zero", "1", "--dtype", "fp16", "--recompute", "selective"],
    "predict-1b-sustained": ["predict", "--cluster", "a100-80gb:2x8", *GPT_1B, "--micro-batch", "4",
                             "--sustained-fraction", "0.9"],
    "predict-1b-measured": ["predict", "--cluster", "a100-80gb:2x8", *GPT_1B, "--micro-batch", "4",
                            "--measured-step-s", "2.5"],
    "plan-1b-h100": ["plan", "--cluster", "h100:2x8", *GPT_1B],
    "plan-175b-a100": ["plan", "--cluster", "a100-80gb:96x8", *GPT_175B],
    "plan-llama8b-cost": ["plan", "--cluster", "h100:4x8", *LLAMA_8B, "--by", "cost"],
    "advise-mlp-a100": ["advise", "--cluster", "a100-80gb:1x8"],
    "advise-mlp-a10g-straggler": ["advise", "--cluster", "a10g:2x4", "--stragglers", "2"],
    "advise-gpt-synthetic-h100": ["advise", "--cluster", "h100:2x8", "--workload", "gpt-synthetic", "--batch-size", "64"],
    "advise-cnn-ssp": ["advise", "--cluster", "a100-80gb:2x8", "--workload", "cnn-digits",
                       "--set", "strategy.name=ssp", "--set", "strategy.staleness=5"],
    "advise-ddp-bucket": ["advise", "--cluster", "a100-80gb:1x8", "--set", "strategy.bucket_mb=1",
                          "--sustained-fraction", "0.8"],
}

# The local predictor: a fixed calibration profile and workload facts (as test_predict_local uses).
PROFILE = {
    "meta": {"cores": 2},
    "compute": {"matmul": {"peak_flops": 1e11}, "peak_flops": 1e11, "op_overhead_s": 2e-6,
                "optimizer_tensor_s": 3e-6, "memory_bandwidth_bytes_per_s": 1e10, "threads": 1},
    "collectives": {f"ws{n}": {op: {"alpha_s": 1e-4 * n / 2, "beta_bytes_per_s": 1e9 / n, "r2": 1.0, "r2_all": 1.0}
                               for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p")}
                    for n in (2, 4)},
    "sync": {f"ws{n}": {"block_alone_s": [1e-3, 1e-2], "compute_stretch": [1.1, 1.3],
                        "sync_overhead_s": [2e-4, 4e-4]} for n in (2, 3, 4, 5)},
    "ddp": {"ws2": {"model_bytes": [1e5, 1e6, 1e7], "overhead_s": [1e-3, 2e-3, 9e-3]}},
    "fsdp": {"ws2": {"unit_bytes": [1e4, 1e5, 1e6], "unit_overhead_s": [5e-4, 8e-4, 3e-3]}},
    "ps": {f"ws{n + 1}": {"workers": n, "bytes": [1e4, 1e6], "round_s": [1e-3 * n, 5e-3 * n],
                          "block_alone_s": [1e-3, 1e-2], "busy_round_s": [[2e-3 * n, 6e-3 * n], [3e-3 * n, 8e-3 * n]],
                          "busy_block_s": [1.2e-3, 1.15e-2]} for n in (1, 2, 4)},
}
FACTS = {"flops": 10**9, "ops": 100, "param_numel": [4096, 64, 640, 10], "param_dim0": [64, 64, 10, 10],
         "param_bytes": 4 * (4096 + 64 + 640 + 10), "fsdp_units": [4 * 4160, 4 * 650, 0],
         "optimizer": "sgd", "momentum": 0.9, "per_rank_batch": 32}
# A larger model, whose gradients fill several DDP buckets (knob defaults decide the count).
BIG_FACTS = {**FACTS, "flops": 10**11, "param_numel": [30_000_000, 1000, 5_000_000], "param_dim0": [3000, 1000, 500],
             "param_bytes": 4 * 35_001_000, "fsdp_units": [4 * 30_001_000, 4 * 5_000_000, 0]}
EMULATED = {"network": {"emulated": True, "alpha_s": 5e-4, "bandwidth_bytes_per_s": 1e7}}
LOCAL_CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "local-single": ({"name": "single"}, {"world_size": 1}),
    "local-ddp-2": ({"name": "ddp"}, {"world_size": 2}),
    "local-ddp-4-emulated": ({"name": "ddp", "bucket_mb": 0.01}, {"world_size": 4, "emulated": True}),
    "local-fsdp-2": ({"name": "fsdp"}, {"world_size": 2}),
    "local-fsdp-2-model-emulated": ({"name": "fsdp", "wrap": "model", "reshard_after_forward": False},
                                    {"world_size": 2, "emulated": True}),
    "local-ps-sync-2": ({"name": "ps-sync", "servers": 1}, {"world_size": 2}),
    "local-ps-sync-4-emulated": ({"name": "ps-sync", "servers": 2}, {"world_size": 4, "emulated": True}),
    "local-ps-async-2": ({"name": "ps-async", "servers": 1}, {"world_size": 2}),
    "local-ps-async-block-cyclic": ({"name": "ps-async", "servers": 2, "block_cyclic": True}, {"world_size": 4}),
    "local-ssp-2": ({"name": "ssp", "servers": 1, "staleness": 2}, {"world_size": 2}),
    "local-ddp-2-big-defaults": ({"name": "ddp"}, {"world_size": 2, "emulated": True, "big": True}),
    "local-fsdp-4-big-defaults": ({"name": "fsdp"}, {"world_size": 4, "emulated": True, "big": True}),
    "local-ps-async-defaults": ({"name": "ps-async"}, {"world_size": 2, "big": True}),
    "local-stale-aware-4": ({"name": "ps-stale-aware", "servers": 1}, {"world_size": 4, "emulated": True}),
}


def _cli_json(args: list[str]) -> Any:
    from typer.testing import CliRunner

    from ddlscope.cli import app

    result = CliRunner().invoke(app, [*args, "--json", "--db", "no-such-store.db"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _local(name: str) -> Any:
    from ddlscope.predict.local import predict_local

    strategy, cluster = LOCAL_CASES[name]
    config = {"workload": {"name": "mlp-digits", "optimizer": "sgd"}, "strategy": strategy,
              "cluster": {"world_size": cluster["world_size"]}}
    facts = BIG_FACTS if cluster.get("big") else FACTS
    return predict_local(config, EMULATED if cluster.get("emulated") else {}, facts, PROFILE)


def compute(name: str) -> Any:
    return _cli_json(CLI_CASES[name]) if name in CLI_CASES else _local(name)


def _without_volatile(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_volatile(v) for k, v in value.items() if k not in VOLATILE_KEYS}
    if isinstance(value, list):
        return [_without_volatile(v) for v in value]
    return value


def assert_same(got: Any, want: Any, path: str = "") -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{path}: keys {sorted(got)} != {sorted(want)}"
        for key in want:
            assert_same(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{path}: {got!r} != {want!r}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}[{i}]")
    elif isinstance(want, float) and not isinstance(want, bool):
        assert isinstance(got, (int, float)), f"{path}: {got!r} != {want!r}"
        assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-15), f"{path}: {got!r} != {want!r}"
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


ALL_CASES = [*CLI_CASES, *LOCAL_CASES]


def test_the_set_is_large_enough():
    assert len(ALL_CASES) >= 20
    assert set(json.loads(RECORD.read_text())) == set(ALL_CASES)


@pytest.mark.parametrize("name", ALL_CASES)
def test_same_numbers_as_recorded(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)  # advise looks for a store; none here
    want = json.loads(RECORD.read_text())[name]
    assert_same(_without_volatile(json.loads(json.dumps(compute(name), default=str))), want, name)


if __name__ == "__main__" and "--record" in sys.argv:
    import os
    import tempfile

    os.chdir(tempfile.mkdtemp())
    recorded = {name: _without_volatile(json.loads(json.dumps(compute(name), default=str))) for name in ALL_CASES}
    RECORD.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
    print(f"recorded {len(recorded)} cases in {RECORD}")
