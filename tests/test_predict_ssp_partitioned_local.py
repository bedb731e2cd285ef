"""The local predictor's partitioned step (issue 38 part 1): a part's backward skips its input's gradient, and
the chain's first forward runs alone. Exact arithmetic on a synthetic calibration (no timing here;
benchmarks/predict_local.py measures)."""

from __future__ import annotations

import pytest

from test_predict_local import FACTS, PROFILE, _config

from ddlscope.predict.estimators.partitioned import LOCAL_LOSS_OPS, LOCAL_LOSS_PASSES, chain_step_s, part_times
from ddlscope.predict.local import local_case, predict_local, strategy_of

# mlp-digits as the benchmark trains it: 64 -> 512 -> 512 -> 512 -> 10; two parts cut before the third Linear
MLP = {"name": "mlp-digits", "optimizer": "sgd", "hidden": 512, "layers": 3}
KERNELS = {"forward_s": 3e-3, "backward_s": 6e-3, "data_s": 1e-4, "optimizer_s": 5e-4, "steps": 9, "threads": 1}
STRETCH = 1.25


def _partitioned(world: int = 2, workload: dict | None = None, stretch: float | None = STRETCH):
    config = _config("partitioned", world)
    config["workload"] = dict(workload or MLP)
    kernels = dict(KERNELS)
    if stretch is not None:
        kernels["together"] = {"processes": world, "stretch": stretch, "slowest_wait_s": 0.0}
    facts = {**FACTS, "per_rank_batch": 256, "kernels": kernels}
    return config, facts


def test_a_part_skips_its_inputs_gradient():
    """Per sample, the Linears' forward FLOPs are 2 x 64 x 512, 2 x 512 x 512 (twice), 2 x 512 x 10. The whole
    model's backward is 2 x forward less the first Linear's input gradient; part 1's (the third and fourth
    Linears) also skips the third's, most of its FLOPs: the parts' backwards sum to 0.76 of the whole's. Part 0
    also pays its own loss over its 256 x 512 outputs (after the send: with its backward); the last part's loss
    is the task's, in the kernels already."""
    config, facts = _partitioned()
    case = local_case(config, {}, facts, PROFILE)
    parts = part_times(strategy_of(config), case)
    first, third, last = 2 * 64 * 512, 2 * 512 * 512, 2 * 512 * 10
    forward = first + 2 * third + last
    backward = 2 * forward - first
    assert [f for f, _ in parts] == pytest.approx([3e-3 * (first + third) / forward, 3e-3 * (third + last) / forward])
    loss_s = local_loss_s(case, 256 * 512)
    assert [b for _, b in parts] == pytest.approx([6e-3 * (2 * (first + third) - first) / backward + loss_s,
                                                   6e-3 * (2 * (third + last) - third) / backward])
    assert (sum(b for _, b in parts) - loss_s) / 6e-3 == pytest.approx(0.7598, abs=1e-4)


def local_loss_s(case, elements: float) -> float:
    """A part's own loss over `elements` outputs: the passes at the calibrated bandwidth, each op's overhead."""
    return LOCAL_LOSS_PASSES * 4 * elements / case.memory_bandwidth_bytes_per_s + LOCAL_LOSS_OPS * case.op_s


def test_the_chain_step_runs_the_first_forward_alone():
    """Two parts: the step ends with part 0's backward (begun after its own forward, alone) or part 1's
    (after both forwards), whichever is later; only what runs beside another rank stretches."""
    assert chain_step_s([(2.0, 5.0), (1.0, 1.0)], 1.5) == pytest.approx(2.0 + 5.0 * 1.5)
    assert chain_step_s([(2.0, 1.0), (1.0, 3.0)], 1.5) == pytest.approx(2.0 + (1.0 + 3.0) * 1.5)


def test_equal_parts_wait_parts_minus_one_forwards():
    """Where the layers' sizes are unknown the parts are equal shares of the kernels; at no stretch and a
    backward of two forwards the mean rank waits (parts - 1) part forwards, the chain's old pricing."""
    config, facts = _partitioned(3, {"name": "cnn-digits", "optimizer": "sgd"}, stretch=1.0)
    facts["kernels"] = {**facts["kernels"], "forward_s": 3e-3, "backward_s": 6e-3}
    case = local_case(config, {}, facts, PROFILE)
    assert [t for part in part_times(strategy_of(config), case) for t in part] == pytest.approx([1e-3, 2e-3] * 3)
    base = predict_local(config, {}, facts, PROFILE)
    chain_wait_s = base["breakdown_s"]["comm_wait_s"] - base["sync_overhead_s"]
    assert chain_wait_s == pytest.approx(2 * 1e-3)


def test_partitioned_step_is_the_chain():
    """The mean rank computes its part's share at the side-by-side stretch; forward + backward + the chain's
    wait (the comm_wait beyond the ranks' meeting) is the chain's step."""
    config, facts = _partitioned()
    parts = part_times(strategy_of(config), local_case(config, {}, facts, PROFILE))
    predicted = predict_local(config, {}, facts, PROFILE)
    b = predicted["breakdown_s"]
    mean_compute_s = sum(f + bw for f, bw in parts) / 2 * STRETCH
    assert b["forward_s"] + b["backward_s"] == pytest.approx(mean_compute_s)
    chain_wait_s = b["comm_wait_s"] - predicted["sync_overhead_s"]
    assert chain_wait_s == pytest.approx(chain_step_s(parts, STRETCH) - mean_compute_s)
