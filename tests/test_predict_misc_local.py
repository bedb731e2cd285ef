"""The local predictor's terms for nodepar's halo exchanges, CoCoD's average in flight and federated
rounds (issue 38 part 1): exact arithmetic on a synthetic calibration, and the halo's expected size
against the graph the workload generates (no timing here; benchmarks/predict_local.py measures)."""

from __future__ import annotations

import pytest

from test_predict_local import FACTS, PROFILE

from ddlscope.calibrate.model import message_s
from ddlscope.calibrate.profile import CalibrationProfile
from ddlscope.predict.local import predict_local

SYNC_S = 1e-3  # the synthetic calibration's wait per meeting of the ranks
PROBED = {**PROFILE, "sync": {f"ws{n}": {"block_alone_s": [0.002, 0.008], "compute_stretch": [1.0, 1.0],
                                         "sync_overhead_s": [SYNC_S, SYNC_S]} for n in (2, 4)}}
GRAPH = {"name": "graph-transformer", "optimizer": "sgd", "nodes": 256, "hidden": 32, "layers": 2}


@pytest.mark.parametrize("sizes, ranks", [({"nodes": 1024}, 2), ({"nodes": 1000, "communities": 3}, 4),
                                          ({"nodes": 512, "communities": 8, "degree_out": 5}, 3)])
def test_the_expected_halo_is_the_generated_graphs(sizes, ranks):
    """The arithmetic halo (what a rank receives, from the generator's rule) lies within 2% of the
    halo_of() the runtime computes on the generated graph, averaged over the ranks."""
    from ddlscope.predict.estimators.nodepar import GraphSizes, mean_halo_nodes
    from ddlscope.strategies.nodepar import halo_of, partition_bounds
    from ddlscope.workloads.graph import GraphTransformerSpec, generate_graph

    spec = GraphTransformerSpec(**sizes)
    graph, bounds = generate_graph(spec), partition_bounds(spec.nodes, ranks)
    real = sum(len(halo_of(graph.src, graph.dst, int(bounds[r]), int(bounds[r + 1]))) for r in range(ranks)) / ranks
    assert mean_halo_nodes(GraphSizes(spec.model_dump()), ranks) == pytest.approx(real, rel=0.02)


def test_graph_defaults_and_auto_mode_are_the_workloads():
    from ddlscope.predict.estimators.nodepar import GRAPH_DEFAULTS, GraphSizes
    from ddlscope.specs.strategies.nodepar import NodeParallelSpec
    from ddlscope.workloads.graph import GraphTransformerSpec

    defaults = GraphTransformerSpec().model_dump()
    assert {k: defaults[k] for k in GRAPH_DEFAULTS} == GRAPH_DEFAULTS
    auto = NodeParallelSpec(memory_budget_bytes=2**20)
    for nodes in (64, 4096):  # below and above the budget: replicate, then node-parallel
        spec = GraphTransformerSpec(nodes=nodes)
        assert auto.resolved_mode(GraphSizes({"nodes": nodes}), 2) == auto.resolved_mode(spec, 2)
    assert {auto.resolved_mode(GraphSizes({"nodes": n}), 2) for n in (64, 4096)} == {"replicate", "node-parallel"}


def _nodepar(mode: str) -> dict:
    config = {"workload": dict(GRAPH), "strategy": {"name": "nodepar", "mode": mode}, "cluster": {"world_size": 2}}
    return predict_local(config, {}, FACTS, PROBED)


def test_node_parallel_pays_each_halo_exchange_and_each_meeting():
    """Per step: 2 x layers halo all-to-alls (priced as an all-gather of the per-peer bytes) and one
    gradient all-reduce, each a meeting of the ranks; replicate mode meets once, for the all-reduce."""
    from ddlscope.predict.estimators.nodepar import GraphSizes, mean_halo_nodes

    profile = CalibrationProfile.coerce(PROBED)
    all_reduce_s = message_s(profile, "all_reduce", FACTS["param_bytes"] + 4, 2, None)
    halo_bytes = mean_halo_nodes(GraphSizes(GRAPH), 2) * 2 * GRAPH["hidden"] * 4
    exchange_s = message_s(profile, "all_gather", halo_bytes, 2, None)  # one peer: the per-peer bytes
    replicate = _nodepar("replicate")["breakdown_s"]["comm_wait_s"]
    assert replicate == pytest.approx(all_reduce_s + SYNC_S)
    split = _nodepar("node-parallel")["breakdown_s"]["comm_wait_s"]
    assert split == pytest.approx(all_reduce_s + 4 * exchange_s + 5 * SYNC_S)
    alone = {"workload": dict(GRAPH), "strategy": {"name": "nodepar"}, "cluster": {"world_size": 1}}
    assert predict_local(alone, {}, FACTS, PROBED)["breakdown_s"]["comm_wait_s"] == 0.0


def test_a_cocod_average_lands_at_the_next_one_or_at_the_runs_last_step():
    from ddlscope.predict.estimators.localsgd import in_flight_averages
    from ddlscope.specs.strategies.localsgd import CoCoDSpec

    assert in_flight_averages(CoCoDSpec(period=8), 12) == [(0, 8), (8, 11)]
    assert in_flight_averages(CoCoDSpec(period=4), 9) == [(0, 4), (4, 8), (8, 8)]  # the last one lands at once


def _cocod(steps: int | None, cores: int = 8, period: int = 8) -> tuple[dict, object]:
    """The prediction of a CoCoD run on a slow emulated link, and its LocalCase."""
    from ddlscope.predict.local import local_case

    config = {"workload": {"name": "mlp-digits", "optimizer": "sgd"}, "cluster": {"world_size": 2},
              "strategy": {"name": "cocod", "period": period}}
    if steps is not None:
        config["workload"]["steps"] = steps
    profile = {**PROBED, "meta": {"cores": cores}}
    slow = {"network": {"emulated": True, "alpha_s": 0.0, "bandwidth_bytes_per_s": 2e5}}  # a 19 KB model: ~96 ms
    return predict_local(config, slow, FACTS, profile), local_case(config, slow, FACTS, profile)


def test_cocod_waits_for_what_the_steps_before_its_landing_did_not_hide():
    """12 steps, period 8: the average launched after step 8 lands at step 11, hidden by 3 steps' compute
    only; the one launched after step 0 lands at step 8, hidden by 8. Both land in the 11 measured steps."""
    from ddlscope.predict.estimators.base import LocalStep
    from ddlscope.predict.estimators.localsgd import local_model_all_reduce_s, local_sync_wait_s

    predicted, case = _cocod(12)
    b = predicted["breakdown_s"]
    step_compute_s = b["forward_s"] + b["backward_s"] + len(FACTS["param_numel"]) * case.op_s * predicted[
        "compute_stretch"]
    all_reduce_s, copies_s = local_model_all_reduce_s(case, LocalStep(predicted["compute_stretch"], 0, 0, 0))
    assert all_reduce_s > 8 * step_compute_s  # the link is slow enough that even 8 steps leave a wait
    waits_s = max(all_reduce_s - 8 * step_compute_s, 0) + max(all_reduce_s - 3 * step_compute_s, 0)
    expected = waits_s / 11 + (6 * copies_s + local_sync_wait_s(case)) / 11  # one launch (after step 8) measured
    assert b["comm_wait_s"] == pytest.approx(expected)


def test_an_average_in_flight_takes_the_ranks_cores_only_when_none_is_spare():
    """On 2 cores the average's real transfer (the calibrated all-reduce, not the emulated wait) comes out of
    the rank's compute, once per average moving in the measured steps (after steps 0 and 8 of 12)."""
    spare, _ = _cocod(12, cores=8)
    busy, case = _cocod(12, cores=2)
    transfer_s = message_s(case.profile, "all_reduce", FACTS["param_bytes"], 2, None)
    compute = ("forward_s", "backward_s")
    extra_s = sum(busy["breakdown_s"][p] for p in compute) - sum(spare["breakdown_s"][p] for p in compute)
    assert extra_s == pytest.approx(2 * transfer_s / 11)
    assert any("in flight moves its bytes" in n for n in busy["notes"])


@pytest.mark.parametrize("strategy, before, during", [("fedavg", 2, 4), ("mc-psgd", 5, 6)])
def test_a_rounds_model_copies_are_the_runtimes(strategy, before, during):
    """fedavg: flatten the start (2 passes: cat and clone; loading it makes views, none); then flatten the
    end (2), concatenate (1), weight (1). mc-psgd: also clone the chain (1), flatten the first end between
    (2); two models concatenated and weighted. The forward phases hold the first, the synchronize phase
    the second."""
    from ddlscope.predict.estimators.federated import round_copies
    from ddlscope.predict.local import strategy_of

    spec = strategy_of({"strategy": {"name": strategy, "local_steps": 4}})
    assert round_copies(spec) == (before, during)
    kernels = {"forward_s": 0.002, "backward_s": 0.004, "optimizer_s": 0.001, "data_s": 0.0005, "steps": 9}
    facts = {**FACTS, "kernels": kernels}
    config = _federated(strategy)
    pass_s = FACTS["param_bytes"] / PROFILE["compute"]["memory_bandwidth_bytes_per_s"]
    b = predict_local(config, {}, facts, PROFILE)["breakdown_s"]
    models = 2 if strategy == "mc-psgd" else 1
    compute_s = 4 * models * (kernels["forward_s"] + kernels["backward_s"])
    assert b["forward_s"] + b["backward_s"] == pytest.approx(compute_s + before * pass_s)
    all_reduce_s = message_s(CalibrationProfile.coerce(PROFILE), "all_reduce", models * FACTS["param_bytes"], 2, None)
    assert b["comm_wait_s"] == pytest.approx(all_reduce_s + during * pass_s)


def _federated(strategy: str) -> dict:
    return {"workload": {"name": "mlp-digits", "optimizer": "sgd"}, "cluster": {"world_size": 2},
            "strategy": {"name": strategy, "local_steps": 4}}


def test_the_clients_wait_for_the_slowest_over_the_whole_round():
    """The kernels' side-by-side spread per minibatch adds up over a round's minibatches: a slower rank
    stays slower for the round (rank 0 computed 98-103 ms a round against rank 1's 82-85, four rounds in
    a row), so the mean client waits 4 x models times one minibatch's wait, not sqrt of that."""
    together = {"processes": 2, "stretch": 1.0, "slowest_wait_s": 1e-3}
    kernels = {"forward_s": 0.002, "backward_s": 0.004, "optimizer_s": 0.001, "data_s": 0.0005, "steps": 9,
               "together": together}
    quiet = {"forward_s": 0.002, "backward_s": 0.004, "optimizer_s": 0.001, "data_s": 0.0005, "steps": 9,
             "together": {**together, "slowest_wait_s": 0.0}}
    for strategy, minibatches in (("fedavg", 4), ("mc-psgd", 8)):
        spread = predict_local(_federated(strategy), {}, {**FACTS, "kernels": kernels}, PROFILE)
        none = predict_local(_federated(strategy), {}, {**FACTS, "kernels": quiet}, PROFILE)
        extra_s = spread["breakdown_s"]["comm_wait_s"] - none["breakdown_s"]["comm_wait_s"]
        assert extra_s == pytest.approx(minibatches * 1e-3)
