"""omnivore in-process: its groups, the tuner's arithmetic and choice on synthetic probes, its estimator."""

from __future__ import annotations

import math

import pytest

from ddlscope.analysis.omnivore_tuner import Probe, candidates, choose, table_rows
from ddlscope.specs.strategies.omnivore import OmnivoreSpec, compensated_momentum, group_members


def test_groups_are_contiguous_and_only_leaders_push():
    assert group_members(4, 2) == [[0, 1], [2, 3]]
    assert group_members(6, 3) == [[0, 1], [2, 3], [4, 5]]
    assert OmnivoreSpec(groups=2).pushers(4) == [0, 2]
    assert OmnivoreSpec(groups=1).pushers(4) == [0]
    assert OmnivoreSpec(groups=4).pushers(4) == [0, 1, 2, 3]
    # the server scales each push by 1 / (pushes a round) = 1 / groups
    assert OmnivoreSpec(groups=2).pushes_per_round(len(OmnivoreSpec(groups=2).pushers(4))) == 2


def test_momentum_is_lowered_by_the_implicit_momentum_of_the_groups():
    assert [compensated_momentum(0.9, k) for k in (1, 2, 4)] == [0.9, 0.4, 0.15]
    assert compensated_momentum(0.5, 4) == 0.0  # never below zero
    assert candidates(4, 0.9) == [(1, 0.9), (2, 0.4), (2, 0.9), (4, 0.15), (4, 0.9)]
    assert candidates(4, 0.9, keep_momentum=False) == [(1, 0.9), (2, 0.4), (4, 0.15)]
    assert candidates(6, 0.9, groups=[3], keep_momentum=False) == [(3, round(0.9 - 2 / 3, 4))]


def _probe(groups: int, momentum: float, step_s: float, drop_per_step: float, steps: int = 11,
           batch: int = 100) -> Probe:
    return Probe(groups, momentum, step_s, batch, tuple(2.0 - drop_per_step * s for s in range(steps)))


def test_a_probe_measures_both_efficiencies_and_predicts_time_to_target():
    p = _probe(1, 0.9, step_s=0.01, drop_per_step=0.1)
    assert p.time_per_sample_s == pytest.approx(1e-4)
    assert p.loss_drop_per_sample == pytest.approx(1e-3)  # 0.1 a step of 100 samples
    assert p.predicted_time_to_s(2.0, 1.5) == pytest.approx(0.05)  # 500 samples x 0.1 ms
    assert p.predicted_time_to_s(2.0, 2.5) == 0.0  # already there
    flat = _probe(2, 0.4, step_s=0.001, drop_per_step=0.0)
    assert flat.predicted_time_to_s(2.0, 1.5) == math.inf


def test_noise_around_a_line_keeps_its_slope():
    wiggle = tuple(2.0 - 0.1 * s + (0.05 if s % 2 else -0.05) for s in range(20))
    assert Probe(1, 0.9, 0.01, 100, wiggle).loss_drop_per_sample == pytest.approx(1e-3, rel=0.05)


def test_the_choice_weighs_hardware_against_statistical_efficiency():
    sync = _probe(1, 0.9, step_s=0.010, drop_per_step=0.10)      # 0.1 ms a sample, 1e-3 a sample: 0.10 s/unit
    groups2 = _probe(2, 0.4, step_s=0.006, drop_per_step=0.08)   # 0.06 ms, 8e-4: 0.075 s/unit  <- best
    groups2_hot = _probe(2, 0.9, step_s=0.006, drop_per_step=0.02)  # as fast, learns a quarter as much
    choice = choose([sync, groups2, groups2_hot], target_loss=1.0)
    assert choice.best is groups2
    assert choice.start_loss == 2.0 and choice.target_loss == 1.0
    assert choice.predicted_s[(2, 0.4)] == pytest.approx(1.0 / 8e-4 * 6e-5)  # 75 ms
    assert choice.predicted_s[(1, 0.9)] == pytest.approx(0.1)
    assert choice.predicted_s[(2, 0.9)] == pytest.approx(0.3)
    assert "groups=2, momentum=0.4" in choice.reason and "the next, groups=1, momentum=0.9" in choice.reason
    assert "faster per sample and learns less per sample" in choice.reason
    # The fastest hardware loses when it learns too little: without the lowered momentum, sync wins.
    assert choose([sync, groups2_hot], target_loss=1.0).best is sync
    rows = table_rows(choice, [sync, groups2, groups2_hot])
    assert [r["chosen"] for r in rows] == ["", "<-", ""]
    assert rows[1]["implicit"] == "0.50" and rows[1]["us/sample"] == "60" and rows[1]["predicted s"] == "0.075"


def test_the_default_target_is_halfway_to_the_lowest_loss_reached():
    a, b = _probe(1, 0.9, 0.01, 0.1), _probe(2, 0.4, 0.01, 0.05)  # lowest: 2.0 - 1.0 = 1.0
    choice = choose([a, b])
    assert choice.start_loss == 2.0 and choice.target_loss == pytest.approx(1.5)
    assert choice.best is a


def test_no_probe_that_learns_says_so():
    choice = choose([_probe(1, 0.9, 0.01, 0.0), _probe(2, 0.4, 0.01, -0.01)], target_loss=1.5)
    assert "no probe lowered the loss" in choice.reason


# ---------------------------------------------------------------------------- estimator
def _case(slowdowns=None, params=1e8, flops_per_sample=6e9):
    from ddlscope.predict.catalogue import parse_cluster
    from ddlscope.predict.estimators import ClusterCase
    from ddlscope.predict.strategies import ServerSpec, Workload

    workload = Workload(name="w", params=params, flops_per_sample=flops_per_sample, batch_per_worker=8,
                        activation_bytes_per_sample=1e7, layers=12)
    return ClusterCase(workload=workload, cluster=parse_cluster("a100-80gb:2x8"), stragglers=1.0,
                       slowdowns=slowdowns, server=ServerSpec(), activation_bytes=8e7, weight_bytes_per_param=4.0,
                       optimizer_bytes_per_param=8.0)


def _estimate(spec, case):
    from ddlscope.predict.estimators import estimator_for

    return estimator_for(spec).cluster(spec, case)


def test_one_worker_per_group_is_priced_as_ps_async():
    from ddlscope.specs.strategies.ps import PSAsyncSpec

    # server-bound (the servers cap the update rate) and compute-bound (each worker's cycle sets it)
    for slowdowns, params, flops in ((None, 1e8, 6e9), ([1.0] * 15 + [3.0], 1e8, 6e9), (None, 1e6, 6e11),
                                     ([1.0] * 15 + [3.0], 1e6, 6e11)):
        case = _case(slowdowns, params, flops)
        mine, async_ = _estimate(OmnivoreSpec(groups=16), case), _estimate(PSAsyncSpec(), case)
        assert mine.step_s == pytest.approx(async_.step_s, rel=1e-9)
        assert mine.samples_per_s == pytest.approx(async_.samples_per_s, rel=1e-9)


def test_one_group_pays_the_all_reduce_and_a_slow_group_holds_only_itself():
    from ddlscope.predict import collectives as coll

    case = _case()
    one = _estimate(OmnivoreSpec(groups=1), case)
    grad_bytes = 1e8 * case.workload.grad_bytes_per_param
    all_reduce = float(coll.all_reduce_s(grad_bytes, 16, 8, case.cluster.node))
    assert one.step_s > one.compute_s + all_reduce  # + the leader's exchange and the broadcast
    assert one.mean_staleness_steps == pytest.approx(0.0, abs=1e-9)  # one group: nothing stale
    # compute-bound (not server-bound): a 4x straggler in one group
    straggler = _case([1.0] * 15 + [4.0], params=1e7, flops_per_sample=6e11)
    slow1, slow2 = _estimate(OmnivoreSpec(groups=1), straggler), _estimate(OmnivoreSpec(groups=2), straggler)
    # With two groups the fast group runs at its own pace, up to 4x the slow one's: against both groups at the
    # slow pace, (4 + 1) / 2 = 2.5x the samples a second at most (communication takes a little of it).
    assert 1.5 < slow2.samples_per_s / slow1.samples_per_s < 2.5
    assert slow2.mean_staleness_steps > 0
    # groups that do not divide the cluster's GPUs: the largest divisor below (3 -> 2 on 16 GPUs)
    assert _estimate(OmnivoreSpec(groups=3), case).step_s == pytest.approx(_estimate(OmnivoreSpec(groups=2), case).step_s)


def _local(strategy: dict) -> dict:
    from test_regression_numbers import FACTS, PROFILE

    from ddlscope.predict.local import predict_local

    config = {"workload": {"name": "mlp-digits"}, "strategy": strategy, "cluster": {"world_size": 2}}
    return predict_local(config, {}, FACTS, PROFILE)


def test_locally_one_worker_per_group_is_ps_async_and_one_group_is_ps_sync_plus_the_group_exchange():
    async_, sync = _local({"name": "ps-async"}), _local({"name": "ps-sync"})
    assert _local({"name": "omnivore", "groups": 2})["step_s"] == pytest.approx(async_["step_s"], rel=1e-9)
    one = _local({"name": "omnivore", "groups": 1})
    # Only the leader uses the server's link: ps-sync's round with one client instead of two, plus the group's
    # all-reduce and broadcast, which on loopback cost less than the second client's push and pull.
    assert 0.5 * sync["step_s"] < one["step_s"] < sync["step_s"]
    assert any("inside a group of 2, the gradient all-reduce" in note for note in one["notes"])
