"""`pipeline`: stages in sequence, micro-batches through a schedule; the bubble is idle time."""

from __future__ import annotations

from ddlscope.predict import strategies as pst
from ddlscope.predict.estimators import ESTIMATORS
from ddlscope.predict.estimators.base import (
    ClusterCase, Estimator, LocalCase, LocalComm, LocalStep, state_tensors)
from ddlscope.predict.partition import bubble_fraction, in_flight
from ddlscope.calibrate.model import message_s
from ddlscope.specs.strategies.pipeline import PipelineSpec


@ESTIMATORS.register(PipelineSpec)
class PipelineEstimator(Estimator):
    """One stage per GPU (rank), the layers split evenly; every rank sees the whole global batch.

    Per step a stage computes 1/p of the model on the global batch, which is what a data-parallel
    worker computes on its 1/p of it: the case's compute_s. The bubble adds bubble_fraction of it.
    """

    def cluster(self, spec: PipelineSpec, case: ClusterCase) -> pst.StrategyEstimate:
        p, w = case.cluster.n_gpus, case.workload
        compute_s = pst.compute_s(w, case.cluster) * case.stragglers  # the slowest stage sets the pace
        idle_s = compute_s * bubble_fraction(p, spec.micro_batches, spec.chunks, spec.schedule)
        step_s = compute_s + idle_s
        memory, _ = self.cluster_memory(spec, case)
        est = pst.StrategyEstimate("pipeline", p, step_s, compute_s, 0.0, idle_s, memory,
                                   w.batch_per_worker * p / step_s,
                                   notes=[f"bubble {idle_s / compute_s:.0%} of compute; activation sends "
                                          "between stages not priced"])
        single = w.batch_per_worker / pst.compute_s(w, case.cluster)
        est.speedup_vs_single = est.samples_per_s / single
        est.scaling_efficiency = est.speedup_vs_single / p
        return est

    def cluster_memory(self, spec: PipelineSpec, case: ClusterCase) -> tuple[float, float | None]:
        p, m = case.cluster.n_gpus, spec.micro_batches
        # stage 0's layers (1/p of the model) for the micro-batches it holds: a DP worker's
        # activation_bytes is the whole model on 1/p of the global batch, i.e. 1/p of one global batch
        held = in_flight(0, p, m, "gpipe" if spec.schedule == "gpipe" else "1f1b")
        return case.replicated_state_bytes / p + case.activation_bytes * held / m, None

    def local_optimizer_bytes(self, spec: PipelineSpec, case: LocalCase) -> float:
        return case.param_bytes / case.world

    def local_memory(self, spec: PipelineSpec, case: LocalCase) -> dict[str, dict[str, int]]:
        mine = int(case.param_bytes / case.world)
        return {"worker": {"parameters": mine, "gradients": mine,
                           "optimizer": int(case.param_bytes / case.world) * state_tensors(case)}}

    def local_comm(self, spec: PipelineSpec, case: LocalCase, step: LocalStep) -> LocalComm:
        """The bubble as waiting, on the compute the local model gives one rank, plus the activation
        and gradient sends between stages (two per micro-batch per boundary)."""
        idle_s = (step.forward_s + step.backward_s) * bubble_fraction(case.world, spec.micro_batches, spec.chunks,
                                                                      spec.schedule)
        act = float(case.facts.get("boundary_activation_bytes", 0.0)) / spec.micro_batches
        sends_s = 2 * spec.micro_batches * spec.chunks * message_s(case.profile, "p2p", act, 2, case.link) if act else 0.0
        notes = [] if act else ["pipeline: the facts hold no boundary activation size; sends not priced"]
        return LocalComm(idle_s + sends_s, notes=notes)
