"""The local predictor's forward and CoCoD's passes over the model (issue 38 part 1): exact arithmetic on a
synthetic calibration (benchmarks/predict_local.py measures the runs)."""

from __future__ import annotations

import pytest

from test_predict_local import FACTS
from test_predict_misc_local import PROBED, SYNC_S

from ddlscope.calibrate.model import message_s
from ddlscope.predict.estimators import estimator_for
from ddlscope.predict.local import local_case, predict_local, strategy_of

PASS_BYTES_PER_S = 1e7  # a slow memory: a pass over the 19 KB model takes ~1.9 ms, far above rounding
SLOW_MEMORY = {**PROBED, "compute": {**PROBED["compute"], "memory_bandwidth_bytes_per_s": PASS_BYTES_PER_S}}


def _cocod_config(steps: int | None, overlap: bool = True) -> dict:
    return {"workload": {"name": "mlp-digits", "optimizer": "sgd", **({"steps": steps} if steps else {})},
            "cluster": {"world_size": 2}, "strategy": {"name": "cocod", "period": 8, "overlap": overlap}}


def _cocod(steps: int | None, overlap: bool = True) -> tuple[dict, object]:
    """A CoCoD run (period 8) on a fast link, 8 cores: the average always hides, no core is shared."""
    config = _cocod_config(steps, overlap)
    return predict_local(config, {}, FACTS, SLOW_MEMORY), local_case(config, {}, FACTS, SLOW_MEMORY)


def test_cocod_pays_four_passes_to_launch_and_four_to_land_each_average():
    """12 steps, period 8: measured steps 1..11 hold one launch (after step 8) and two landings (at 8 and at
    the last step), 4 passes each (strategies/localsgd.py CoCoD: flatten 2, clone 1, divide 1; flatten 2,
    progress 1, sum 1, load as views 0): 12 passes, where torch's averager would make 2."""
    predicted, _ = _cocod(12)
    pass_s = FACTS["param_bytes"] / PASS_BYTES_PER_S * predicted["compute_stretch"]
    assert predicted["breakdown_s"]["comm_wait_s"] == pytest.approx((12 * pass_s + SYNC_S) / 11)


def test_without_overlap_each_average_lands_where_it_launched():
    """overlap = false: the launch after step 8 lands at once; the one after step 0 landed in step 0 (not
    measured) and nothing is in flight at the last step: 8 passes and one all-reduce in the 11 steps."""
    predicted, case = _cocod(12, overlap=False)
    pass_s = FACTS["param_bytes"] / PASS_BYTES_PER_S * predicted["compute_stretch"]
    all_reduce_s = message_s(case.profile, "all_reduce", FACTS["param_bytes"], 2, None)
    assert predicted["breakdown_s"]["comm_wait_s"] == pytest.approx((all_reduce_s + 8 * pass_s + SYNC_S) / 11)


def test_a_run_of_unknown_length_launches_and_lands_once_a_period():
    config = _cocod_config(None)
    spec, case = strategy_of(config), local_case(config, {}, FACTS, SLOW_MEMORY)
    assert estimator_for(spec).model_passes_per_step(spec, case) == pytest.approx((4 + 4) / 8)


PAUSE_EXTRA = {"0.002": 1e-4, "0.016": 5e-4}  # forward + backward beyond the plain steps', after each pause
KERNELS = {"data_s": 1e-4, "forward_s": 2e-3, "backward_s": 4e-3, "optimizer_s": 5e-4, "steps": 30, "threads": 1}


def _after_wait(config: dict, pause_extra: dict | None) -> tuple[dict, dict]:
    """The prediction with the kernels' pause extras, and without them (the same run otherwise)."""
    kernels = {**KERNELS, **({"pause_extra_s": pause_extra} if pause_extra is not None else {})}
    plain = predict_local(config, {}, {**FACTS, "kernels": KERNELS}, PROBED)
    return predict_local(config, {}, {**FACTS, "kernels": kernels}, PROBED), plain


def test_a_rank_computes_slower_after_each_wait_at_the_waits_length():
    """DDP waits once a step: its forward grows by the kernels' extra after a pause, linear between the
    timed pauses (0 after no wait) at the step's predicted wait, held beyond the longest, times the stretch."""
    from ddlscope.predict.local import pause_extra_s

    facts = {"kernels": {**KERNELS, "pause_extra_s": PAUSE_EXTRA}}
    assert pause_extra_s(facts, 0.001) == pytest.approx(0.5e-4)
    assert pause_extra_s(facts, 0.009) == pytest.approx(1e-4 + 4e-4 / 2)
    assert pause_extra_s(facts, 0.5) == pytest.approx(5e-4)
    assert pause_extra_s({"kernels": {**KERNELS, "pause_extra_s": {"0.002": -1e-4, "0.016": 5e-4}}},
                         0.002) == 0.0
    config = {"workload": {"name": "mlp-digits", "optimizer": "sgd"}, "strategy": {"name": "ddp"},
              "cluster": {"world_size": 2}}
    paused, plain = _after_wait(config, PAUSE_EXTRA)
    wait_s = paused["breakdown_s"]["comm_wait_s"]
    assert wait_s == plain["breakdown_s"]["comm_wait_s"] and wait_s > 0
    extra_s = pause_extra_s(facts, wait_s) * paused["compute_stretch"]
    assert extra_s > 0
    assert paused["breakdown_s"]["forward_s"] - plain["breakdown_s"]["forward_s"] == pytest.approx(extra_s)
    assert paused["step_s"] - plain["step_s"] == pytest.approx(extra_s)
    alone, _ = _after_wait({**config, "cluster": {"world_size": 1}, "strategy": {"name": "single"}}, PAUSE_EXTRA)
    assert not any("after each of its waits" in note for note in alone["notes"])  # a lone rank never waits


def test_local_sgd_pays_it_only_at_its_averages():
    """localsgd (period 8) waits at one step in 8: an eighth of the extra at the wait of one average."""
    from ddlscope.predict.local import pause_extra_s

    config = {"workload": {"name": "mlp-digits", "optimizer": "sgd"}, "strategy": {"name": "localsgd", "period": 8},
              "cluster": {"world_size": 2}}
    paused, plain = _after_wait(config, PAUSE_EXTRA)
    per_average_s = paused["breakdown_s"]["comm_wait_s"] * 8
    extra_s = pause_extra_s({"kernels": {"pause_extra_s": PAUSE_EXTRA}}, per_average_s) / 8 * paused["compute_stretch"]
    assert paused["step_s"] - plain["step_s"] == pytest.approx(extra_s)
