"""`partitioned`: a part of the model per GPU, each trained on its own loss; activations go forward only."""

from __future__ import annotations

from ddlscope.predict import strategies as pst
from ddlscope.predict.estimators import ESTIMATORS
from ddlscope.predict.estimators.base import (
    ClusterCase, Estimator, LocalCase, LocalComm, LocalStep, state_tensors)
from ddlscope.specs.strategies.partitioned import PartitionedSpec

# A part's forward as a share of its forward + backward (backward ~ 2 forwards).
FORWARD_SHARE = 1 / 3


def chain_wait_fraction(parts: int) -> float:
    """Idle over compute of a step: part k starts when part k - 1's forward has arrived, and every rank
    waits for the last part's loss (shared each step), so a step lasts (parts - 1) forwards longer than
    a part's own forward + backward."""
    return (parts - 1) * FORWARD_SHARE


@ESTIMATORS.register(PartitionedSpec)
class PartitionedEstimator(Estimator):
    """One part per GPU, the layers split evenly, every GPU on the whole global batch: a part computes
    1/p of the model on it, what a data-parallel worker computes on its 1/p of the batch (the case's
    compute_s); the forward chain adds (p - 1) part forwards of waiting."""

    def cluster(self, spec: PartitionedSpec, case: ClusterCase) -> pst.StrategyEstimate:
        p, w = case.cluster.n_gpus, case.workload
        compute_s = pst.compute_s(w, case.cluster) * case.stragglers
        idle_s = compute_s * chain_wait_fraction(p)
        step_s = compute_s + idle_s
        memory, _ = self.cluster_memory(spec, case)
        return pst.StrategyEstimate("partitioned", p, step_s, compute_s, 0.0, idle_s, memory, w.batch_per_worker * p,
                                    pst.single_samples_per_s(w, case.cluster),
                                    notes=["partitioned: each part trains on its own synthetic-target loss, not the "
                                           "end-to-end model (accuracy differs); activation sends not priced"])

    def cluster_memory(self, spec: PartitionedSpec, case: ClusterCase) -> tuple[float, float | None]:
        # 1/p of the model's states; its activations for the whole global batch, which is what a
        # data-parallel worker's activation_bytes (the whole model on 1/p of the batch) amounts to
        return case.replicated_state_bytes / case.cluster.n_gpus + case.activation_bytes, None

    def local_compute_share(self, spec: PartitionedSpec, case: LocalCase) -> float:
        """A rank computes its part only: 1/p of the model on the whole batch."""
        return 1.0 / case.world

    def local_optimizer_bytes(self, spec: PartitionedSpec, case: LocalCase) -> float:
        return case.param_bytes / case.world

    def local_memory(self, spec: PartitionedSpec, case: LocalCase) -> dict[str, dict[str, int]]:
        mine = int(case.param_bytes / case.world)
        return {"worker": {"parameters": mine, "gradients": mine, "optimizer": mine * state_tensors(case)}}

    def local_comm(self, spec: PartitionedSpec, case: LocalCase, step: LocalStep) -> LocalComm:
        idle_s = (case.world - 1) * step.forward_s
        return LocalComm(idle_s, notes=["partitioned: the forward chain's wait priced as (parts - 1) part forwards; "
                                        "the activation sends are not priced"])
