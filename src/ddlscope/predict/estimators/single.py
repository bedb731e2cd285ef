"""`single`: one device, no communication."""

from __future__ import annotations

from ddlscope.predict import strategies as pst
from ddlscope.predict.estimators import ESTIMATORS
from ddlscope.predict.estimators.base import ClusterCase, Estimator, LocalCase, LocalComm, LocalStep
from ddlscope.specs.strategies.single import SingleSpec


@ESTIMATORS.register(SingleSpec)
class SingleEstimator(Estimator):
    def cluster(self, spec: SingleSpec, case: ClusterCase) -> pst.StrategyEstimate:
        return pst.single(case.workload, case.cluster)

    def cluster_memory(self, spec: SingleSpec, case: ClusterCase) -> tuple[float, float | None]:
        return case.replicated_state_bytes + case.activation_bytes, None

    def local_comm(self, spec: SingleSpec, case: LocalCase, step: LocalStep) -> LocalComm:
        return LocalComm()
