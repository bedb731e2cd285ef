"""`gossip`: its topologies, and on 4 ranks: the complete graph is global averaging, a ring is not."""

from __future__ import annotations

import os

import numpy as np
import pytest

from ddlscope.specs.strategies.gossip import GossipSpec, torus_rows


def mixing_matrix(spec: GossipSpec, world: int) -> np.ndarray:
    w = np.zeros((world, world))
    for rank in range(world):
        peers = spec.neighbours(rank, world)
        for j in [rank, *peers]:
            w[rank, j] = 1 / (len(peers) + 1)
    return w


@pytest.mark.parametrize("topology", ["ring", "torus", "exponential", "complete"])
def test_every_topology_mixes_with_a_doubly_stochastic_symmetric_matrix(topology: str):
    spec = GossipSpec(topology=topology)
    for world in range(2, 10):
        w = mixing_matrix(spec, world)
        np.testing.assert_allclose(w, w.T)
        np.testing.assert_allclose(w.sum(axis=0), 1.0)
        # connected: repeated mixing reaches the global mean (the second eigenvalue below 1)
        assert sorted(abs(np.linalg.eigvalsh(w)))[-2] < 1 - 1e-9, (topology, world)


def test_degrees_of_each_topology():
    def degree(topology: str, world: int) -> int:
        return len(GossipSpec(topology=topology).neighbours(0, world))

    assert [degree("ring", n) for n in (2, 3, 8)] == [1, 2, 2]
    assert degree("complete", 8) == 7 and degree("exponential", 8) == 5  # +-1, +-2, 4
    assert torus_rows(8) == 2 and torus_rows(9) == 3 and torus_rows(7) == 1
    assert degree("torus", 9) == 4 and degree("torus", 8) == 3  # 2 x 4: up and down are the same rank


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_complete_graph_is_global_averaging_and_a_ring_is_not(tmp_path):
    from ddlscope.runtime.launcher import launch_processes
    from test_dataparallel_equivalence import max_difference, train_all

    configs = {"localsgd-1": {"strategy.name": "localsgd", "strategy.period": 1, "workload.batch_size": 64, "workload.steps": 4},
               "complete": {"strategy.name": "gossip", "strategy.topology": "complete", "workload.batch_size": 64, "workload.steps": 4},
               "ring": {"strategy.name": "gossip", "strategy.topology": "ring", "workload.batch_size": 64, "workload.steps": 4}}
    out = launch_processes(train_all, (str(tmp_path), configs, 4), 4, run_id=f"dp-gossip-{os.getpid()}")
    models = {rank: out[rank]["models"] for rank in range(4)}
    assert max_difference(models[0]["complete"], models[0]["localsgd-1"]) < 1e-6
    assert max_difference(models[0]["complete"], models[3]["complete"]) < 1e-6
    # A ring of 4 mixes with 2 of the 3 others: its ranks disagree, and it is not the global average
    assert 1e-6 < max_difference(models[0]["ring"], models[2]["ring"]) < 0.5
    assert 1e-6 < max_difference(models[0]["ring"], models[0]["localsgd-1"]) < 0.5
    rows = out[1]["rows"]
    model_bytes = rows["localsgd-1"][0]["bytes_sent"]
    assert all(r["bytes_sent"] == 3 * model_bytes for r in rows["complete"])  # one message to each of 3 peers
    assert all(r["bytes_sent"] == 2 * model_bytes for r in rows["ring"])
