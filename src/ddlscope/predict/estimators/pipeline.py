"""`pipeline`: stages in sequence, micro-batches through a schedule; the bubble is idle time."""

from __future__ import annotations

import math
from typing import Callable, Sequence

from ddlscope.calibrate.model import machine_probe, message_s
from ddlscope.predict import collectives as coll
from ddlscope.predict import strategies as pst
from ddlscope.predict.estimators import ESTIMATORS
from ddlscope.predict.estimators.base import (
    ClusterCase, Estimator, LocalCase, LocalComm, LocalStep, forward_share, gpt_sizes, state_tensors)
from ddlscope.predict.partition import bubble_fraction, in_flight
from ddlscope.predict.schedule_sim import Action, interleaved_orders, simulate, single_stage_orders
from ddlscope.predict.specs import ModelSpec
from ddlscope.specs.strategies.pipeline import PipelineSpec, stage_ranges


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
        """A rank computes its stages only (on the whole batch, which is what the facts profile for a strategy
        that does not split the batch): the busiest rank's, which sets the pace; 1/p of the model where the
        stages are equal or their sizes unknown."""
        p = spec.pipeline_ranks(case.world)
        return busiest_rank_share(stage_weights(spec, case), p) * p / case.world

    def local_optimizer_bytes(self, spec: PipelineSpec, case: LocalCase) -> float:
        return case.param_bytes / spec.pipeline_ranks(case.world)

    def local_memory(self, spec: PipelineSpec, case: LocalCase) -> dict[str, dict[str, int]]:
        mine = int(case.param_bytes / spec.pipeline_ranks(case.world))
        return {"worker": {"parameters": mine, "gradients": mine, "optimizer": mine * state_tensors(case)}}

    def local_compute_extra_s(self, spec: PipelineSpec, case: LocalCase) -> tuple[float, list[str]]:
        """What a rank computes beyond its share of the kernels timed on the whole batch, at its stretch:
        each of the m micro-batches replays its stages' ops, and the kernels paid every op's calibrated
        overhead once, so (m - 1) x ops / p more; recompute: a recomputing stage runs its forward again in
        backward (torch.utils.checkpoint), the busiest rank's stages among `recompute` (stages of equal compute)."""
        p, v, m = spec.pipeline_ranks(case.world), spec.chunks, spec.micro_batches
        stretch = case.side_by_side_stretch()
        replay_s = (m - 1) * case.facts["ops"] * case.op_s * stretch / p
        notes = [f"pipeline: {m} micro-batches replay the rank's ops: {replay_s * 1e3:.2f} ms of per-op overhead "
                 f"beyond the whole batch's"] if m > 1 else []
        if not spec.recompute:
            return replay_s, notes
        weights = stage_weights(spec, case)
        recomputed = max(sum(weights[s] for s in range(rank, p * v, p) if s in spec.recompute) for rank in range(p))
        extra_s = recomputed * case.alone_s * forward_share(case.facts) * stretch
        notes.append(f"pipeline: recompute: {recomputed:.0%} of the model's forward again in the busiest rank's "
                     f"backward, {extra_s * 1e3:.2f} ms")
        return replay_s + extra_s, notes

    def local_comm(self, spec: PipelineSpec, case: LocalCase, step: LocalStep) -> LocalComm:
        """The bubble, the transfers between stages and torch's runtime, as waiting: torch's action order
        (GPipe, 1F1B, interleaved 1F1B, interleaved zero-bubble; predict/schedule_sim.py) played out with the
        rank's forward and backward split evenly over its stages and micro-batches (stages of equal compute),
        each action taking the calibrated runtime cost per action more (calibrate's [pipeline] probe, where the
        calibration has it), and each activation or gradient reaching the next stage one calibrated p2p
        message later (batch / m x seq x hidden fp32, a GPT's sizes from its config); the busiest rank's
        step beyond its compute."""
        p, m, v = spec.pipeline_ranks(case.world), spec.micro_batches, spec.chunks
        transfer_s, notes = stage_transfer_s(spec, case)
        action_s, runtime_notes = runtime_action_s(case, p)
        split_s, split_notes = split_backward_extra_s(spec, case)
        orders = (single_stage_orders(spec.schedule, p, m) if v == 1
                  else interleaved_orders(spec.schedule, p, m, v))
        # the step's forward and backward are the busiest rank's: a stage's part of them is its weight over that
        # rank's, per micro-batch
        weights = stage_weights(spec, case)
        busiest_share = busiest_rank_share(weights, p)
        seconds = action_seconds(step.forward_s / m, step.backward_s / m, action_s, split_s,
                                 [w / busiest_share for w in weights])
        timeline = simulate(orders, seconds, p * v, transfer_s)
        # the rank's compute as priced outside (local.py): what the runtime and the split backward add is waiting
        compute_s = [timeline.busy_s[r] - len(orders[r]) * action_s
                     - sum(split_s for kind, stage, _ in orders[r] if kind == "I" and stage > 0) for r in range(p)]
        busiest = max(range(p), key=lambda r: compute_s[r])
        wait_s = timeline.makespan_s - compute_s[busiest]
        notes += runtime_notes + split_notes
        notes.append(f"pipeline: {spec.schedule}'s order (torch's) played out: {wait_s * 1e3:.2f} ms a step beyond "
                     f"the busiest rank's compute ({len(orders[busiest])} actions)")
        if spec.dp > 1:
            notes.append("pipeline dp > 1: the replicas' gradient all-reduce is not priced on this machine")
        return LocalComm(wait_s, notes=notes)


def runtime_action_s(case: LocalCase, ranks: int) -> tuple[float, list[str]]:
    """What torch's pipelining runtime costs per schedule action beyond its compute (calibrate's [pipeline]
    probe at the pipeline's ranks); 0 for a calibration without it, and said."""
    probe = machine_probe(case.profile, "pipeline", ranks)
    if probe is None or probe.action_s is None:
        return 0.0, ["pipeline: the calibration has no [pipeline] probe: torch's runtime per action is not priced"]
    return float(probe.action_s), [f"pipeline: torch's runtime {probe.action_s * 1e3:.2f} ms per action (probe)"]


def split_backward_extra_s(spec: PipelineSpec, case: LocalCase) -> tuple[float, list[str]]:
    """Zero-bubble's input-gradient pass on a stage that has one (all but the first) walks the autograd graph
    and its weight pass calls autograd per parameter group: per stage and micro-batch, the calibrated extra
    per op (calibrate's [pipeline] probe) x the stage's ops (1/(p v) of the model's); 0 for other schedules
    and for a calibration without the figure, said."""
    if spec.schedule != "zero-bubble":
        return 0.0, []
    probe = machine_probe(case.profile, "pipeline", spec.pipeline_ranks(case.world))
    if probe is None or probe.split_backward_op_s is None:
        return 0.0, ["pipeline: zero-bubble's split backward priced as the plain backward's halves (the calibration "
                     "has no split_backward_op_s)"]
    extra_s = float(probe.split_backward_op_s) * case.facts["ops"] / (spec.pipeline_ranks(case.world) * spec.chunks)
    return extra_s, [f"pipeline: zero-bubble's split backward {extra_s * 1e3:.2f} ms more per stage and micro-batch "
                     f"(probe)"]


def action_seconds(forward_s: float, backward_s: float, overhead_s: float = 0.0, split_s: float = 0.0,
                   stage_parts: Sequence[float] | None = None) -> Callable[[Action], float]:
    """An action's seconds from one stage's forward and backward of one micro-batch, plus the runtime's
    `overhead_s` per action: zero-bubble's input- and weight-gradient halves each half the backward, the input
    pass `split_s` more (its walks of the autograd graph), but on the first stage, whose input needs no
    gradient, torch runs the whole backward as the W (stage.py backward_weight_one_chunk). `stage_parts`: stage
    s computes that part of `forward_s` and `backward_s` (stages of unequal size; all 1 by default)."""
    def seconds(action: Action) -> float:
        kind, stage, _ = action
        part = 1.0 if stage_parts is None else stage_parts[stage]
        if kind == "F":
            return forward_s * part + overhead_s
        if kind == "B":
            return backward_s * part + overhead_s
        if stage == 0:
            return (0.0 if kind == "I" else backward_s * part) + overhead_s
        return backward_s * part / 2 + overhead_s + (split_s if kind == "I" else 0.0)

    return seconds


def stage_transfer_s(spec: PipelineSpec, case: LocalCase) -> tuple[float, list[str]]:
    """One micro-batch's activations (or their gradient) from a stage to the next: a calibrated p2p message
    (the emulated link's time where slower); 0 where the workload's config does not give a GPT's sizes."""
    sizes = gpt_sizes(case.workload)
    if sizes is None:
        return 0.0, ["pipeline: the workload's sizes are not in its config: the sends between stages are not priced"]
    payload_bytes = sizes[1] / spec.dp / spec.micro_batches * 4
    transfer_s = message_s(case.profile, "p2p", payload_bytes, 2, case.link)
    return transfer_s, [f"pipeline: a stage's send {payload_bytes / 1e3:.0f} kB, {transfer_s * 1e3:.2f} ms"]


def stage_weights(spec: PipelineSpec, case: LocalCase) -> list[float]:
    """Each stage's part of the model's compute: for a GPT whose config gives its sizes, its layers' share of
    the forward FLOPs, cut as the runtime cuts the GPT (spec.cuts over the embedding, the blocks and the head):
    the embedding none, a block its weight GEMMs and attention (24 h^2 + 4 s h a token), the head its logits
    GEMM (2 h V a token; measured: the last of 2 stages computed 2.0-3.3 ms a step more than the first, 4-7%,
    in 10 of 11 runs of a GPT x2 m4). Equal parts elsewhere (a model source's stages are cut to balance their
    FLOPs already)."""
    stages = spec.pipeline_ranks(case.world) * spec.chunks
    flops = gpt_layer_flops(case.workload)
    if flops is None:
        return [1.0 / stages] * stages
    per_stage = [sum(flops[a:b]) for a, b in stage_ranges(spec.cuts(len(flops) - 2, stages // spec.chunks),
                                                         len(flops))]
    return [f / sum(per_stage) for f in per_stage]


def gpt_layer_flops(workload: dict) -> list[float] | None:
    """Forward FLOPs a token of a GPT's pipeline layers (embedding, blocks, final norm + head), from its config;
    None for a model source's (`name` with a colon) or a config without the sizes."""
    if ":" in str(workload.get("name", "")):
        return None
    try:
        hidden, seq, vocab, layers = (int(workload[k]) for k in ("hidden", "seq_len", "vocab_size", "layers"))
    except (KeyError, TypeError, ValueError):
        return None
    model = ModelSpec(hidden=hidden, heads=int(workload.get("heads", 1)), layers=layers, seq=seq, vocab=vocab,
                      global_batch=1)
    block = model.dense_flops_per_token + 4 * seq * hidden  # + QK^T and AV
    return [0.0, *[float(block)] * layers, 2.0 * hidden * vocab]


def busiest_rank_share(weights: Sequence[float], ranks: int) -> float:
    """The largest part of the model one rank holds (rank r: stages r, r + p, ...)."""
    return max(sum(weights[r::ranks]) for r in range(ranks))
