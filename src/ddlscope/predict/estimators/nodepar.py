"""`nodepar`: a graph's nodes split over the GPUs; one gradient all-reduce per step, plus the halo
exchanges, which the cluster case does not size (it carries no graph), so they are noted, not priced.

This machine (strategies/nodepar.py): per step, node-parallel mode makes one halo all-to-all per
layer in forward (the halo's keys and values: 2 x hidden floats a row) and the reverse one in
backward, then one all-reduce of the gradients (and the loss); replicate mode only the all-reduce.
The halo's rows are the graph's expected cut, from the generator's rule (workloads/graph.py: each
node draws `degree_in` in-neighbours uniformly in its community and `degree_out` uniformly outside
it), so no torch is needed. Each collective is a meeting of the ranks between stretches of compute:
it costs the message (gloo's all-to-all between two ranks moves what an all-gather of one shard
does: each sends its part to every other, so the all-gather table at the per-peer bytes prices it)
and the calibrated wait of ranks meeting (the synchronisation probe, at the compute between two
meetings). On the 2-rank 256-node benchmark row the five meetings were most of the step: comm_wait
6.1-8.7 ms measured against 1.4 ms with one meeting priced.
"""

from __future__ import annotations

import math
from typing import Any

from ddlscope.calibrate.model import (
    collective_fit, emulated_s, machine_probe, measured_message_s, message_s, sync_at)
from ddlscope.predict import collectives as coll
from ddlscope.predict import strategies as pst
from ddlscope.predict.estimators import ESTIMATORS
from ddlscope.predict.estimators.base import ClusterCase, Estimator, LocalCase, LocalComm, LocalStep
from ddlscope.specs.strategies.nodepar import FLOAT_BYTES, NodeParallelSpec

HALO_NOTE = "nodepar: the per-layer halo all-to-alls depend on the graph's cut and are not priced"
# The generator's defaults (workloads/graph.py GraphTransformerSpec), for a config that leaves them out.
GRAPH_DEFAULTS = {"nodes": 1024, "communities": 4, "degree_in": 8, "degree_out": 2, "hidden": 32, "layers": 2,
                  "heads": 4, "attention": "sparse"}


class GraphSizes:
    """The sizes of a graph-transformer workload from its config dict (the spec lives with torch, in
    workloads/graph.py): what NodeParallelSpec.resolved_mode and the halo arithmetic read."""

    def __init__(self, workload: dict[str, Any]):
        sizes = {**GRAPH_DEFAULTS, **{k: v for k, v in workload.items() if k in GRAPH_DEFAULTS}}
        self.nodes, self.communities = int(sizes["nodes"]), int(sizes["communities"])
        self.degree_in, self.degree_out = int(sizes["degree_in"]), int(sizes["degree_out"])
        self.hidden, self.layers, self.heads = int(sizes["hidden"]), int(sizes["layers"]), int(sizes["heads"])
        self.attention = str(sizes["attention"])

    def edges_estimate(self) -> int:
        return self.nodes * (self.degree_in + self.degree_out + 1)

    def community_bounds(self) -> list[int]:
        """First node of each community and the end: node i is in community i * communities // nodes."""
        return [-(-c * self.nodes // self.communities) for c in range(self.communities + 1)]


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> int:
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


def expected_halo_nodes(graph: GraphSizes, start: int, end: int) -> float:
    """Expected distinct nodes outside [start, end) with an edge into a node inside it (the halo one rank
    receives). A node j of community C is drawn by each of the range's `degree_in` draws of its members
    in C with probability 1/|C|, and by each `degree_out` draw of its members in another community D
    with probability 1/(nodes - |D|)."""
    bounds = graph.community_bounds()
    communities = [(bounds[c], bounds[c + 1]) for c in range(graph.communities)]
    inside = [_overlap(span, (start, end)) for span in communities]  # the range's members per community
    halo = 0.0
    for c, span in enumerate(communities):
        outside_rank = (span[1] - span[0]) - inside[c]
        if not outside_rank:
            continue
        log_missed = graph.degree_in * inside[c] * math.log1p(-1 / (span[1] - span[0]))
        log_missed += sum(graph.degree_out * inside[d] * math.log1p(-1 / (graph.nodes - (s[1] - s[0])))
                          for d, s in enumerate(communities) if d != c and inside[d])
        halo += outside_rank * (1 - math.exp(log_missed))
    return halo


def mean_halo_nodes(graph: GraphSizes, ranks: int) -> float:
    """The halo nodes a rank receives, averaged over the ranks' contiguous ranges (strategies/nodepar.py
    partition_bounds): also what a rank sends, on average."""
    bounds = [graph.nodes * r // ranks for r in range(ranks + 1)]
    return sum(expected_halo_nodes(graph, bounds[r], bounds[r + 1]) for r in range(ranks)) / ranks


def halo_exchange_s(case: LocalCase, send_bytes: float) -> float:
    """One halo all-to-all on this machine: gloo's time for an all-gather of the per-peer part (each rank
    sends its part to each other rank, as an all-gather sends its shard), or the emulated link's time
    for the bytes sent, if longer."""
    peers = max(case.world - 1, 1)
    measured = measured_message_s(collective_fit(case.profile, "all_gather", case.world), send_bytes / peers)
    return measured if case.link is None else max(measured, emulated_s(case.link, "all_to_all", send_bytes,
                                                                        case.world))


def meeting_wait_s(case: LocalCase, compute_between_s: float) -> float:
    """The calibrated wait of the ranks meeting at a collective after `compute_between_s` of compute each
    (the synchronisation probe's sync_overhead_s: beyond the collective's own latency)."""
    return sync_at(machine_probe(case.profile, "sync", case.world), compute_between_s)[1]


@ESTIMATORS.register(NodeParallelSpec)
class NodeParallelEstimator(Estimator):
    """Node parallel: each GPU computes 1/t of the nodes for the whole batch, so its compute is a
    data-parallel worker's (as for tp); the replicated gradients are all-reduced once per step."""

    def cluster(self, spec: NodeParallelSpec, case: ClusterCase) -> pst.StrategyEstimate:
        t, w = case.cluster.n_gpus, case.workload
        compute_s = pst.compute_s(w, case.cluster) * case.stragglers
        gradient_bytes = w.params * case.weight_bytes_per_param
        comm_s = float(coll.all_reduce_s(gradient_bytes, t, min(t, case.cluster.gpus_per_node), case.cluster.node))
        step_s = compute_s + comm_s
        memory, _ = self.cluster_memory(spec, case)
        global_batch = w.batch_per_worker * t
        return pst.StrategyEstimate("nodepar", t, step_s, compute_s, comm_s, comm_s, memory, global_batch,
                                    pst.single_samples_per_s(w, case.cluster), notes=[HALO_NOTE])

    def cluster_memory(self, spec: NodeParallelSpec, case: ClusterCase) -> tuple[float, float | None]:
        # the worker's activations are 1/t of the whole graph's; t workers' batches make the whole graph's
        return case.replicated_state_bytes + case.activation_bytes, None

    def local_comm(self, spec: NodeParallelSpec, case: LocalCase, step: LocalStep) -> LocalComm:
        if case.world == 1:  # one rank: its all-reduce is with itself, nothing to wait for
            return LocalComm(0.0, holds_sync_wait=True)
        graph = GraphSizes(case.workload)
        # the gradients and the loss, summed in one all-reduce
        all_reduce_s = message_s(case.profile, "all_reduce", case.param_bytes + FLOAT_BYTES, case.world, case.link)
        exchanges, exchange_s, halo_rows = 0, 0.0, 0.0
        if spec.resolved_mode(graph, case.world) == "node-parallel":
            halo_rows = mean_halo_nodes(graph, case.world)
            exchanges = 2 * graph.layers  # one per layer in forward, the reverse one in backward
            exchange_s = halo_exchange_s(case, halo_rows * 2 * graph.hidden * FLOAT_BYTES)
        meetings = 1 + exchanges
        wait_s = meetings * meeting_wait_s(case, (step.forward_s + step.backward_s) / meetings)
        comm = LocalComm(all_reduce_s + exchanges * exchange_s + wait_s, holds_sync_wait=True)
        comm.notes.append(
            f"nodepar: a gradient all-reduce ({all_reduce_s * 1e3:.2f} ms)"
            + (f" and {exchanges} halo all-to-alls of ~{halo_rows:.0f} rows ({exchange_s * 1e3:.2f} ms each)"
               if exchanges else "")
            + f" a step, each a meeting of the ranks ({wait_s / meetings * 1e3:.2f} ms waiting each)")
        return comm
