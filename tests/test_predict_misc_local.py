"""The local predictor's terms for nodepar's halo exchanges, CoCoD's average in flight and federated
rounds (issue 38 part 1): exact arithmetic on a synthetic calibration, and the halo's expected size
against the graph the workload generates (no timing here; benchmarks/predict_local.py measures)."""

from __future__ import annotations

import pytest

from test_predict_local import FACTS, PROFILE

from ddlscope.calibrate.model import message_s
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


def test_graph_defaults_are_the_workloads():
    from ddlscope.predict.estimators.nodepar import GRAPH_DEFAULTS
    from ddlscope.workloads.graph import GraphTransformerSpec

    defaults = GraphTransformerSpec().model_dump()
    assert {k: defaults[k] for k in GRAPH_DEFAULTS} == GRAPH_DEFAULTS


def _nodepar(mode: str) -> dict:
    config = {"workload": dict(GRAPH), "strategy": {"name": "nodepar", "mode": mode}, "cluster": {"world_size": 2}}
    return predict_local(config, {}, FACTS, PROBED)


def test_node_parallel_pays_each_halo_exchange_and_each_meeting():
    """Per step: 2 x layers halo all-to-alls (priced as an all-gather of the per-peer bytes) and one
    gradient all-reduce, each a meeting of the ranks; replicate mode meets once, for the all-reduce."""
    from ddlscope.calibrate.profile import CalibrationProfile
    from ddlscope.predict.estimators.nodepar import GraphSizes, mean_halo_nodes

    profile = CalibrationProfile.coerce(PROBED)
    all_reduce_s = message_s(profile, "all_reduce", FACTS["param_bytes"] + 4, 2, None)
    halo_bytes = mean_halo_nodes(GraphSizes(GRAPH), 2) * 2 * GRAPH["hidden"] * 4
    exchange_s = message_s(profile, "all_gather", halo_bytes, 2, None)  # one peer: the per-peer bytes
    replicate = _nodepar("replicate")["breakdown_s"]["comm_wait_s"]
    assert replicate == pytest.approx(all_reduce_s + SYNC_S)
    split = _nodepar("node-parallel")["breakdown_s"]["comm_wait_s"]
    assert split == pytest.approx(all_reduce_s + 4 * exchange_s + 5 * SYNC_S)
