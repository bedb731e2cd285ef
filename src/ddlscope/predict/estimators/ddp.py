"""`ddp`: bucketed all-reduce overlapped with backward; compression hooks and bucket plans (MG-WFBP)."""

from __future__ import annotations

import dataclasses
import math

from ddlscope.predict import collectives as coll
from ddlscope.predict import strategies as pst
from ddlscope.predict.estimators import ESTIMATORS
from ddlscope.predict.estimators.base import (
    KNOB_NOTE_PREFIX, ClusterCase, Estimator, LocalCase, LocalComm, LocalStep, split_slowdowns)
from ddlscope.calibrate.model import emulated_s, interpolate_linear, machine_probe, message_s, required
from ddlscope.specs import bucketing as plans
from ddlscope.specs.strategies.ddp import GATHERED_HOOKS, DDPSpec

# DDP's communication counts as slow (worth compressing or re-bucketing) when this much of it is exposed
# against the step's compute.
SLOW_EXPOSED_FRACTION = 0.1
# The knobs advise prices on a slow network: each hook with its defaults, and the bucket plans.
KNOB_VARIANTS: tuple[dict[str, object], ...] = (
    {"comm_hook": "fp16"}, {"comm_hook": "bf16"}, {"comm_hook": "powersgd", "powersgd_rank": 4},
    {"comm_hook": "topk"}, {"comm_hook": "qsgd"}, {"comm_hook": "minmax8"},
    {"buckets": "per_layer"}, {"buckets": "mgwfbp"})

# Passes over the fp32 gradient to encode a bucket (casts, abs/top-k, norms, rounding, packing), as in
# predict/strategies.py:compressed_ddp.
ENCODE_PASSES = {"none": 0, "fp16": 2, "bf16": 2, "powersgd": 4, "topk": 4, "qsgd": 6, "minmax8": 4}


@ESTIMATORS.register(DDPSpec)
class DDPEstimator(Estimator):
    def cluster(self, spec: DDPSpec, case: ClusterCase) -> pst.StrategyEstimate:
        if spec.comm_hook != "none":
            return pst.compressed_ddp(case.workload, case.cluster, spec.comm_hook, ratio=spec.topk_ratio,
                                      rank=spec.powersgd_rank, bucket_mb=spec.bucket_mb, levels=spec.qsgd_levels)
        plain = pst.ddp(case.workload, case.cluster, bucket_mb=spec.bucket_mb,
                        slowdowns=split_slowdowns(spec, case))  # batch_split: specs/strategies/batching.py
        if spec.buckets == "size":
            return plain
        return _with_plan(plain, cluster_plan(spec, case))

    def cluster_notes(self, spec: DDPSpec, case: ClusterCase) -> list[str]:
        notes = []
        if spec.buckets != "size" and spec.comm_hook == "none":
            plan = cluster_plan(spec, case)
            notes.append(f"{spec.buckets} buckets: {len(plan.buckets)} over {len(plan.layers)} equal layers, "
                         f"predicted exposed communication {plan.exposed_s * 1e3:.2f} ms (MG-WFBP's model)")
        mine = self.cluster(spec, case)
        if mine.exposed_comm_s > SLOW_EXPOSED_FRACTION * mine.compute_s:
            notes.append(knob_advice(spec, case, mine))
        return notes

    def cluster_memory(self, spec: DDPSpec, case: ClusterCase) -> tuple[float, float | None]:
        return case.replicated_state_bytes + 2 * spec.bucket_mb * 2**20 + case.activation_bytes, None

    def communication_buffer_bytes(self, spec: DDPSpec, param_bytes: float, largest_unit_bytes: float) -> float:
        return 2 * spec.bucket_mb * 2**20  # the gradient buckets: flat copies being reduced

    def transformer_layout(self, spec: DDPSpec, workers: int) -> dict[str, object] | None:
        # plain DDP only: the step model has no compression hooks or bucket plans
        if spec.comm_hook != "none" or spec.buckets != "size":
            return None
        return {"dp": workers, "zero": 0, "bucket_mb": spec.bucket_mb}

    def local_comm(self, spec: DDPSpec, case: LocalCase, step: LocalStep) -> LocalComm:
        """The calibrated DDP cost at this model size (hooks, bucket copies, its all-reduces on this
        machine), or, where an emulated link is slower, the smallest model's cost + the link's time for
        each bucket's all-reduce. Without a DDP probe: the all-reduces from the collective table.

        The probe times whole synchronised steps at this world size on these cores, so it holds the
        ranks' wait for each other (and the turn-taking for a core of its own small compute only).

        A compression hook sends `payload_fraction` of the bytes (all-gathered for top-k, QSGD and
        min-max 8-bit, each rank then decoding every rank's message) and adds its encode passes over the
        gradient at the calibrated memory bandwidth. PowerSGD's share is taken as one half (its factors
        and the uncompressed vectors): a rough figure, noted.
        """
        # ddlscope passes bucket_cap_mb explicitly, so torch does not use its 1 MiB first bucket.
        param_bytes = case.param_bytes
        fraction = spec.payload_fraction()
        notes = [] if fraction is not None else ["powersgd: payload taken as half the gradient (shape-dependent)"]
        sent_bytes = param_bytes * (fraction if fraction is not None else 0.5)
        kind = "all_gather" if spec.comm_hook in GATHERED_HOOKS else "all_reduce"
        codec_s = ENCODE_PASSES[spec.comm_hook] * param_bytes / case.memory_bandwidth_bytes_per_s
        if kind == "all_gather":
            codec_s += case.world * (sent_bytes + 2 * param_bytes) / case.memory_bandwidth_bytes_per_s
        buckets = max(1, math.ceil(param_bytes / (spec.bucket_mb * 2**20)))
        probe = machine_probe(case.profile, "ddp", case.world)
        if not probe:
            return LocalComm(codec_s + buckets * message_s(case.profile, kind, sent_bytes / buckets, case.world,
                                                           case.link), notes=notes)
        overhead_s = required(probe.overhead_s, "ddp overhead_s")
        machine_s = interpolate_linear(required(probe.model_bytes, "ddp model_bytes"), overhead_s, sent_bytes)
        if case.link is not None:
            machine_s = max(machine_s, float(overhead_s[0])
                            + buckets * emulated_s(case.link, kind, sent_bytes / buckets, case.world))
        return LocalComm(machine_s + codec_s, holds_sync_wait=True, notes=notes)


def cluster_plan(spec: DDPSpec, case: ClusterCase) -> plans.BucketPlan:
    """MG-WFBP (or one bucket per layer) over the workload's layers taken as equal, with the cluster's
    all-reduce as alpha-beta: alpha the latency of an empty all-reduce, beta its time per byte."""
    w, c = case.workload, case.cluster
    n, g = c.n_gpus, c.gpus_per_node
    grad_bytes = w.params * w.grad_bytes_per_param
    latency = float(coll.all_reduce_s(0.0, n, min(n, g), c.node))
    total = float(coll.all_reduce_s(grad_bytes, n, min(n, g), c.node))
    link = plans.AlphaBeta(latency, (total - latency) / grad_bytes if grad_bytes else 0.0)
    backward_s = w.backward_fraction * pst.compute_s(w, c)
    layers = max(int(w.layers), 1)
    equal = [plans.Layer(str(i), backward_s / layers, int(grad_bytes / layers)) for i in range(layers)]
    return plans.optimal_plan(equal, link) if spec.buckets == "mgwfbp" else plans.per_layer_plan(equal, link)


def _with_plan(plain: pst.StrategyEstimate, plan: plans.BucketPlan) -> pst.StrategyEstimate:
    """DDP's estimate with the plan's exposed communication in place of the size buckets'."""
    return dataclasses.replace(plain, step_s=plain.step_s - plain.exposed_comm_s + plan.exposed_s,
                               exposed_comm_s=plan.exposed_s)


def knob_advice(spec: DDPSpec, case: ClusterCase, mine: pst.StrategyEstimate) -> str:
    """On a slow network: the step time of each compression hook and bucket plan, the best first."""
    priced = []
    for knobs in KNOB_VARIANTS:
        variant = spec.model_copy(update={"comm_hook": "none", "buckets": "size", **knobs})
        label = ", ".join(f"{k}={v}" for k, v in knobs.items())
        priced.append((float(DDPEstimator().cluster(variant, case).step_s), label))
    priced.sort()
    listed = "; ".join(f"{label} {step * 1e3:.3g} ms" for step, label in priced)
    best_s, best = priced[0]
    verdict = (f"{best} would cut the step to {best_s / mine.step_s:.0%}" if best_s < mine.step_s
               else "none beats the current knobs")
    return (f"{KNOB_NOTE_PREFIX}communication is slow here ({mine.exposed_comm_s * 1e3:.3g} ms exposed against "
            f"{mine.compute_s * 1e3:.3g} ms compute, step {mine.step_s * 1e3:.3g} ms): {listed}; {verdict} "
            "(compression's accuracy cost is not in these times: see `ddlscope study dataparallel`)")
