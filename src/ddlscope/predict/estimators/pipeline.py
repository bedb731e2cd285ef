"""`pipeline`: stages in sequence, micro-batches through a schedule; the bubble is idle time."""

from __future__ import annotations

import math

from ddlscope.calibrate.model import message_s
from ddlscope.predict import collectives as coll
from ddlscope.predict import strategies as pst
from ddlscope.predict.estimators import ESTIMATORS
from ddlscope.predict.estimators.base import (
    ClusterCase, Estimator, LocalCase, LocalComm, LocalStep, forward_share, gpt_sizes, state_tensors)
from ddlscope.predict.partition import bubble_fraction, in_flight
from ddlscope.predict.schedule_sim import simulate, single_stage_orders
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

    def local_compute_share(self, spec: PipelineSpec, case: LocalCase) -> float:
        """A rank computes its stages only: 1/p of the model (on the whole batch, which is what the facts
        profile for a strategy that does not split the batch)."""
        return 1.0 / case.world

    def local_optimizer_bytes(self, spec: PipelineSpec, case: LocalCase) -> float:
        return case.param_bytes / spec.pipeline_ranks(case.world)

    def local_memory(self, spec: PipelineSpec, case: LocalCase) -> dict[str, dict[str, int]]:
        mine = int(case.param_bytes / spec.pipeline_ranks(case.world))
        return {"worker": {"parameters": mine, "gradients": mine, "optimizer": mine * state_tensors(case)}}

    def local_compute_extra_s(self, spec: PipelineSpec, case: LocalCase) -> tuple[float, list[str]]:
        """Recompute: a recomputing stage runs its forward again in backward (torch.utils.checkpoint). The
        busiest rank's: its stages' forwards (stages of equal compute) among `recompute`, at its stretch."""
        if not spec.recompute:
            return 0.0, []
        p, v = spec.pipeline_ranks(case.world), spec.chunks
        per_stage_forward_s = case.alone_s * forward_share(case.facts) * case.side_by_side_stretch() / (p * v)
        recomputing = max(sum(1 for s in range(rank, p * v, p) if s in spec.recompute) for rank in range(p))
        extra_s = recomputing * per_stage_forward_s
        return extra_s, [f"pipeline: recompute: {recomputing} stage forward(s) again in the busiest rank's "
                         f"backward, {extra_s * 1e3:.2f} ms"]

    def local_comm(self, spec: PipelineSpec, case: LocalCase, step: LocalStep) -> LocalComm:
        """The bubble and the transfers between stages, as waiting. GPipe and 1F1B: torch's action order
        played out (predict/schedule_sim.py) with the rank's forward and backward per micro-batch (stages
        of equal compute) and each activation or gradient reaching the next stage one calibrated p2p
        message later (batch / m x seq x hidden fp32, a GPT's sizes from its config); the busiest rank's
        idle. The multi-stage schedules (their order is torch's, not known here): the formula's bubble
        plus the fill's and drain's 2 (p v - 1) transfers."""
        p, m, v = spec.pipeline_ranks(case.world), spec.micro_batches, spec.chunks
        transfer_s, notes = stage_transfer_s(spec, case)
        if v == 1:
            per_action = {"F": step.forward_s / m, "B": step.backward_s / m}
            timeline = simulate(single_stage_orders(spec.schedule, p, m), lambda a: per_action[a[0]], p, transfer_s)
            busiest = max(range(p), key=lambda r: timeline.busy_s[r])
            idle_s = timeline.makespan_s - timeline.busy_s[busiest]
            notes.append(f"pipeline: {spec.schedule}'s order played out: idle {idle_s * 1e3:.2f} ms a step")
        else:
            idle_s = ((step.forward_s + step.backward_s) * bubble_fraction(p, m, v, spec.schedule)
                      + 2 * (p * v - 1) * transfer_s)
            notes.append(f"pipeline: {spec.schedule}'s bubble from its formula, + {2 * (p * v - 1)} transfers")
        if spec.dp > 1:
            notes.append("pipeline dp > 1: the replicas' gradient all-reduce is not priced on this machine")
        return LocalComm(idle_s, notes=notes)


def stage_transfer_s(spec: PipelineSpec, case: LocalCase) -> tuple[float, list[str]]:
    """One micro-batch's activations (or their gradient) from a stage to the next: a calibrated p2p message
    (the emulated link's time where slower); 0 where the workload's config does not give a GPT's sizes."""
    sizes = gpt_sizes(case.workload)
    if sizes is None:
        return 0.0, ["pipeline: the workload's sizes are not in its config: the sends between stages are not priced"]
    payload_bytes = sizes[1] / spec.dp / spec.micro_batches * 4
    transfer_s = message_s(case.profile, "p2p", payload_bytes, 2, case.link)
    return transfer_s, [f"pipeline: a stage's send {payload_bytes / 1e3:.0f} kB, {transfer_s * 1e3:.2f} ms"]
