"""The local predictor: torch-free model, strategy accounting, predict-run on a stored run."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SRC, run_cli_here

from ddlscope.calibrate import write_profile
from ddlscope.predict.local import model_state_bytes, predict_local
from ddlscope.specs import ConfigError
from ddlscope.calibrate.model import OPS_PER_PARAM_OPTIMIZER, message_s, optimizer_kind
from ddlscope.calibrate.profile import CalibrationProfile, CollectiveFit, SyncProbe

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


def typed(profile: dict) -> CalibrationProfile:
    return CalibrationProfile.coerce(profile)


def _config(strategy: str, world: int = 2, **extra) -> dict:
    return {"workload": {"name": "mlp-digits", "optimizer": "sgd"}, "strategy": {"name": strategy, **extra},
            "cluster": {"world_size": world}}


def test_predict_package_stays_torch_free():
    code = "import sys, ddlscope.predict, ddlscope.predict.local; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(SRC)}, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


def test_emulated_link_sets_the_floor():
    fast = message_s(typed(PROFILE), "all_reduce", 1e6, 2, None)
    assert fast == pytest.approx(1e-4 + 1e6 / 1e9)
    slow = message_s(typed(PROFILE), "all_reduce", 1e6, 2, (50e-6, 1e7))  # wire bytes = payload at 2 ranks
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
@pytest.mark.parametrize("workload", [{}, {"workload.name": "module:examples.my_model:build"}],
                         ids=["built-in", "module-source"])
def test_predict_run_on_a_stored_ddp_run(workload: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from ddlscope.runtime.config import experiment_to_dict, load_experiment
    from ddlscope.runtime.launcher import launch

    monkeypatch.syspath_prepend(str(SRC.parent))  # examples/ (a model source the user's own code names)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(SRC.parent), os.environ.get("PYTHONPATH", "")]))
    db = tmp_path / "ddlscope.db"
    exp = load_experiment(None, {"strategy.name": "ddp", "cluster.world_size": 2, "workload.steps": 3,
                                 "workload.optimizer": "adamw", "workload.lr": 1e-3, **workload})
    assert launch(exp, db).status == "finished"
    write_profile(PROFILE, tmp_path / "cal.toml")
    proc = run_cli_here("predict-run", "1", "--calibration", "cal.toml", "--json", cwd=tmp_path)  # fork server reused
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert set(result) == {"run", "calibration", "predicted", "measured", "error"}
    assert set(result["predicted"]["breakdown_s"]) == {"data_s", "forward_s", "backward_s", "comm_wait_s",
                                                       "optimizer_s"}
    assert result["predicted"]["step_s"] > 0 and result["measured"]["step_s"] > 0
    predicted, measured = result["predicted"]["model_state_bytes"], result["measured"]["model_state_bytes"]
    assert measured > 0 and abs(predicted - measured) / measured <= 0.05
    assert abs(result["error"]["model_state_error"]) <= 0.05

    missing = run_cli_here("predict-run", "1", "--calibration", "nope.toml", cwd=tmp_path)
    assert missing.returncode == 2 and missing.stderr.startswith("error: calibration file")


def test_message_time_interpolates_the_calibrated_table_and_ignores_spikes():
    from ddlscope.calibrate.model import measured_message_s

    fit = CollectiveFit(alpha_s=1e-4, beta_bytes_per_s=1e9, sizes=[1e3, 1e4, 1e5, 1e6],
                        seconds=[1e-4, 5e-3, 2e-4, 1.1e-3])  # 5 ms at 10 kB: interference, not the link
    assert measured_message_s(fit, 1e3) == pytest.approx(1e-4)
    assert measured_message_s(fit, 1e4) == pytest.approx(2e-4)  # the lower envelope
    between = measured_message_s(fit, 3.16e5)
    assert 2e-4 < between < 1.1e-3
    assert measured_message_s(fit, 2e6) == pytest.approx(1.1e-3 + 1e6 / 1e9)  # the fit's slope beyond
    assert measured_message_s(CollectiveFit(alpha_s=1e-4, beta_bytes_per_s=1e9), 1e6) == pytest.approx(1.1e-3)


def test_sync_probe_interpolates_in_compute_time():
    from ddlscope.calibrate.model import sync_at

    probe = SyncProbe(block_alone_s=[0.002, 0.008], compute_stretch=[1.0, 1.6], sync_overhead_s=[1e-3, 4e-3])
    assert sync_at(probe, 0.001) == pytest.approx((1.0, 1e-3))
    assert sync_at(probe, 0.005) == pytest.approx((1.3, 2.5e-3))
    assert sync_at(probe, 0.1) == pytest.approx((1.6, 4e-3))
    assert sync_at(None, 0.005) == (1.0, 0.0)  # an older profile, without the probe


def test_probes_enter_the_prediction():
    probed = {**PROFILE,
              "sync": {"ws2": {"block_alone_s": [0.002, 0.008], "compute_stretch": [1.5, 1.5],
                               "sync_overhead_s": [2e-3, 2e-3]}},
              "fsdp": {"ws2": {"unit_bytes": [1e3, 1e5], "unit_overhead_s": [1e-3, 1.099e-3]}}}
    base = predict_local(_config("ddp"), {}, FACTS, PROFILE)
    ddp = predict_local(_config("ddp"), {}, FACTS, probed)
    assert ddp["breakdown_s"]["forward_s"] == pytest.approx(1.5 * base["breakdown_s"]["forward_s"])
    assert ddp["sync_overhead_s"] == pytest.approx(2e-3)
    with_ddp_probe = {**probed, "ddp": {"ws2": {"model_bytes": [0.0, 1e5], "overhead_s": [1e-3, 2e-3]}}}
    ddp_probed = predict_local(_config("ddp"), {}, FACTS, with_ddp_probe)
    assert ddp_probed["breakdown_s"]["comm_wait_s"] == pytest.approx(1e-3 + 1e-8 * FACTS["param_bytes"])
    assert ddp_probed["sync_overhead_s"] == 0.0
    assert predict_local(_config("ps-sync", servers=1), {}, FACTS, probed)["sync_overhead_s"] == pytest.approx(2e-3)
    fsdp = predict_local(_config("fsdp"), {}, FACTS, probed)
    units = [u for u in FACTS["fsdp_units"] if u > 0]
    expected = sum(1e-3 + 1e-9 * (u - 1e3) for u in units)  # on the line through the two probes
    assert fsdp["breakdown_s"]["comm_wait_s"] == pytest.approx(expected)  # the probe's steps include the wait
    # an emulated link slower than the machine sets each unit's floor
    slow = {"network": {"emulated": True, "alpha_s": 1e-3, "bandwidth_bytes_per_s": 1e6}}
    assert predict_local(_config("fsdp"), slow, FACTS, probed)["step_s"] > fsdp["step_s"] + 4 * 1e-3
    # the optimizer steps DTensor shards at the fsdp probe's per-tensor cost, scaled to the run's optimizer
    sharded = {**probed, "fsdp": {"ws2": {**probed["fsdp"]["ws2"], "optimizer_tensor_s": 1e-4}}}
    extra_s = predict_local(_config("fsdp"), {}, FACTS, sharded)["breakdown_s"]["optimizer_s"] - \
        fsdp["breakdown_s"]["optimizer_s"]
    plain_tensor_s = PROFILE["compute"].get("optimizer_tensor_s", 2 * PROFILE["compute"]["op_overhead_s"])
    ops = OPS_PER_PARAM_OPTIMIZER[optimizer_kind(FACTS)] / 2
    assert extra_s == pytest.approx(len(FACTS["param_numel"]) * (1e-4 - plain_tensor_s) * ops * 1.5)  # x stretch
    assert predict_local(_config("ddp"), {}, FACTS, sharded)["breakdown_s"]["optimizer_s"] == \
        ddp["breakdown_s"]["optimizer_s"]  # DDP's parameters are plain tensors
    # every parameter-server worker blocks on its server each step, async too
    assert predict_local(_config("ps-async", servers=1), {}, FACTS, probed)["sync_overhead_s"] == pytest.approx(2e-3)


def test_server_update_passes_follow_the_server_loop():
    from ddlscope.predict.estimators.ps import server_apply_passes
    from ddlscope.specs.strategies.ps import PSAsyncSpec, PSSyncSpec

    assert server_apply_passes(PSAsyncSpec(), 2, "sgd") == 2 + 3
    assert server_apply_passes(PSSyncSpec(), 2, "sgd-momentum") == 4 + 4 + 3 + 2 + 5
    assert server_apply_passes(PSSyncSpec(), 4, "sgd") > server_apply_passes(PSSyncSpec(), 2, "sgd")


def test_linear_interpolation_extends_the_end_segments():
    from ddlscope.calibrate.model import interpolate_linear

    xs, ys = [1.0, 2.0, 4.0], [1.0, 3.0, 4.0]
    assert interpolate_linear(xs, ys, 1.5) == pytest.approx(2.0)
    assert interpolate_linear(xs, ys, 3.0) == pytest.approx(3.5)
    assert interpolate_linear(xs, ys, 8.0) == pytest.approx(6.0)  # the last slope
    assert interpolate_linear(xs, ys, -10.0) == 0.0  # never negative


def test_parameter_server_round_from_the_transport_probe():
    from ddlscope.calibrate.model import ps_round_s

    probed = {**PROFILE, "ps": {"ws2": {"workers": 1, "bytes": [1e4, 1e6], "round_s": [1e-4, 1e-3]},
                                "ws4": {"workers": 3, "bytes": [1e4, 1e6], "round_s": [3e-4, 5e-3]}}}
    assert ps_round_s(typed(probed), 1, 1e6, None) == pytest.approx(1e-3)
    assert ps_round_s(typed(probed), 2, 1e6, None) == pytest.approx(3e-3)  # between 1 and 3 workers
    assert ps_round_s(typed(probed), 4, 1e6, None) == pytest.approx(7e-3)  # the last slope beyond
    assert ps_round_s(typed(probed), 2, 1e6, (1e-3, 1e7)) == pytest.approx(4 * (1e-3 + 0.1))  # the link is slower
    # without a probe: every message in turn from the two-rank table
    assert ps_round_s(typed(PROFILE), 2, 1e6, None) == pytest.approx(4 * (2e-4 + 1e6 / 1e9))
    sync = predict_local(_config("ps-sync", 2, servers=1), {}, FACTS, probed)
    plain = predict_local(_config("ps-sync", 2, servers=1), {}, FACTS, PROFILE)
    assert sync["breakdown_s"]["comm_wait_s"] != plain["breakdown_s"]["comm_wait_s"]


def test_parameter_server_round_and_stretch_with_compute_between_rounds():
    from ddlscope.calibrate.model import ps_compute_stretch, ps_round_s

    probe = {"workers": 2, "bytes": [1e4, 1e6], "round_s": [1e-4, 1e-3], "block_alone_s": [2e-3, 8e-3],
             "busy_round_s": [[2e-4, 2e-3], [4e-4, 4e-3]], "busy_block_s": [2.2e-3, 8.4e-3]}
    probed = {**PROFILE, "ps": {"ws3": probe}}
    assert ps_round_s(typed(probed), 2, 1e6, None) == pytest.approx(1e-3)  # no compute given: back to back
    assert ps_round_s(typed(probed), 2, 1e6, None, 1e-3) == pytest.approx(1.5e-3)  # halfway to the first block
    assert ps_round_s(typed(probed), 2, 1e6, None, 5e-3) == pytest.approx(3e-3)  # between the two blocks
    assert ps_round_s(typed(probed), 2, 1e6, None, 0.1) == pytest.approx(4e-3)  # held beyond the longer block
    assert ps_compute_stretch(typed(probed), 2, 2e-3) == pytest.approx(1.1)
    assert ps_compute_stretch(typed(probed), 2, 0.1) == pytest.approx(1.05)
    assert ps_compute_stretch(typed(PROFILE), 2, 2e-3) is None  # an older profile: the synchronisation probe's
    # With the probe, a PS worker's wait for the others is inside its rounds: no separate sync overhead.
    assert predict_local(_config("ps-sync", 2, servers=1), {}, FACTS, probed)["sync_overhead_s"] == 0.0


def test_block_cyclic_async_exchanges_one_block_a_step():
    probe = {"workers": 2, "bytes": [1e4, 1e6], "round_s": [1e-4, 1e-3]}
    single = {"workers": 1, "bytes": [1e4, 1e6], "round_s": [5e-5, 4e-4]}
    probed = {**PROFILE, "ps": {"ws2": single, "ws3": probe}}
    facts = {**FACTS, "param_bytes": 2e6}
    plain = predict_local(_config("ps-async", 4, servers=2), {}, facts, probed)
    cyclic = predict_local(_config("ps-async", 4, servers=2, block_cyclic=True), {}, facts, probed)
    assert cyclic["breakdown_s"]["comm_wait_s"] < plain["breakdown_s"]["comm_wait_s"]  # 2 of 4 workers per server
    assert any("block-cyclic" in n for n in cyclic["notes"])
    assert cyclic["breakdown_s"]["forward_s"] == plain["breakdown_s"]["forward_s"]
    # block_cyclic is a ps-async knob: the predictor refuses it elsewhere, as `ddlscope run` does
    with pytest.raises(ConfigError, match="strategy.block_cyclic = True: unknown field"):
        predict_local(_config("ps-sync", 4, servers=2, block_cyclic=True), {}, facts, probed)


def test_server_rounds_share_the_cores_they_run_on():
    from ddlscope.calibrate.model import concurrent_rounds_slowdown, ps_round_s

    # one server's round with 2 workers keeps 3 cores busy (2 on a 2-core machine)
    assert concurrent_rounds_slowdown(1, 2, 2) == 1.0
    assert concurrent_rounds_slowdown(2, 2, 2) == 2.0  # two servers' rounds take turns
    assert concurrent_rounds_slowdown(2, 1, 2) == 2.0  # block-cyclic: one worker each, still 2 cores each
    assert concurrent_rounds_slowdown(2, 2, 8) == 1.0  # cores to spare: side by side
    assert concurrent_rounds_slowdown(4, 2, 8) == pytest.approx(1.5)
    # the stretch is CPU work: an emulated link's waiting is not stretched
    probed = {**PROFILE, "ps": {"ws3": {"workers": 2, "bytes": [1e4, 1e6], "round_s": [1e-4, 1e-3]}}}
    assert ps_round_s(typed(probed), 2, 1e6, None, cpu_slowdown=2.0) == pytest.approx(2e-3)
    assert ps_round_s(typed(probed), 2, 1e6, (1e-3, 1e7), cpu_slowdown=2.0) == pytest.approx(4 * (1e-3 + 0.1))
    # two servers on 2 cores: each round carries half the bytes, but they take turns for the cores
    two_cores = {**probed, "meta": {"cores": 2}}
    facts = {**FACTS, "param_bytes": 2e6}
    two = predict_local(_config("ps-sync", 2, servers=2), {}, facts, two_cores)
    many_cores = predict_local(_config("ps-sync", 2, servers=2), {}, facts, {**probed, "meta": {"cores": 16}})
    assert two["breakdown_s"]["comm_wait_s"] > many_cores["breakdown_s"]["comm_wait_s"]
    assert any("2 server rounds at once share 2 cores (x2.00 each)" in n for n in two["notes"])


def test_the_ddp_probe_adds_its_cost_and_the_ranks_still_take_turns():
    # 4 ranks on 2 cores: the DDP probe's cost at the model's size (its whole synchronised steps hold
    # the turn-taking of the probe's own tiny compute only), plus this step's turn-taking for a core.
    two_cores = {**PROFILE, "meta": {"cores": 2}}
    probed = {**two_cores, "ddp": {"ws4": {"model_bytes": [0.0, 1e5], "overhead_s": [1e-3, 2e-3]}}}
    ddp = predict_local(_config("ddp", 4), {}, FACTS, probed)
    roomy = predict_local(_config("ddp", 4), {}, FACTS, {**probed, "meta": {"cores": 4}})
    probe_s = 1e-3 + 1e-8 * FACTS["param_bytes"]
    assert roomy["breakdown_s"]["comm_wait_s"] == pytest.approx(probe_s)
    assert ddp["breakdown_s"]["comm_wait_s"] > probe_s
    assert any("waits its turn" in n for n in ddp["notes"])
    assert not any("waits its turn" in n for n in roomy["notes"])


def test_an_incomplete_or_ill_typed_calibration_is_one_line():
    partial = {**PROFILE, "compute": {k: v for k, v in PROFILE["compute"].items() if k != "op_overhead_s"}}
    with pytest.raises(ConfigError, match=r"^the calibration has no op_overhead_s: rerun `ddlscope calibrate`$"):
        predict_local(_config("ddp"), {}, FACTS, partial)
    wrong = {**PROFILE, "meta": {"cores": "two"}}
    with pytest.raises(ConfigError, match=r"^the calibration: meta.cores: "):
        predict_local(_config("ddp"), {}, FACTS, wrong)


KERNELS = {"data_s": 0.5e-3, "forward_s": 4e-3, "backward_s": 12e-3, "steps": 9, "threads": 1}


def test_timed_kernels_price_compute_and_split_it_as_timed():
    """Kernel times replace the FLOP model's compute, keep their forward:backward ratio (1:3 here, not the
    FLOPs' 1:2), and price the batch read; the rest of the step (stretch, optimizer) is unchanged."""
    flops = predict_local(_config("ddp"), {}, FACTS, PROFILE)
    timed = predict_local(_config("ddp"), {}, {**FACTS, "kernels": KERNELS}, PROFILE)
    stretch = timed["compute_stretch"]
    assert stretch == flops["compute_stretch"] == pytest.approx(1.0)
    b = timed["breakdown_s"]
    assert b["forward_s"] == pytest.approx(4e-3 * stretch) and b["backward_s"] == pytest.approx(12e-3 * stretch)
    assert b["data_s"] == pytest.approx(0.5e-3 * stretch) and flops["breakdown_s"]["data_s"] == 0.0
    assert b["optimizer_s"] == pytest.approx(flops["breakdown_s"]["optimizer_s"])
    assert flops["breakdown_s"]["backward_s"] == pytest.approx(2 * flops["breakdown_s"]["forward_s"])
    assert any("timed on this machine" in note for note in timed["notes"])
    # the optimizer as timed too, where the rank steps the whole model's plain tensors (not FSDP's shards)
    with_step = {**FACTS, "kernels": {**KERNELS, "optimizer_s": 3e-3}}
    assert predict_local(_config("ddp"), {}, with_step, PROFILE)["breakdown_s"]["optimizer_s"] == pytest.approx(
        3e-3 * stretch)
    fsdp = predict_local(_config("fsdp"), {}, FACTS, PROFILE)["breakdown_s"]["optimizer_s"]
    assert predict_local(_config("fsdp"), {}, with_step, PROFILE)["breakdown_s"]["optimizer_s"] == pytest.approx(fsdp)


def test_ranks_beyond_the_cores_wait_their_turn_under_every_strategy():
    """4 computing ranks on 2 cores: each step lasts at least twice the CPU work, DDP and FSDP included
    (their probes hold the turn-taking of their own small compute only)."""
    facts = {**FACTS, "kernels": KERNELS}
    # pipeline and partitioned ranks each compute a quarter of the model: they wait for a core for that
    # quarter's work (counting the whole model's made a 4-rank GPT pipeline wait 263 ms where it waited 98)
    for strategy in ("ddp", "fsdp", "localsgd", "pipeline", "partitioned"):
        roomy = predict_local(_config(strategy, 4), {}, facts, {**PROFILE, "meta": {"cores": 4}})
        tight = predict_local(_config(strategy, 4), {}, facts, {**PROFILE, "meta": {"cores": 2}})
        b = tight["breakdown_s"]
        busy_s = b["data_s"] + b["forward_s"] + b["backward_s"] + b["optimizer_s"]
        added_s = tight["breakdown_s"]["comm_wait_s"] - roomy["breakdown_s"]["comm_wait_s"]
        assert added_s == pytest.approx(busy_s * (2 / tight["compute_stretch"] - 1)), strategy
        assert tight["step_s"] >= 2 * busy_s / tight["compute_stretch"] - 1e-12


def test_workload_facts_time_the_workloads_own_kernels():
    from ddlscope.calibrate import workload_facts
    from ddlscope.calibrate.facts import KERNEL_MAX_ROUND_STEPS, KERNEL_PAUSE_EVERY, KERNEL_PAUSES_S, KERNEL_ROUNDS

    config = {"workload": {"name": "mlp-digits", "hidden": 256, "layers": 2, "batch_size": 128},
              "strategy": {"name": "ddp"}, "cluster": {"world_size": 2}}
    plain = workload_facts(config)
    timed = workload_facts(config, time_kernels=True)
    assert "kernels" not in plain and {k: v for k, v in timed.items() if k != "kernels"} == plain
    kernels = timed["kernels"]
    assert all(0 < kernels[k] < 1 for k in ("data_s", "forward_s", "backward_s", "optimizer_s"))
    # a step of a few ms (more on a loaded machine), so each round's blocks take many steps
    assert sum(kernels[k] for k in ("data_s", "forward_s", "backward_s", "optimizer_s")) < 20e-3, kernels
    # alone, every KERNEL_PAUSE_EVERY-th step of a round's block follows a pause and is timed apart
    per_round = {n - n // KERNEL_PAUSE_EVERY for n in range(3, KERNEL_MAX_ROUND_STEPS + 1)}
    assert kernels["steps"] % KERNEL_ROUNDS == 0 and kernels["steps"] // KERNEL_ROUNDS in per_round, kernels
    assert kernels["steps"] >= KERNEL_ROUNDS * 10 and kernels["threads"] == 1
    compute_s = kernels["forward_s"] + kernels["backward_s"]
    assert set(kernels["pause_extra_s"]) == {str(p) for p in KERNEL_PAUSES_S}
    assert all(-compute_s < extra < compute_s for extra in kernels["pause_extra_s"].values()), kernels
    # timed in two launched ranks, side by side too: a stretch near 1 (2 ranks on 2 or more cores; a
    # hiccup moves a median little) and a wait for the slower rank below a step's compute
    together = kernels["together"]
    print(kernels)  # shown when it fails: the numbers behind a miss on a noisy machine
    assert together["processes"] == 2 and 0.5 < together["stretch"] < 3, together
    assert 0 <= together["slowest_wait_s"] < kernels["forward_s"] + kernels["backward_s"], together


def test_a_rounds_blocks_last_the_same_time_whatever_the_steps_length():
    """Enough steps that a block lasts KERNEL_ROUND_S (0.5 s): 100 steps of 5 ms, 25 of 20 ms; never fewer
    than the fixed count's share (3 of a 200 ms step), never more than the cap (100 of a 0.1 ms step)."""
    from ddlscope.calibrate.facts import steps_for

    assert [steps_for(s) for s in (5e-3, 20e-3, 0.2, 1e-4, 0.0)] == [100, 25, 3, 100, 100]
    assert steps_for(0.03) == 17  # rounded up: 16.7 steps would time 0.5 s


def test_the_side_by_side_stretch_is_taken_round_by_round_so_drift_is_not_contention():
    """The machine slows from 80 to 120 ms a step between rounds (seen: 82 -> 101 ms in 40 s); side by side
    costs 10% in every round. The stretch is 1.10, not the drift between an alone block and a side-by-side
    one; the slower rank's wait comes from the spread about each round's median, not from the drift."""
    from ddlscope.calibrate.facts import side_by_side_rounds

    def timed(compute_s: float, samples: list[float]) -> dict:
        return {"data_s": 1e-4, "forward_s": compute_s / 3, "backward_s": 2 * compute_s / 3, "optimizer_s": 1e-3,
                "steps": len(samples), "threads": 1, "strategy_backward": False, "compute_samples_s": samples}

    speeds_s = (0.080, 0.100, 0.120)
    rank = [(timed(a, [a] * 3), timed(1.1 * a, [1.1 * a - 1e-3, 1.1 * a, 1.1 * a + 1e-3])) for a in speeds_s]
    kernels = side_by_side_rounds([rank, rank], processes=2)
    together = kernels["together"]
    assert together["stretch"] == pytest.approx(1.1) and together["round_stretches"] == pytest.approx([1.1] * 3)
    assert kernels["forward_s"] + kernels["backward_s"] == pytest.approx(0.100)  # the middle round's
    assert kernels["steps"] == 9 and "compute_samples_s" not in kernels
    # MAD of the side-by-side steps about their round's median: 1 ms, x 1.4826 x E[max of 2 normals] 0.564
    assert together["slowest_wait_s"] == pytest.approx(1e-3 * 1.4826 * 0.5642, rel=1e-3)
    lone = side_by_side_rounds([[(timed(0.09, [0.09] * 9),) * 2]], processes=1)
    assert "together" not in lone and lone["steps"] == 9


def test_a_measured_row_says_how_much_of_its_compute_wall_was_its_own_cpu():
    """Forward + backward wall over the ranks' thread CPU in them, over the ranks that computed (a server's
    rank has no compute): what tells a row disturbed by other work on the cores from a miss."""
    from ddlscope.predict.local import measured_from_summary

    by_rank = {"0": {"forward_s": 0.010, "backward_s": 0.020, "compute_cpu_s": 0.025},
               "1": {"forward_s": 0.012, "backward_s": 0.018, "compute_cpu_s": 0.015},
               "2": {"forward_s": 0.0, "backward_s": 0.0, "compute_cpu_s": 0.0}}  # a parameter server
    measured = measured_from_summary({"mean_step_s": 0.05, "breakdown_mean_s_by_rank": by_rank})
    assert measured["compute_wall_over_cpu"] == pytest.approx(0.060 / 0.040)
    assert measured_from_summary({"mean_step_s": 0.05})["compute_wall_over_cpu"] is None  # an older summary


def test_kernels_that_cannot_be_timed_leave_the_flop_model_and_a_note(monkeypatch):
    """Ranks that do not start (or die) while timing the kernels: predict-run prices compute from FLOPs
    and says why, rather than failing with a launcher's traceback."""
    from ddlscope.calibrate import facts as facts_module

    def refuse(config: dict) -> dict:
        raise RuntimeError("rendezvous timed out\nsecond line of a long torch error")

    monkeypatch.setattr(facts_module, "rank_kernel_times", refuse)
    config = {"workload": {"name": "mlp-digits", "hidden": 32, "layers": 1, "batch_size": 16},
              "strategy": {"name": "ddp"}, "cluster": {"world_size": 2}}
    facts = facts_module.workload_facts(config, time_kernels=True)
    assert "kernels" not in facts and facts["kernels_error"] == "rendezvous timed out"
    notes = predict_local(_config("ddp"), {}, {**FACTS, "kernels_error": facts["kernels_error"]}, PROFILE)["notes"]
    assert any("could not be timed in ranks (rendezvous timed out)" in n for n in notes), notes

    from torch.distributed.elastic.multiprocessing.api import SignalException

    def interrupted(config: dict) -> dict:
        raise SignalException("Process 1 got signal: 2", sigval=signal.SIGINT)

    monkeypatch.setattr(facts_module, "rank_kernel_times", interrupted)
    with pytest.raises(SignalException):  # Ctrl-C stops predict-run; it is not a reason to fall back
        facts_module.workload_facts(config, time_kernels=True)


def test_a_cluster_sized_run_is_timed_in_one_rank_not_played_out_here(monkeypatch):
    """A stored 1,024-rank run (from a cluster) must not start 1,024 local ranks to time its kernels."""
    from ddlscope.calibrate import facts as facts_module

    monkeypatch.setattr(facts_module.os, "cpu_count", lambda: 2)

    def config(world: int) -> dict:
        return {"cluster": {"world_size": world}}

    assert [facts_module.contention_processes(config(w)) for w in (1, 2, 4, 8, 9, 1024)] == [1, 2, 4, 8, 1, 1]


def test_the_slowest_of_n_lies_where_normal_order_statistics_put_it():
    from ddlscope.calibrate.facts import expected_max_of_normals

    assert expected_max_of_normals(1) == pytest.approx(0, abs=1e-6)
    assert expected_max_of_normals(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-4)  # 0.5642
    assert expected_max_of_normals(4) == pytest.approx(1.02938, rel=1e-4)  # tabulated (e.g. Harter 1961)


def test_a_lone_rank_computes_as_its_kernels_did_alone():
    """One process runs beside no other rank: no side-by-side stretch, whatever the calibration's
    smallest world size measured (the sync probe starts at 2 ranks)."""
    stretched = {**PROFILE, "sync": {"ws2": {"block_alone_s": [0.002, 0.008], "compute_stretch": [1.5, 1.5],
                                             "sync_overhead_s": [2e-3, 2e-3]}}}
    lone = predict_local(_config("single", 1), {}, {**FACTS, "kernels": KERNELS}, stretched)
    assert lone["compute_stretch"] == 1.0
    b = lone["breakdown_s"]
    assert b["forward_s"] + b["backward_s"] == pytest.approx(KERNELS["forward_s"] + KERNELS["backward_s"])
    pair = predict_local(_config("ddp", 2), {}, {**FACTS, "kernels": KERNELS}, stretched)
    assert pair["compute_stretch"] == pytest.approx(1.5)  # two ranks do stretch


def test_kernels_timed_side_by_side_set_the_stretch_and_a_synchronous_steps_wait():
    """Where the facts have the workload's kernels timed side by side with as many ranks as the run
    has, their stretch replaces the synchronisation probe's, and a synchronous step (ddp) waits for its
    slowest rank as their spread says; local SGD, which does not meet every step, waits for none."""
    wait_s = 1.5e-3

    def facts(world: int, stretch: float) -> dict:
        return {**FACTS, "kernels": {**KERNELS, "together": {"processes": world, "stretch": stretch,
                                                           "slowest_wait_s": wait_s}}}

    one, two = (predict_local(_config("ddp"), {}, facts(2, s), PROFILE) for s in (1.0, 2.0))
    assert one["compute_stretch"] == 1.0 and two["compute_stretch"] == 2.0
    assert (two["breakdown_s"]["forward_s"] + two["breakdown_s"]["backward_s"]) == pytest.approx(
        2 * (KERNELS["forward_s"] + KERNELS["backward_s"]))
    plain = predict_local(_config("ddp"), {}, {**FACTS, "kernels": KERNELS}, PROFILE)
    assert one["breakdown_s"]["comm_wait_s"] - plain["breakdown_s"]["comm_wait_s"] == pytest.approx(wait_s)
    local = predict_local(_config("localsgd"), {}, facts(2, 1.0), PROFILE)
    local_plain = predict_local(_config("localsgd"), {}, {**FACTS, "kernels": KERNELS}, PROFILE)
    assert local["breakdown_s"]["comm_wait_s"] <= local_plain["breakdown_s"]["comm_wait_s"]
    # timed with 2 ranks side by side: a 4-rank run takes the synchronisation probe's stretch instead
    assert predict_local(_config("ddp", 4), {}, facts(2, 2.0), PROFILE)["compute_stretch"] == \
        predict_local(_config("ddp", 4), {}, {**FACTS, "kernels": KERNELS}, PROFILE)["compute_stretch"]


def test_a_private_step_times_its_own_per_sample_backward():
    """Private gossip replaces loss.backward() with per-sample gradients (clipped, noised): predict-run
    times that pass as the backward, and the estimator then adds no FLOP-ratio factor on top; without
    timed kernels the factor prices it."""
    from ddlscope.calibrate import facts_key, workload_facts
    from ddlscope.predict.estimators.gossip import PRIVATE_COMPUTE_FACTOR

    def config(strategy: dict) -> dict:
        return {"workload": {"name": "mlp-digits", "hidden": 256, "layers": 2, "batch_size": 128},
                "strategy": strategy, "cluster": {"world_size": 2}}

    private = config({"name": "gossip", "dp_noise_multiplier": 1.0})
    # runs share timed kernels by workload and per-rank batch, apart from a strategy that times its own
    assert facts_key(config({"name": "gossip"})) == facts_key(config({"name": "ddp"})) != facts_key(private)
    plain = workload_facts(config({"name": "gossip"}), time_kernels=True)["kernels"]
    timed = workload_facts(private, time_kernels=True)["kernels"]
    assert timed["strategy_backward"] and not plain["strategy_backward"]
    # each sample's gradient written, read for its norm and read again for the clipped sum: a pass over
    # 64 gradients' worth of bytes, several times the batched backward's
    assert timed["backward_s"] > 3 * plain["backward_s"]
    gossip = _config("gossip", 2, dp_noise_multiplier=1.0)
    with_kernels = predict_local(gossip, {}, {**FACTS, "kernels": {**KERNELS, "strategy_backward": True}}, PROFILE)
    without = predict_local(gossip, {}, {**FACTS, "kernels": {**KERNELS, "strategy_backward": False}}, PROFILE)
    b_with, b_without = with_kernels["breakdown_s"], without["breakdown_s"]
    assert b_without["backward_s"] + b_without["forward_s"] == pytest.approx(
        PRIVATE_COMPUTE_FACTOR * (b_with["backward_s"] + b_with["forward_s"]))


def test_a_partitioned_rank_steps_its_share_of_the_tensors_and_bytes_once():
    """A rank holding 1/p of the model steps 1/p of its tensors and bytes: the same optimizer time as DDP's
    whole model over p, at the same stretch (the bytes were once divided by p twice: a stage's bytes, then
    its share of the compute)."""
    ddp = predict_local(_config("ddp"), {}, FACTS, PROFILE)
    part = predict_local(_config("partitioned"), {}, FACTS, PROFILE)
    per_stretch = [p["breakdown_s"]["optimizer_s"] / p["compute_stretch"] for p in (ddp, part)]
    assert per_stretch[1] == pytest.approx(per_stretch[0] / 2, rel=1e-9)
    passes_s = (3 + 0) * FACTS["param_bytes"] / PROFILE["compute"]["memory_bandwidth_bytes_per_s"]  # SGD: no state
    assert per_stretch[0] == pytest.approx(len(FACTS["param_numel"]) * 3e-6 + passes_s, rel=1e-9)


def test_kernels_time_some_steps_after_a_pause_apart_from_the_others(monkeypatch):
    """Every KERNEL_PAUSE_EVERY-th step follows a sleep, the pauses in turn, and its forward + backward
    is not in the phases' means: on a clock where a step after a pause computes 1 ms longer, the means
    are the plain steps' and pause_extra_s is 1 ms at each pause."""
    import ddlscope.calibrate.facts as facts
    from ddlscope.calibrate.facts import pause_before

    assert [pause_before(i, (0.002, 0.016)) for i in range(9)] == [0, 0, 0, 0.002, 0, 0, 0, 0.016, 0]
    assert pause_before(3, ()) == 0
    clock = {"t": 0.0, "slept": False}

    class Model:
        def to(self, device):
            return self

        def train(self):
            return self

        def __call__(self, x):  # forward: 2 ms, 3 ms after a pause
            clock["t"] += 3e-3 if clock["slept"] else 2e-3
            clock["slept"] = False
            return x

    class Loss:
        def backward(self):
            clock["t"] += 4e-3

    class Split:
        def get(self, ids):
            return ids, ids

        def __len__(self):
            return 10

    class Task:
        model, train = Model(), Split()
        loss_fn = staticmethod(lambda out, y: Loss())

    def sleep(seconds):
        clock["t"] += seconds
        clock["slept"] = True

    monkeypatch.setattr(facts.copy, "deepcopy", lambda model: model)
    monkeypatch.setattr(facts.time, "perf_counter", lambda: clock["t"])
    monkeypatch.setattr(facts.time, "sleep", sleep)
    monkeypatch.setattr("ddlscope.runtime.loop.make_optimizer", lambda model, workload: type(
        "Opt", (), {"step": lambda self: None, "zero_grad": lambda self, set_to_none: None})())
    timed = facts.kernel_times(Task(), None, 4, 1, timed_steps=16, warmup_steps=1, pauses_s=(0.002, 0.016))
    assert timed["steps"] == 12 and timed["forward_s"] == pytest.approx(2e-3) and timed["backward_s"] == pytest.approx(4e-3)
    assert timed["pause_extra_s"] == {"0.002": pytest.approx(1e-3), "0.016": pytest.approx(1e-3)}


def test_ranks_that_take_turns_for_cores_wait_for_no_slowest_rank_beyond_the_stretch():
    """4 ranks on 2 cores: the side-by-side spread is the scheduler interleaving them, which the stretch
    holds; the step adds no wait for the slowest rank. 2 ranks on 2 cores (each its own core) do."""
    wait_s = 1.5e-3
    two_cores = {**PROFILE, "meta": {**PROFILE["meta"], "cores": 2}}

    def predicted(world: int, together: bool) -> dict:
        kernels = {**KERNELS, **({"together": {"processes": world, "stretch": 2.0, "slowest_wait_s": wait_s}}
                                 if together else {})}
        return predict_local(_config("ddp", world), {}, {**FACTS, "kernels": kernels}, two_cores)

    pair, pair_plain = predicted(2, True), predicted(2, False)
    assert pair["sync_overhead_s"] == pytest.approx(wait_s)
    four = predicted(4, True)
    assert four["oversubscription"] == 2.0 and four["sync_overhead_s"] == 0.0


def test_an_emulated_link_hides_the_ddp_probes_own_all_reduce():
    """Under an emulated link DDP pays, per bucket, the larger of the link's time and gloo's, plus the
    smallest probed model's cost less its own all-reduce (hidden under the link's wait)."""
    from ddlscope.calibrate.model import collective_fit, measured_message_s
    from ddlscope.predict.estimators import LocalStep, estimator_for
    from ddlscope.predict.local import local_case, strategy_of

    with_probe = {**PROFILE, "ddp": {"ws2": {"model_bytes": [4352.0, 1e6], "overhead_s": [5e-3, 9e-3]}}}
    profile = typed(with_probe)
    probe = profile.ddp["ws2"]
    link = {"network": {"emulated": True, "alpha_s": 5e-3, "bandwidth_bytes_per_s": 1e6}}
    predicted = predict_local(_config("ddp"), link, FACTS, with_probe)
    case = local_case(_config("ddp"), link, FACTS, with_probe)
    hidden_s = measured_message_s(collective_fit(profile, "all_reduce", 2), probe.model_bytes[0])
    expected_s = max(probe.overhead_s[0] - hidden_s, 0.0) + message_s(profile, "all_reduce", FACTS["param_bytes"], 2,
                                                                       case.link)
    assert hidden_s > 0 and probe.overhead_s[0] > hidden_s
    comm = estimator_for(strategy_of(_config("ddp"))).local_comm(
        strategy_of(_config("ddp")), case, LocalStep(1.0, 0.0, 0.0, 0.0))
    assert comm.comm_s == pytest.approx(expected_s)
    assert predicted["breakdown_s"]["comm_wait_s"] >= expected_s
