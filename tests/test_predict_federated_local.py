"""The federated rounds' and synchronous gossip's wait for the slower rank, on this machine (pure arithmetic on
a stored run's facts: no processes)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_predict_local import FACTS, PROFILE, _config

from ddlscope.predict.local import local_case, predict_local, strategy_of


def _facts(slowest_wait_s: float) -> dict:
    """Facts whose kernels were timed alone and side by side in 2 ranks, the side-by-side steps spread so
    that the mean rank waits `slowest_wait_s` for the slower one."""
    kernels = {"forward_s": 0.002, "backward_s": 0.004, "optimizer_s": 0.001, "data_s": 0.0005, "steps": 9,
               "together": {"processes": 2, "stretch": 1.0, "slowest_wait_s": slowest_wait_s}}
    return {**FACTS, "kernels": kernels}


def _comm_wait_s(config: dict, slowest_wait_s: float, profile: dict = PROFILE) -> float:
    return predict_local(config, {}, _facts(slowest_wait_s), profile)["breakdown_s"]["comm_wait_s"]


@pytest.mark.parametrize("strategy, minibatches", [("fedavg", 4), ("mm-psgd", 4), ("mc-psgd", 8)])
def test_a_round_waits_for_the_slower_client_once_per_minibatch(strategy, minibatches):
    """A slower rank stays slower for the whole round: the per-minibatch wait adds up over the round's
    minibatches (mc-psgd trains two models on 4 local steps: 8), not by their square root."""
    config = _config(strategy, 2, local_steps=4)
    extra_s = _comm_wait_s(config, 0.002) - _comm_wait_s(config, 0.0)
    assert extra_s == pytest.approx(minibatches * 0.002)


def test_a_round_of_local_epochs_waits_as_one_minibatch():
    """With local_epochs the round's minibatches are unknown here and priced as one: one minibatch's wait."""
    from ddlscope.predict.estimators.federated import round_spread_wait_s

    config = _config("fedavg", 2)
    case = local_case(config, {}, _facts(0.002), PROFILE)
    assert round_spread_wait_s(strategy_of(config), case) == 0.0
    assert _comm_wait_s(config, 0.002) - _comm_wait_s(config, 0.0) == pytest.approx(0.002)


def test_synchronous_gossip_waits_for_the_slower_neighbour():
    """Sync gossip meets its neighbours every step: the kernels' side-by-side spread is waited; async gossip
    meets nobody and waits for nothing of it."""
    sync, asynchronous = _config("gossip", 2), _config("gossip", 2, mode="async")
    assert _comm_wait_s(sync, 0.01) - _comm_wait_s(sync, 0.0) == pytest.approx(0.01)
    assert _comm_wait_s(asynchronous, 0.01) == pytest.approx(_comm_wait_s(asynchronous, 0.0))


def test_gossip_meeting_wait_is_at_least_the_calibrated_one():
    """The larger of the calibrated meeting wait (the sync probe's) and the kernels' spread, not their sum."""
    from ddlscope.predict.estimators.gossip import meeting_wait_s

    probed = {**PROFILE, "sync": {"ws2": {"block_alone_s": [0.001, 0.01], "compute_stretch": [1.0, 1.0],
                                          "sync_overhead_s": [0.003, 0.003]}}}
    case = local_case(_config("gossip", 2), {}, _facts(0.001), probed)
    assert meeting_wait_s(case) == pytest.approx(0.003)
    assert meeting_wait_s(replace(case, kernel_slowest_wait_s=0.02)) == pytest.approx(0.02)
