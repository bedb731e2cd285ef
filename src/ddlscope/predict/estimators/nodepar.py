"""`nodepar`: a graph's nodes split over the GPUs; one gradient all-reduce per step, plus the halo
exchanges, which the cluster case does not size (it carries no graph), so they are noted, not priced."""

from __future__ import annotations

from ddlscope.predict import collectives as coll
from ddlscope.predict import strategies as pst
from ddlscope.predict.estimators import ESTIMATORS
from ddlscope.predict.estimators.base import ClusterCase, Estimator, LocalCase, LocalComm, LocalStep
from ddlscope.specs.strategies.nodepar import NodeParallelSpec

HALO_NOTE = "nodepar: the per-layer halo all-to-alls depend on the graph's cut and are not priced"


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
        return LocalComm(0.0, notes=[HALO_NOTE + " on this machine either; the gradient all-reduce is not priced"])
