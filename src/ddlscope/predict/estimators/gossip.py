"""`gossip`: a step's compute, then one model-sized message to and from each neighbour.

A worker's messages share its link, so they take degree x one message; every
step meets the neighbours (a straggler holds its neighbours, and through them,
a step later, everybody: the estimate holds everybody to it at once). Memory:
the flat model sent and one received per neighbour.
"""

from __future__ import annotations

from ddlscope.calibrate.model import message_s
from ddlscope.predict import collectives as coll
from ddlscope.predict import strategies as pst
from ddlscope.predict.estimators import ESTIMATORS
from ddlscope.predict.estimators.base import ClusterCase, Estimator, LocalCase, LocalComm, LocalStep
from ddlscope.predict.estimators.hpsgd import synchronising_estimate
from ddlscope.predict.estimators.localsgd import extra_copies_bytes, local_sync_wait_s
from ddlscope.specs.strategies.gossip import GossipSpec


def degree(spec: GossipSpec, workers: int) -> int:
    return len(spec.neighbours(0, workers))  # every topology here is regular


@ESTIMATORS.register(GossipSpec)
class GossipEstimator(Estimator):
    def cluster(self, spec: GossipSpec, case: ClusterCase) -> pst.StrategyEstimate:
        w, cluster = case.workload, case.cluster
        n = cluster.n_gpus
        message_bytes = w.params * w.weight_bytes_per_param
        # Neighbours outside the node are the slower links; rings and tori have some, so price them there.
        comm_s = degree(spec, n) * float(coll.p2p_s(message_bytes, cluster.nodes > 1, cluster.node))
        return synchronising_estimate(spec.name, case, pst.compute_s(w, cluster), comm_s, comm_s,
                                      self.cluster_memory(spec, case)[0])

    def cluster_memory(self, spec: GossipSpec, case: ClusterCase) -> tuple[float, float | None]:
        copies = 1 + degree(spec, case.cluster.n_gpus)
        return case.replicated_state_bytes + case.activation_bytes + extra_copies_bytes(case, copies), None

    def local_comm(self, spec: GossipSpec, case: LocalCase, step: LocalStep) -> LocalComm:
        peers = degree(spec, case.world)
        exchange_s = peers * message_s(case.profile, "p2p", case.param_bytes, 2, case.link)
        copies_s = (2 + peers) * case.param_bytes / case.memory_bandwidth_bytes_per_s * step.stretch
        comm = LocalComm(exchange_s + copies_s + local_sync_wait_s(case), holds_sync_wait=True)
        comm.notes.append(f"gossip: {peers} neighbour(s) on a {spec.topology}, {exchange_s * 1e3:.2f} ms of messages")
        return comm
