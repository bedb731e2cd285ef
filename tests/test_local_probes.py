"""The local predictor's terms for what issue 38 found unpriced or priced where the run pays nothing:
exact arithmetic on a synthetic calibration (no timing here; benchmarks/predict_local.py measures)."""

from __future__ import annotations

import pytest

from conftest import SRC
from test_predict_local import FACTS, PROFILE, _config

from ddlscope.predict.local import predict_local


def _comm_s(strategy: str, steps: int | None, world: int = 2, **knobs) -> float:
    config = _config(strategy, world, **knobs)
    if steps is not None:
        config["workload"]["steps"] = steps
    return predict_local(config, {}, FACTS, PROFILE)["breakdown_s"]["comm_wait_s"]


@pytest.mark.parametrize("strategy", ["diloco", "localsgd"])
def test_model_averages_are_counted_in_the_measured_steps(strategy):
    """The mean step leaves step 0 out, and the schedule averages after steps 0, P, 2P...: a run of 12
    steps at period 20 waits for no average in its mean; one of 31 steps for one in 30 steps; a run of
    unknown length one per period."""
    period = 20
    none_s = _comm_s(strategy, 12, period=period)
    one_in_30_s = _comm_s(strategy, 31, period=period)
    per_period_s = _comm_s(strategy, None, period=period)
    per_average_s = (per_period_s - none_s) * period
    assert per_average_s > 0
    assert one_in_30_s - none_s == pytest.approx(per_average_s / 30)
    # two averages (after steps 20 and 40) in the 40 measured steps of a 41-step run: one per period
    assert _comm_s(strategy, 41, period=period) == pytest.approx(per_period_s)


def _benchmark():
    import importlib.util

    spec = importlib.util.spec_from_file_location("predict_local_bench", SRC.parent / "benchmarks" / "predict_local.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_has_a_row_for_every_strategy_and_selects_by_strategy():
    from argparse import Namespace

    from ddlscope.specs import STRATEGY_SPECS

    bench = _benchmark()
    flags = dict(only=None, all=True, cnn=False, servers=False, only_servers=False, dataparallel=False,
                 only_dataparallel=False, modelparallel=False, only_modelparallel=False)
    every = bench.selected_configs(Namespace(**flags))
    assert {strategy for strategy, _, _ in every} == set(STRATEGY_SPECS.names())
    schedules = {extra.get("strategy.schedule") for strategy, _, extra in every if strategy == "pipeline"}
    assert schedules == {"gpipe", "1f1b", "interleaved", "zero-bubble"}
    assert any(extra.get("strategy.recompute") for _, _, extra in every)
    only = bench.selected_configs(Namespace(**{**flags, "all": False, "only": ["tp", "diloco"]}))
    assert sorted({s for s, _, _ in only}) == ["diloco", "tp"]


def test_benchmark_judges_a_row_against_its_repeats_spread():
    bench = _benchmark()
    row = {"predicted": {"step_s": 0.0105}, "measured_step_s_repeats": [0.010, 0.011, 0.012],
           "error": {"step_s_error": -0.045}, "strategy": "ddp"}
    assert bench.spread_ms(row) == pytest.approx((10.0, 12.0))
    assert bench.within_noise(row) is True
    assert bench.within_noise({**row, "predicted": {"step_s": 0.0099}}) is False
    assert bench.within_noise({**row, "measured_step_s_repeats": [0.010]}) is None
    other = {**row, "strategy": "tp", "error": {"step_s_error": 0.30}}
    assert bench.per_strategy([row, other, {**other, "error": {"step_s_error": -0.1}}]) == {
        "ddp": [0.045], "tp": [0.30, 0.1]}


def test_benchmark_row_is_the_repeat_with_the_median_error_each_against_its_own_timing():
    """Each repeat is predicted from the kernels timed before it; the row is the repeat whose error is the
    median, not the one whose measured step is (the machine was slow for the 13 ms run and its timing)."""
    bench = _benchmark()

    def repeat(measured_s: float, predicted_s: float) -> dict:
        return {"measured": {"step_s": measured_s}, "predicted": {"step_s": predicted_s},
                "error": {"step_s_error": predicted_s / measured_s - 1}}

    repeats = [repeat(0.010, 0.0080), repeat(0.013, 0.0130), repeat(0.011, 0.0121)]
    # errors -20%, 0%, +10%: the median error is the 13 ms run's, not the median run's (11 ms, +10%)
    assert bench.median_repeat(repeats) is repeats[1]
    assert bench.median_repeat([repeats[0], repeats[2]]) is repeats[2]  # an even count: the upper one


def test_benchmark_runs_each_configuration_long_enough_to_average_the_machines_noise(monkeypatch):
    """Steps enough that the timed steps last --min-run-s at the predicted step, plus step 0 (the warm-up,
    not in the mean): 2 s of a 15 ms step is 134 steps; never fewer than --steps, never more than the cap."""
    from argparse import Namespace

    import ddlscope.predict.local as local
    from ddlscope.runtime.config import load_experiment

    bench = _benchmark()
    exp = load_experiment(None, {"strategy.name": "ddp", "cluster.world_size": 2, "workload.steps": 12})
    predicted_s = {"step": 0.015}
    monkeypatch.setattr(local, "predict_local", lambda config, environment, facts, profile: {
        "step_s": predicted_s["step"]})
    args = Namespace(steps=12, min_run_s=2.0)
    assert bench.run_steps(exp, {}, {}, args) == 135
    predicted_s["step"] = 0.5  # 4 steps would last 2 s: --steps stands
    assert bench.run_steps(exp, {}, {}, args) == 12
    predicted_s["step"] = 1e-5
    assert bench.run_steps(exp, {}, {}, args) == bench.MAX_RUN_STEPS


TP_PROBE = {"ws2": {"dispatch_op_s": 2e-5, "block_dispatch_ops": 64, "block_all_reduces": 4,
                    "all_reduce_activation_ratio": 1.0}}
GPT_SIZES = {"layers": 4, "hidden": 128, "seq_len": 64, "batch_size": 16}


def _tp(profile: dict, **workload) -> dict:
    config = _config("tp", 2)
    config["workload"].update(workload)
    return predict_local(config, {}, {**FACTS, "fsdp_units": [100, 100, 100, 100, 10]}, profile)


def test_tp_prices_the_traced_all_reduces_and_dtensor_dispatch():
    """Per block: the probe's all-reduces of batch x seq x hidden fp32 elements from the gloo table, and
    its DTensor op count x per-op cost; a calibration without [tp]: Megatron's 4 all-reduces, no dispatch;
    a workload without those sizes: nothing priced, and said."""
    from ddlscope.calibrate.model import message_s
    from ddlscope.calibrate.profile import CalibrationProfile

    bare = _tp(PROFILE)["step_s"]
    older = _tp(PROFILE, **GPT_SIZES)
    probed = _tp({**PROFILE, "tp": TP_PROBE}, **GPT_SIZES)
    all_reduce_s = message_s(CalibrationProfile.coerce(PROFILE), "all_reduce", 16 * 64 * 128 * 4, 2, None)
    assert older["step_s"] - bare == pytest.approx(4 * 4 * all_reduce_s)
    assert probed["step_s"] - older["step_s"] == pytest.approx(4 * 64 * 2e-5)  # stretch 1 on 8 cores
    assert any("no [tp] probe" in n for n in older["notes"]) and not any("no [tp]" in n for n in probed["notes"])
    assert any("not priced" in n for n in _tp(PROFILE)["notes"])
    halved = _tp({**PROFILE, "tp": {"ws2": {**TP_PROBE["ws2"], "all_reduce_activation_ratio": 0.5}}}, **GPT_SIZES)
    half_s = message_s(CalibrationProfile.coerce(PROFILE), "all_reduce", 16 * 64 * 128 * 2, 2, None)
    assert probed["step_s"] - halved["step_s"] == pytest.approx(4 * 4 * (all_reduce_s - half_s))


def test_tp_reads_dtensors_per_op_cost_at_the_runs_block_size():
    """The probe's two block sizes: the per-op cost at the run's batch x seq x hidden, linear in the logarithm
    of the elements between them (and beyond: 4x the large block's elements, one log-step of 2 up), never under
    the small block's; a calibration from before the two sizes keeps its one figure."""
    from ddlscope.calibrate.profile import CalibrationProfile
    from ddlscope.predict.estimators.tp import dispatch_op_at_s

    two = {**TP_PROBE["ws2"], "dispatch_op_s": 1e-4, "dispatch_op_s_by_size": [1e-4, 3e-4],
           "activation_elements": [512.0, 32768.0]}
    probe = CalibrationProfile.coerce({**PROFILE, "tp": {"ws2": two}}).tp["ws2"]
    assert dispatch_op_at_s(probe, 4096.0) == pytest.approx(2e-4)  # halfway in log: sqrt(512 x 32768)
    assert dispatch_op_at_s(probe, 32768.0 * 8) == pytest.approx(3e-4 + 2e-4 / 2)  # log 8 is half of log 64
    assert dispatch_op_at_s(probe, 100.0) == pytest.approx(1e-4)
    older = CalibrationProfile.coerce({**PROFILE, "tp": TP_PROBE}).tp["ws2"]
    assert dispatch_op_at_s(older, 1e6) == pytest.approx(2e-5)
    # the run's block: 16 x 64 x 128 elements, 4 blocks of 64 ops
    at_run = _tp({**PROFILE, "tp": {"ws2": two}}, **GPT_SIZES)["step_s"] - _tp({**PROFILE, "tp": TP_PROBE},
                                                                                 **GPT_SIZES)["step_s"]
    assert at_run == pytest.approx(4 * 64 * (dispatch_op_at_s(probe, 16 * 64 * 128) - 2e-5))


def _pipeline(schedule: str = "gpipe", profile: dict = PROFILE, sizes: bool = True, **knobs) -> dict:
    config = _config("pipeline", 2, schedule=schedule, micro_batches=4, **knobs)
    if sizes:
        config["workload"].update(GPT_SIZES)
    return predict_local(config, {}, {**FACTS, "fsdp_units": [100, 100, 100, 100, 10]}, profile)


def test_pipeline_plays_the_schedule_with_the_sends_between_stages():
    """GPipe, 2 stages, 4 micro-batches of forward F and backward B: makespan (m + p - 1)(F + B) + 2 sends (the
    fill's last activation, the drain's first gradient), so the busiest rank idles (F + B) + 2 x one p2p
    message of batch / m x seq x hidden fp32; without the workload's sizes the sends are not priced."""
    from ddlscope.calibrate.model import message_s
    from ddlscope.calibrate.profile import CalibrationProfile

    send_s = message_s(CalibrationProfile.coerce(PROFILE), "p2p", 16 / 4 * 64 * 128 * 4, 2, None)
    priced = _pipeline()["breakdown_s"]
    unpriced = _pipeline(sizes=False)["breakdown_s"]
    per_micro_batch_s = (priced["forward_s"] + priced["backward_s"]) / 4
    assert unpriced["comm_wait_s"] == pytest.approx(per_micro_batch_s)  # (p - 1) / m of the compute
    assert priced["comm_wait_s"] == pytest.approx(per_micro_batch_s + 2 * send_s)
    # 1F1B's steady state waits for each gradient's send: more than GPipe's two
    assert _pipeline("1f1b")["breakdown_s"]["comm_wait_s"] > priced["comm_wait_s"] + send_s


def test_pipeline_recompute_runs_the_busiest_ranks_recomputed_stage_forwards_again():
    plain_run = _pipeline("1f1b")
    plain = plain_run["breakdown_s"]
    # a rank's half of the model's kernels, forward 1/3 of it: without the per-op overhead each of the
    # 4 micro-batches replays beyond the whole batch's (3 x ops x op_s at the stretch, over 2 ranks)
    replay_s = 3 * FACTS["ops"] * PROFILE["compute"]["op_overhead_s"] * plain_run["compute_stretch"] / 2
    compute_s = plain["forward_s"] + plain["backward_s"] - replay_s

    def extra_s(schedule: str, recompute: list[int], **knobs) -> float:
        b = _pipeline(schedule, recompute=recompute, **knobs)["breakdown_s"]
        return b["forward_s"] + b["backward_s"] - replay_s - compute_s

    assert extra_s("1f1b", [0]) == pytest.approx(compute_s / 3)
    assert extra_s("1f1b", [0, 1]) == pytest.approx(compute_s / 3)  # one stage on each rank
    # interleaved, 2 chunks: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3, each a quarter of the model
    assert extra_s("interleaved", [0, 1], chunks=2) == pytest.approx(compute_s / 6)
    assert extra_s("interleaved", [0, 2], chunks=2) == pytest.approx(compute_s / 3)


def test_fsdp_prices_the_unit_tensors_beyond_the_probes_two():
    """FACTS: 4 tensors in 2 units (the root has none), i.e. none beyond 2 a unit; with 10 tensors, 6 beyond,
    each at the probe's unit_tensor_s; a calibration without the figure prices none."""
    fsdp_probe = {"ws2": {"unit_bytes": [1000, 100000], "unit_overhead_s": [1e-4, 2e-4], "unit_tensor_s": 5e-5}}
    many = {**FACTS, "param_numel": FACTS["param_numel"] + [8] * 6, "param_dim0": FACTS["param_dim0"] + [8] * 6}

    def comm_s(facts: dict, probe: dict) -> float:
        return predict_local(_config("fsdp", 2), {}, facts, {**PROFILE, "fsdp": probe})["breakdown_s"]["comm_wait_s"]

    without = {"ws2": {k: v for k, v in fsdp_probe["ws2"].items() if k != "unit_tensor_s"}}
    assert comm_s(FACTS, fsdp_probe) == pytest.approx(comm_s(FACTS, without))
    assert comm_s(many, fsdp_probe) - comm_s(many, without) == pytest.approx(6 * 5e-5)


def test_omnivore_leaders_reach_the_servers_apart():
    """Two groups of two: the leaders' ps-async exchange without the equal workers' queue (one service of
    the round's two, half of it), the group's all-reduce and broadcast blocking; a group of one (ps-async)
    keeps the queue. The ps-async term with staggered=False is the same formula, one queue more."""
    from dataclasses import replace

    from ddlscope.calibrate.model import message_s
    from ddlscope.calibrate.profile import CalibrationProfile
    from ddlscope.predict.estimators.base import LocalStep
    from ddlscope.predict.estimators.ps import PSAsyncEstimator
    from ddlscope.predict.local import local_case
    from ddlscope.specs.strategies.ps import PSAsyncSpec

    config = _config("omnivore", 4, groups=2)
    omnivore = predict_local(config, {}, FACTS, PROFILE)
    case = local_case(config, {}, FACTS, PROFILE)
    b = omnivore["breakdown_s"]
    step = LocalStep(1.0, b["forward_s"], b["backward_s"], len(FACTS["param_numel"]) * 2e-6)
    profile = CalibrationProfile.coerce(PROFILE)
    group_s = (message_s(profile, "all_reduce", case.param_bytes, 2, None)
               + message_s(profile, "broadcast", case.param_bytes, 2, None) + 4 * case.param_bytes / 1e10)
    leaders = replace(case, world=2)
    staggered = PSAsyncEstimator().local_comm(PSAsyncSpec(), leaders, step, group_s, staggered=True).comm_s
    together = PSAsyncEstimator().local_comm(PSAsyncSpec(), leaders, step, group_s).comm_s
    assert together > staggered  # the queue behind the other leader
    sync_s = omnivore["sync_overhead_s"]
    turn_s = b["comm_wait_s"] - staggered - group_s - sync_s
    assert turn_s == pytest.approx(0.0, abs=1e-12)  # 4 ranks on 8 cores: no turn-taking


@pytest.mark.parametrize("strategy, models", [("fedavg", 1), ("mc-psgd", 2)])
def test_a_federated_round_computes_reads_and_steps_each_of_its_minibatches(strategy, models):
    """A run step is a round: local_steps minibatches for each model trained (mc-psgd trains two); with
    local_epochs (the data's size unknown) one, as before, and said."""
    kernels = {"forward_s": 0.002, "backward_s": 0.004, "optimizer_s": 0.001, "data_s": 0.0005, "steps": 9}
    facts = {**FACTS, "kernels": kernels}

    def breakdown(**knobs) -> dict:
        return predict_local(_config(strategy, 2, **knobs), {}, facts, PROFILE)

    from ddlscope.predict.estimators.federated import round_copies
    from ddlscope.predict.local import strategy_of

    one, four = breakdown()["breakdown_s"], breakdown(local_steps=4)["breakdown_s"]
    assert four["optimizer_s"] == pytest.approx(4 * models * one["optimizer_s"])
    assert four["data_s"] == pytest.approx(4 * one["data_s"])  # the round's samples, read once for every model
    # the round's model copies come once a round (test_predict_misc_local.py)
    copies_s = round_copies(strategy_of(_config(strategy)))[0] * FACTS["param_bytes"] / \
        PROFILE["compute"]["memory_bandwidth_bytes_per_s"]
    computed_s = [b["forward_s"] + b["backward_s"] - copies_s for b in (one, four)]
    assert computed_s[1] == pytest.approx(4 * models * computed_s[0])
    assert any("prices as one" in n for n in breakdown()["notes"])
