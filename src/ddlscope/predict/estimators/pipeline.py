"""`pipeline`: stages in sequence, micro-batches through a schedule; the bubble is idle time."""

from __future__ import annotations

import math

from ddlscope.predict import collectives as coll
from ddlscope.predict import strategies as pst
from ddlscope.predict.estimators import ESTIMATORS
from ddlscope.predict.estimators.base import (
    ClusterCase, Estimator, LocalCase, LocalComm, LocalStep, state_tensors)
from ddlscope.predict.partition import bubble_fraction, in_flight
from ddlscope.specs.strategies.pipeline import PipelineSpec


@ESTIMATORS.register(PipelineSpec)
class PipelineEstimator(Estimator):
    """One stage per GPU (rank), the layers split evenly; every rank sees the whole global batch.

    Per step a stage computes 1/p of the model on the global batch, which is what a data-parallel
    worker computes on its 1/p of it: the case's compute_s. The bubble adds bubble_fraction of it.
    """

    def cluster(self, spec: PipelineSpec, case: ClusterCase) -> pst.StrategyEstimate:
        n, w = case.cluster.n_gpus, case.workload
        p = spec.pipeline_ranks(n)
        # a stage computes 1/p of the model on 1/dp of the batch: a data-parallel worker's compute
        compute_s = pst.compute_s(w, case.cluster) * case.stragglers  # the slowest stage sets the pace
        idle_s = compute_s * bubble_fraction(p, spec.micro_batches, spec.chunks, spec.schedule)
        # dp > 1: each stage's gradients all-reduced over its dp replicas (not overlapped), ranks a node apart
        comm_s = 0.0
        if spec.dp > 1:
            comm_s = float(coll.all_reduce_s(w.params * case.weight_bytes_per_param / p, spec.dp,
                                             max(1, case.cluster.gpus_per_node // p), case.cluster.node))
        step_s = compute_s + idle_s + comm_s
        memory, _ = self.cluster_memory(spec, case)
        return pst.StrategyEstimate("pipeline", n, step_s, compute_s, comm_s, idle_s + comm_s, memory,
                                    w.batch_per_worker * n, pst.single_samples_per_s(w, case.cluster),
                                    notes=[f"bubble {idle_s / compute_s:.0%} of compute; activation sends "
                                           "between stages not priced"])

    def cluster_memory(self, spec: PipelineSpec, case: ClusterCase) -> tuple[float, float | None]:
        p, m = spec.pipeline_ranks(case.cluster.n_gpus), spec.micro_batches
        if p * spec.chunks > case.workload.layers:
            return math.inf, None  # more stages than blocks (the case's units): no such pipeline
        # stage 0's layers (1/p of the model) for the micro-batches it holds: a DP worker's
        # activation_bytes is the whole model on 1/p of the global batch, i.e. 1/p of one global batch
        held = in_flight(0, p, m, "gpipe" if spec.schedule == "gpipe" else "1f1b")
        return case.replicated_state_bytes / p + case.activation_bytes * held / m, None

    def cluster_notes(self, spec: PipelineSpec, case: ClusterCase) -> list[str]:
        stages = spec.pipeline_ranks(case.cluster.n_gpus) * spec.chunks
        if stages > case.workload.layers:
            return [f"{stages} stages (one per GPU) but the model has {case.workload.layers} blocks: cannot run"]
        return []

    def local_compute_stretch(self, spec: PipelineSpec, case: LocalCase) -> float | None:
        """A rank computes its stages only: 1/p of the model (on the whole batch, which is what the facts
        profile for a strategy that does not split the batch), stretched as the synchronisation probe
        measured ranks computing side by side."""
        return case.side_by_side_stretch() / case.world

    def local_optimizer_bytes(self, spec: PipelineSpec, case: LocalCase) -> float:
        return case.param_bytes / spec.pipeline_ranks(case.world)

    def local_memory(self, spec: PipelineSpec, case: LocalCase) -> dict[str, dict[str, int]]:
        mine = int(case.param_bytes / spec.pipeline_ranks(case.world))
        return {"worker": {"parameters": mine, "gradients": mine, "optimizer": mine * state_tensors(case)}}

    def local_comm(self, spec: PipelineSpec, case: LocalCase, step: LocalStep) -> LocalComm:
        """The bubble, as waiting, on the compute the local model gives one rank. The sends between
        stages are left out (on loopback they are a small part of the waits; docs/modelparallel.md)."""
        p = spec.pipeline_ranks(case.world)
        idle_s = (step.forward_s + step.backward_s) * bubble_fraction(p, spec.micro_batches, spec.chunks,
                                                                      spec.schedule)
        notes = ["pipeline: the bubble priced from the schedule's formula; the sends between stages are not priced"]
        if spec.dp > 1:
            notes.append("pipeline dp > 1: the replicas' gradient all-reduce is not priced on this machine")
        return LocalComm(idle_s, notes=notes)
