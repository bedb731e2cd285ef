"""`ddp`: bucketed all-reduce overlapped with backward; compression hooks and bucket plans (MG-WFBP)."""

from __future__ import annotations

import dataclasses
import math

from typing import Sequence

from ddlscope.predict import collectives as coll
from ddlscope.predict import strategies as pst
from ddlscope.predict.catalogue import Cluster
from ddlscope.predict.estimators import ESTIMATORS
from ddlscope.predict.estimators.base import (
    KNOB_NOTE_PREFIX, ClusterCase, Estimator, LocalCase, LocalComm, LocalStep, split_slowdowns)
from ddlscope.calibrate.model import (collective_fit, interpolate_linear, machine_probe, measured_message_s,
                                     message_s, required)
from ddlscope.specs import ConfigError
from ddlscope.specs import bucketing as plans
from ddlscope.specs.strategies.ddp import GATHERED_HOOKS, QSGD_CHUNK, DDPSpec, qsgd_code_bits

# DDP's communication counts as slow (worth compressing or re-bucketing) when this much of it is exposed
# against the step's compute.
SLOW_EXPOSED_FRACTION = 0.1
# The knobs advise prices on a slow network: each hook with its defaults, and the bucket plans.
KNOB_VARIANTS: tuple[dict[str, object], ...] = (
    {"comm_hook": "fp16"}, {"comm_hook": "bf16"}, {"comm_hook": "powersgd", "powersgd_rank": 4},
    {"comm_hook": "topk"}, {"comm_hook": "qsgd"}, {"comm_hook": "minmax8"},
    {"buckets": "per_layer"}, {"buckets": "mgwfbp"})

# Passes over the fp32 gradient to encode a bucket (casts, abs/top-k, norms, rounding, packing), at cluster
# scale (compressed_ddp) and on this machine (DDPEstimator.local_comm).
ENCODE_PASSES = {"none": 0, "fp16": 2, "bf16": 2, "powersgd": 4, "topk": 4, "qsgd": 6, "minmax8": 4}


def ddp(workload: pst.Workload, cluster: Cluster, bucket_mb: float = 25.0, algorithm: coll.Algorithm = "auto",
        jitter_cv: float = 0.0, slowdowns: Sequence[float] | None = None,
        grad_bytes_per_param: float | None = None, extra_compute_s: float = 0.0,
        name: str = "ddp") -> pst.StrategyEstimate:
    """Bucketed all-reduce of the gradients, each bucket launched as backward fills it (PyTorch DDP)."""
    n, g = cluster.n_gpus, cluster.gpus_per_node
    c = pst.compute_s(workload, cluster) * float(pst.worker_slowdowns(n, slowdowns).max())
    backward = workload.backward_fraction * c
    grad_bytes = workload.params * (grad_bytes_per_param or workload.grad_bytes_per_param)
    total = float(coll.all_reduce_s(grad_bytes, n, min(n, g), cluster.node, algorithm))
    latency = float(coll.all_reduce_s(0.0, n, min(n, g), cluster.node, algorithm))
    buckets = max(1, math.ceil(grad_bytes / (bucket_mb * 1e6)))
    exposed = float(coll.bucketed_overlap_exposed_s(total, latency, buckets, backward))
    wait = pst.straggler_wait_s(c, n, jitter_cv)
    step = c + extra_compute_s + exposed + wait
    mem = (workload.params * workload.state_bytes_per_param + 2 * bucket_mb * 1e6
           + workload.activation_bytes_per_sample * workload.batch_per_worker)
    return pst.StrategyEstimate(name, n, step, c + extra_compute_s, total, exposed, mem,
                                n * workload.batch_per_worker, pst.single_samples_per_s(workload, cluster))


def compressed_ddp(workload: pst.Workload, cluster: Cluster, method: str = "fp16", ratio: float = 0.01,
                   rank: int = 4, bucket_mb: float = 25.0, levels: int = 4) -> pst.StrategyEstimate:
    """DDP with gradient compression: fewer bytes on the wire, some compute to encode/decode.

    fp16 / bf16: half the bytes, one pass over the gradients. top-k (ratio k/n):
    values + int32 indices, all-gathered (sparse sums do not add up in place),
    selection costs a few passes. PowerSGD (rank r, Vogels et al. 2019): each
    d x d gradient becomes two d x r factors, all-reduced, at 4 d^2 r FLOPs
    per matrix. qsgd (s levels) and minmax8 (ByteGrad): codes of 2-8 bits per
    entry, all-gathered, and every rank decodes all n messages (n passes over
    the gradient): cheap on the wire, costly to decode at large n.
    """
    n, g = cluster.n_gpus, cluster.gpus_per_node
    dev = cluster.device
    mem_bw = dev.memory_bandwidth_bytes_per_s * dev.efficiency.memory_fraction
    p = workload.params
    if method in ("fp16", "bf16"):
        return ddp(workload, cluster, bucket_mb, grad_bytes_per_param=2.0,
                   extra_compute_s=ENCODE_PASSES[method] * 4 * p / mem_bw, name=f"ddp-{method}")
    if method in GATHERED_HOOKS:
        if method == "topk" and not 0 < ratio <= 1:
            raise ConfigError(f"ratio = {ratio}: must be in (0, 1]")
        if method == "qsgd" and not 1 <= levels <= 127:
            raise ConfigError(f"levels = {levels}: must be in 1..127")
        bytes_per_param = {"topk": ratio * 8.0, "qsgd": qsgd_code_bits(levels) / 8 + 4 / QSGD_CHUNK,
                           "minmax8": 1.0}[method]
        base = ddp(workload, cluster, bucket_mb, grad_bytes_per_param=1e-12, name=f"ddp-{method}")
        gathered = n * bytes_per_param * p  # every rank ends with everyone's messages
        comm = float(coll.all_gather_s(gathered, n, min(n, g), cluster.node))
        # encode: a few passes over the fp32 gradient; decode: every rank reads all n messages and adds them
        codec = ENCODE_PASSES[method] * 4 * p / mem_bw + n * (bytes_per_param + 8.0) * p / mem_bw
        step = base.compute_s + codec + comm  # the encoders need whole buckets: modelled as not overlapping
        return pst.StrategyEstimate(f"ddp-{method}", n, step, base.compute_s + codec, comm, comm,
                                    base.memory_bytes_per_gpu + 4 * p, n * workload.batch_per_worker,
                                    pst.single_samples_per_s(workload, cluster))
    if method == "powersgd":
        if rank < 1:
            raise ConfigError(f"rank = {rank}: must be >= 1")
        side = math.sqrt(p / workload.layers)
        factor_bytes_per_param = 4.0 * 2 * side * rank / (side * side)
        extra = 4 * side * side * rank * workload.layers / (dev.peak("fp32") * 0.5)
        return ddp(workload, cluster, bucket_mb, grad_bytes_per_param=factor_bytes_per_param, extra_compute_s=extra,
                   name=f"ddp-powersgd{rank}")
    raise ConfigError(f"method = {method!r}: allowed: fp16, bf16, topk, qsgd, minmax8, powersgd")


@ESTIMATORS.register(DDPSpec)
class DDPEstimator(Estimator):
    def cluster(self, spec: DDPSpec, case: ClusterCase) -> pst.StrategyEstimate:
        if spec.comm_hook != "none":
            return compressed_ddp(case.workload, case.cluster, spec.comm_hook, ratio=spec.topk_ratio,
                                  rank=spec.powersgd_rank, bucket_mb=spec.bucket_mb, levels=spec.qsgd_levels)
        plain = ddp(case.workload, case.cluster, bucket_mb=spec.bucket_mb,
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
            # The emulated link waits out its time from each message's launch, the real transfer inside it
            # (strategies/comm.py CommRecorder): of the smallest model's cost, its own all-reduce is hidden
            # under the link's time, and only the hooks' and copies' part is added to each bucket's message.
            # At 4 ranks on 2 cores that all-reduce alone is ~3-9 ms (the collective table).
            hidden_s = measured_message_s(collective_fit(case.profile, "all_reduce", case.world),
                                          float(required(probe.model_bytes, "ddp model_bytes")[0]))
            machine_s = max(machine_s, max(float(overhead_s[0]) - hidden_s, 0.0)
                            + buckets * message_s(case.profile, kind, sent_bytes / buckets, case.world, case.link))
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
