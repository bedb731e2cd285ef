"""The parameter-server family and hpsgd on this machine's loopback: what the local predictor prices beyond the
transport probe's rounds (issue 38): the wake-ups of an exchange on busy cores, the server serving the other
workers beside an asynchronous worker's compute, hpsgd's all-reduce in flight beside the next step's compute.
Pure arithmetic on a hand-made calibration: no ranks are launched."""

from __future__ import annotations

import pytest

from ddlscope.predict.estimators.hpsgd import HPSGDEstimator
from ddlscope.predict.estimators.ps import (
    PSAsyncEstimator, PSSyncEstimator, exchange_parts, exchange_wakeup_s, served_beside_compute_s)
from ddlscope.predict.local import local_case, predict_local, strategy_of
from test_predict_local import PROFILE as LOCAL_PROFILE, _config

MEETING_S = 3e-3  # the synchronisation probe's wait at a meeting of the run's processes
# test_predict_local's calibration on this machine's 2 cores, with a 3-process table (two workers and a server)
PROFILE = {
    **LOCAL_PROFILE,
    "meta": {"cores": 2},
    "collectives": {**LOCAL_PROFILE["collectives"], "ws3": LOCAL_PROFILE["collectives"]["ws2"]},
    "sync": {f"ws{n}": {"block_alone_s": [0.002, 0.008], "compute_stretch": [1.0, 1.0],
                        "sync_overhead_s": [MEETING_S, MEETING_S]} for n in (2, 3)},
    # one server and two workers: rounds back to back and with compute between them, flat in the compute
    "ps": {"ws3": {"workers": 2, "bytes": [1e4, 1e6], "round_s": [1e-4, 2e-3], "block_alone_s": [2e-3, 8e-3],
                   "busy_round_s": [[2e-4, 4e-3], [2e-4, 4e-3]], "busy_block_s": [2e-3, 8e-3]}},
}
FACTS = {"flops": 10**9, "ops": 100, "param_numel": [250_000], "param_dim0": [500], "param_bytes": 1e6,
         "optimizer": "sgd", "momentum": 0.0, "per_rank_batch": 32,
         "kernels": {"data_s": 0.0, "forward_s": 2e-3, "backward_s": 4e-3, "optimizer_s": 1e-4, "steps": 5}}
CUSTOM = {"network": {"emulated": True, "alpha_s": 1e-3, "bandwidth_bytes_per_s": 1e7}}


def _case(strategy: str, world: int = 2, environment: dict | None = None, profile: dict = PROFILE, **extra):
    config = _config(strategy, world, **extra)
    return strategy_of(config), local_case(config, environment or {}, FACTS, profile)


def test_an_exchange_on_loopback_waits_for_the_meeting_an_emulated_link_hides_it():
    _, case = _case("ps-async")
    assert exchange_wakeup_s(case, 4e-3, 4e-3) == pytest.approx(MEETING_S)  # the real network: all of it
    assert exchange_wakeup_s(case, 4e-3, 0.2) == 0.0  # a link's 200 ms sleep holds the transfer and its wake-ups
    assert exchange_wakeup_s(case, 4e-3, 5e-3) == pytest.approx(MEETING_S - 1e-3)  # only what outlasts the link
    # in the step: sync and async alike pay one meeting an exchange over the probe's round
    for strategy in ("ps-async", "ps-sync"):
        with_wait = predict_local(_config(strategy), {}, FACTS, PROFILE)
        none = {**PROFILE, "sync": {ws: {**p, "sync_overhead_s": [0.0, 0.0]} for ws, p in PROFILE["sync"].items()}}
        without = predict_local(_config(strategy), {}, FACTS, none)
        assert with_wait["breakdown_s"]["comm_wait_s"] - without["breakdown_s"]["comm_wait_s"] == pytest.approx(MEETING_S)
        assert any("gloo threads to wake" in n for n in with_wait["notes"])
        assert with_wait["sync_overhead_s"] == 0.0  # not counted again as the step's synchronisation


def test_async_workers_lose_compute_to_the_server_serving_the_others():
    spec, case = _case("ps-async")
    x = exchange_parts(spec, case)
    service_s = x.measured_round_s / 2 + x.apply_s  # the probe's round (2 workers) per client + the update
    assert x.measured_round_s == pytest.approx(4e-3)
    # 2 workers, 1 server, 2 cores: beside the other's exchange 3 threads share the 2 cores: 1/3 of it lost
    assert served_beside_compute_s(case, x, 0.1) == pytest.approx(service_s / 3)
    assert served_beside_compute_s(case, x, 1e-3) == pytest.approx(1e-3 / 3)  # no more than the compute overlaps
    spare = local_case(_config("ps-async"), {}, FACTS, {**PROFILE, "meta": {"cores": 8}})
    assert served_beside_compute_s(spare, x, 0.1) == 0.0  # cores to spare: nobody waits for one
    extra_s, notes = PSAsyncEstimator().local_compute_extra_s(spec, case)
    assert extra_s == pytest.approx(service_s / 3) and notes
    # the emulated link's wait is a sleep, not CPU: the same loss under the custom link
    spec_c, custom = _case("ps-async", environment=CUSTOM)
    assert PSAsyncEstimator().local_compute_extra_s(spec_c, custom)[0] == pytest.approx(extra_s)
    # ps-sync's workers compute together while the server waits for their pushes
    sync_spec, sync_case = _case("ps-sync")
    assert PSSyncEstimator().local_compute_extra_s(sync_spec, sync_case) == (0.0, [])
    plain = predict_local(_config("ps-async"), {}, FACTS, {**PROFILE, "meta": {"cores": 8}})
    busy = predict_local(_config("ps-async"), {}, FACTS, PROFILE)
    compute = lambda p: p["breakdown_s"]["forward_s"] + p["breakdown_s"]["backward_s"]  # noqa: E731
    assert compute(busy) - compute(plain) == pytest.approx(extra_s)


def test_hpsgd_all_reduce_in_flight_comes_out_of_the_next_steps_compute_on_busy_cores():
    spec, case = _case("hpsgd")
    all_reduce_s = 1e-4 + 1e6 / 1e9  # the calibrated all-reduce of the model's bytes
    extra_s, notes = HPSGDEstimator().local_compute_extra_s(spec, case)
    assert extra_s == pytest.approx(all_reduce_s) and notes
    # the custom link's all-reduce outlasts a step of compute: the rank waits it out, the real bytes move then
    spec_c, custom = _case("hpsgd", environment=CUSTOM)
    assert HPSGDEstimator().local_compute_extra_s(spec_c, custom) == (0.0, [])
    spare = local_case(_config("hpsgd"), {}, FACTS, {**PROFILE, "meta": {"cores": 8}})
    assert HPSGDEstimator().local_compute_extra_s(spec, spare) == (0.0, [])  # a core to spare for gloo's thread
    stale0, case0 = _case("hpsgd", staleness=0)
    assert HPSGDEstimator().local_compute_extra_s(stale0, case0) == (0.0, [])  # waited for in its own step
