"""The local predictor's pipeline: torch's own action orders played out, zero-bubble's split backward,
and the per-op overhead each micro-batch replays (predict/estimators/pipeline.py, predict/schedule_sim.py).
Pure arithmetic: no ranks, no torch."""

from __future__ import annotations

import pytest
from test_predict_local import FACTS, PROFILE, _config

from ddlscope.predict.estimators.pipeline import action_seconds
from ddlscope.predict.local import predict_local
from ddlscope.predict.schedule_sim import interleaved_orders, simulate


def _parse(row: str) -> list[tuple[str, int, int]]:
    return [(a[0], int(a[1:].split(".")[0]), int(a.split(".")[1])) for a in row.split()]


# torch 2.13's pipeline_order for 2 ranks, 4 micro-batches, 2 stages per rank, empty slots left out
# (torch.distributed.pipelining._schedule_visualizer.get_schedule_ops, printed once)
TORCH_ORDERS = {
    "interleaved": [
        "F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 B2.2 B2.3 B0.2 B0.3",
        "F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 F1.2 B1.0 F1.3 B1.1 F3.2 B3.2 F3.3 B3.3 B1.2 B1.3"],
    "zero-bubble": [
        "F0.0 F0.1 F2.0 F2.1 I2.0 W2.0 F0.2 I2.1 W2.1 F0.3 I0.0 W0.0 F2.2 I0.1 W0.1 F2.3 I2.2 W2.2 I2.3 W2.3 "
        "I0.2 W0.2 I0.3 W0.3",
        "F1.0 F1.1 F3.0 I3.0 F3.1 I3.1 W3.0 F1.2 I1.0 W3.1 F1.3 I1.1 W1.0 F3.2 I3.2 W1.1 F3.3 I3.3 W3.2 I1.2 "
        "W3.3 I1.3 W1.2 W1.3"],
}


@pytest.mark.parametrize("schedule", ["interleaved", "zero-bubble"])
def test_interleaved_orders_are_torchs(schedule: str):
    assert interleaved_orders(schedule, 2, 4, 2) == [_parse(row) for row in TORCH_ORDERS[schedule]]


def test_zero_bubble_first_stage_runs_its_whole_backward_as_its_weight_pass():
    """torch's first stage has no input gradient to compute: its I does nothing and its W is the whole
    backward; the other stages' I and W each take half."""
    seconds = action_seconds(1.0, 2.0)
    assert (seconds(("I", 0, 0)), seconds(("W", 0, 0))) == (0.0, 2.0)
    assert (seconds(("I", 3, 1)), seconds(("W", 3, 1))) == (1.0, 1.0)
    assert (seconds(("F", 2, 0)), seconds(("B", 2, 0))) == (1.0, 2.0)
    # the runtime's cost per action comes on top of every kind, an empty I too
    with_runtime = action_seconds(1.0, 2.0, 0.25)
    for action in (("F", 1, 0), ("B", 1, 0), ("I", 0, 0), ("W", 0, 0), ("I", 3, 1), ("W", 3, 1)):
        assert with_runtime(action) == seconds(action) + 0.25, action
    # zero-bubble's graph walks: on the input pass of a stage that has an input gradient, not on W, not on stage 0
    split = action_seconds(1.0, 2.0, 0.25, 0.5)
    assert (split(("I", 3, 1)), split(("W", 3, 1)), split(("I", 0, 0)), split(("W", 0, 0))) == (1.75, 1.25, 0.25, 2.25)


def test_each_micro_batch_replays_the_ranks_ops():
    """The kernels timed on the whole batch paid each op's overhead once; m micro-batches pay it m times over
    the rank's 1/p of the ops: (m - 1) x ops x op_s x stretch / p more compute a step."""
    facts = {**FACTS, "kernels": {"data_s": 0.5e-3, "forward_s": 4e-3, "backward_s": 12e-3, "steps": 9,
                                  "threads": 1}}
    one, four = (predict_local(_config("pipeline", 2, schedule="gpipe", micro_batches=m), {}, facts, PROFILE)
                 for m in (1, 4))
    added_s = sum(four["breakdown_s"][k] - one["breakdown_s"][k] for k in ("forward_s", "backward_s"))
    op_s = PROFILE["compute"]["op_overhead_s"]
    assert added_s == pytest.approx(3 * FACTS["ops"] * op_s * four["compute_stretch"] / 2, rel=1e-9)
    assert any("replay" in note for note in four["notes"])


@pytest.mark.parametrize("schedule", ["interleaved", "zero-bubble"])
def test_multi_stage_schedules_wait_as_torchs_order_plays_out(schedule: str):
    """The interleaved schedules' waiting is torch's order played out (not the formula's bubble): each of
    the rank's 2 stages x 4 micro-batches an eighth of its forward and backward; the busiest rank's idle."""
    facts = {**FACTS, "kernels": {"data_s": 0.0, "forward_s": 4e-3, "backward_s": 8e-3, "steps": 9, "threads": 1}}
    config = _config("pipeline", 2, schedule=schedule, chunks=2, micro_batches=4)
    row = predict_local(config, {}, facts, PROFILE)
    b = row["breakdown_s"]
    timeline = simulate([_parse(r) for r in TORCH_ORDERS[schedule]],
                        action_seconds(b["forward_s"] / 8, b["backward_s"] / 8), 4)
    idle_s = timeline.makespan_s - max(timeline.busy_s)
    assert idle_s > 0
    assert b["comm_wait_s"] - row["sync_overhead_s"] == pytest.approx(idle_s, rel=1e-9)
    # with the runtime's cost per action and zero-bubble's graph walks probed, the step is still the played
    # order: its wait is the makespan beyond the rank's compute as priced (forward + backward)
    split_s = 2e-5 * FACTS["ops"] / 4 if schedule == "zero-bubble" else 0.0
    probed = {**PROFILE, "pipeline": {"ws2": {"action_s": 1e-4, "split_backward_op_s": 2e-5}}}
    row = predict_local(config, {}, facts, probed)
    b = row["breakdown_s"]
    timeline = simulate([_parse(r) for r in TORCH_ORDERS[schedule]],
                        action_seconds(b["forward_s"] / 8, b["backward_s"] / 8, 1e-4, split_s), 4)
    assert b["comm_wait_s"] - row["sync_overhead_s"] == pytest.approx(
        timeline.makespan_s - b["forward_s"] - b["backward_s"], rel=1e-9)


@pytest.mark.parametrize("schedule,chunks", [("gpipe", 1), ("zero-bubble", 2)])
def test_torchs_runtime_costs_each_action_the_probed_time(schedule: str, chunks: int):
    """With calibrate's [pipeline] probe, every action of the order takes action_s more: with no compute to
    speak of, GPipe's step is its 2 (m + p - 1) actions on the critical path at action_s each (the probe's
    own definition); a calibration without the probe prices none, and says so."""
    facts = {**FACTS, "ops": 0, "kernels": {"data_s": 0.0, "forward_s": 1e-9, "backward_s": 2e-9, "steps": 9,
                                            "threads": 1}}
    config = _config("pipeline", 2, schedule=schedule, chunks=chunks, micro_batches=4)
    probed = {**PROFILE, "pipeline": {"ws2": {"action_s": 1e-3}}}
    without, with_probe = (predict_local(config, {}, facts, profile) for profile in (PROFILE, probed))
    added_s = with_probe["breakdown_s"]["comm_wait_s"] - without["breakdown_s"]["comm_wait_s"]
    if schedule == "gpipe":
        assert added_s == pytest.approx(2 * (4 + 2 - 1) * 1e-3, rel=1e-5)
    else:  # 24 actions a rank (F, I, W of 2 stages x 4 micro-batches), rank 1 starting one action late (its
        # first forward waits for stage 0's)
        assert added_s == pytest.approx(25e-3, rel=1e-5)
    assert any("no [pipeline] probe" in note for note in without["notes"])
    assert any("per action (probe)" in note for note in with_probe["notes"])


def test_the_pipeline_probe_reads_one_action_off_a_gpipe_step():
    """calibrate's probe divides a GPipe step of negligible compute by the actions on its critical path: the
    step torch's GPipe order takes at 1 ms an action, played out, gives back 1 ms, at any p and m."""
    from ddlscope.calibrate.probes import pipeline_action_s
    from ddlscope.predict.schedule_sim import single_stage_orders

    for ranks, micro_batches in ((2, 4), (3, 4), (4, 8)):
        step_s = simulate(single_stage_orders("gpipe", ranks, micro_batches), lambda a: 1e-3, ranks).makespan_s
        assert pipeline_action_s(step_s, micro_batches, ranks) == pytest.approx(1e-3, rel=1e-12)


def test_zero_bubbles_input_passes_cost_the_probed_extra_per_op():
    """With calibrate's split_backward_op_s, each input-gradient pass of a stage that has an input gradient
    (all but stage 0) costs that x the stage's ops (1/(p v) of the model's) more: with no compute to speak of,
    rank 1 (stages 1 and 3) runs 8 of them in a row; other schedules pay none."""
    facts = {**FACTS, "kernels": {"data_s": 0.0, "forward_s": 1e-9, "backward_s": 2e-9, "steps": 9, "threads": 1}}
    probed = {**PROFILE, "pipeline": {"ws2": {"split_backward_op_s": 1e-5}}}
    zero_bubble = _config("pipeline", 2, schedule="zero-bubble", chunks=2, micro_batches=4)
    without, with_probe = (predict_local(zero_bubble, {}, facts, profile) for profile in (PROFILE, probed))
    added_s = with_probe["breakdown_s"]["comm_wait_s"] - without["breakdown_s"]["comm_wait_s"]
    assert added_s == pytest.approx(8 * 1e-5 * FACTS["ops"] / 4, rel=1e-6)
    assert any("no split_backward_op_s" in note for note in without["notes"])
    interleaved = _config("pipeline", 2, schedule="interleaved", chunks=2, micro_batches=4)
    assert predict_local(interleaved, {}, facts, probed)["step_s"] == predict_local(interleaved, {}, facts, PROFILE)["step_s"]


def _gpt(config: dict) -> dict:
    """The config on a GPT's sizes (hidden 128, seq 64, vocab 256, 4 blocks): a block's forward is
    24 h^2 + 4 s h = 425984 FLOPs a token, the head's 2 h V = 65536, so the last of 2 stages (2 blocks + head)
    holds 14/27 of the model and the first (embedding + 2 blocks) 13/27."""
    config["workload"].update(name="gpt-synthetic", hidden=128, heads=4, seq_len=64, vocab_size=256, layers=4)
    return config


def test_the_busiest_stage_sets_the_compute_a_gpts_head_makes_the_last_one_busier():
    """A GPT's last stage holds the head (measured 2.0-3.3 ms a step more than the first on a GPT x2 m4): the
    rank's compute is the busiest rank's 14/27 of the model, not 1/2; 4 stages over 2 ranks hold the same
    (rank 1: blocks 1 and 3 + head). Recomputing stage 1 runs its 14/27 of the forward again. A model without
    the sizes keeps equal stages."""
    facts = {**FACTS, "kernels": {"data_s": 0.0, "forward_s": 4e-3, "backward_s": 8e-3, "steps": 9, "threads": 1}}

    def compute_s(config: dict) -> float:
        b = predict_local(config, {}, facts, PROFILE)["breakdown_s"]
        return b["forward_s"] + b["backward_s"]

    equal = compute_s(_config("pipeline", 2, schedule="gpipe", micro_batches=1))
    assert compute_s(_gpt(_config("pipeline", 2, schedule="gpipe", micro_batches=1))) == pytest.approx(
        equal * 28 / 27, rel=1e-9)
    assert compute_s(_gpt(_config("pipeline", 2, schedule="interleaved", chunks=2, micro_batches=1))) == \
        pytest.approx(equal * 28 / 27, rel=1e-9)
    recompute = compute_s(_gpt(_config("pipeline", 2, schedule="1f1b", micro_batches=1, recompute=[1])))
    forward_s = predict_local(_config("pipeline", 2, schedule="gpipe", micro_batches=1), {}, facts,
                              PROFILE)["breakdown_s"]["forward_s"]  # half the model's forward, as timed
    assert recompute - equal * 28 / 27 == pytest.approx(2 * forward_s * 14 / 27, rel=1e-9)


def test_unequal_stages_play_out_at_their_own_sizes():
    """The played order gives each stage its part of the busiest rank's forward and backward: GPipe's first
    stage 13/14 of the last one's; the wait is the step beyond the last stage's compute."""
    facts = {**FACTS, "kernels": {"data_s": 0.0, "forward_s": 4e-3, "backward_s": 8e-3, "steps": 9, "threads": 1}}
    row = predict_local(_gpt(_config("pipeline", 2, schedule="gpipe", micro_batches=4)), {}, facts, PROFILE)
    b = row["breakdown_s"]
    orders = [[("F", s, i) for i in range(4)] + [("B", s, i) for i in range(4)] for s in range(2)]
    part = [13 / 14, 1.0]
    timeline = simulate(orders, lambda a: (b["forward_s"] if a[0] == "F" else b["backward_s"]) / 4 * part[a[1]], 2)
    assert timeline.busy_s[1] == pytest.approx(b["forward_s"] + b["backward_s"], rel=1e-9)
    assert b["comm_wait_s"] - row["sync_overhead_s"] == pytest.approx(
        timeline.makespan_s - timeline.busy_s[1], rel=1e-9)
