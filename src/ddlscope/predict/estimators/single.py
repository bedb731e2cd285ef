"""`single`: one device, no communication."""

from __future__ import annotations

from ddlscope.predict import strategies as pst
from ddlscope.predict.catalogue import Cluster
from ddlscope.predict.estimators import ESTIMATORS
from ddlscope.predict.estimators.base import ClusterCase, Estimator, LocalCase, LocalComm, LocalStep
from ddlscope.specs.strategies.single import SingleSpec


def single(workload: pst.Workload, cluster: Cluster) -> pst.StrategyEstimate:
    """One device: its compute, the model states and activations of the whole batch, no communication."""
    c = pst.compute_s(workload, cluster)
    mem = (workload.params * workload.state_bytes_per_param
           + workload.activation_bytes_per_sample * workload.batch_per_worker)
    return pst.StrategyEstimate("single", 1, c, c, 0.0, 0.0, mem, workload.batch_per_worker,
                                pst.single_samples_per_s(workload, cluster))


@ESTIMATORS.register(SingleSpec)
class SingleEstimator(Estimator):
    def cluster(self, spec: SingleSpec, case: ClusterCase) -> pst.StrategyEstimate:
        return single(case.workload, case.cluster)

    def cluster_memory(self, spec: SingleSpec, case: ClusterCase) -> tuple[float, float | None]:
        return case.replicated_state_bytes + case.activation_bytes, None

    def local_comm(self, spec: SingleSpec, case: LocalCase, step: LocalStep) -> LocalComm:
        return LocalComm()
