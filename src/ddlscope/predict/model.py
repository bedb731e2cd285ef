"""One training step of a GPT under TP x PP x DP (+ ZeRO, SP, recompute, interleaving).

`evaluate` is the whole model as array arithmetic: every argument of the
parallel configuration is a numpy array, one element per configuration, so
the planner scores thousands at once and `predict` scores one through the
same code (they agree to the last bit).

The step, for the slowest pipeline stage (first or last: they carry the
embedding and the logits on top of their share of layers):

    t_stage   = per micro-batch forward + backward of the stage's layers
                (+ recomputation) + tensor-parallel collectives (not
                overlapped, as in Megatron-LM) + pipeline sends/receives
                + ZeRO-2/3 traffic the prefetch/buckets could not hide
    pipeline  = (m + (p - 1) / v) t_stage        m micro-batches, v chunks per stage
    step      = pipeline + exposed data-parallel gradient sync
                + optimizer step + tied-embedding sync (p > 1)

Rank placement follows Megatron-LM: tensor-parallel ranks are adjacent (inside
a node when tp <= GPUs per node), data-parallel ranks tp apart, pipeline
stages tp x dp apart.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Iterable

import numpy as np

from ddlscope.predict import collectives as coll
from ddlscope.predict import compute, memory
from ddlscope.predict.catalogue import Cluster
from ddlscope.predict.specs import RECOMPUTE_CODES, SCHEDULE_CODES, ModelSpec, ParallelSpec

GB = 1e9


@dataclass
class ConfigArrays:
    """Parallel configurations as parallel arrays (codes: recompute 0/1/2 = none/selective/full,
    schedule 0/1 = 1f1b/gpipe)."""

    tp: np.ndarray
    pp: np.ndarray
    dp: np.ndarray
    micro_batch: np.ndarray
    zero: np.ndarray
    recompute: np.ndarray
    sequence_parallel: np.ndarray
    interleave: np.ndarray
    schedule: np.ndarray
    overlap_grad_reduce: bool = True
    bucket_mb: float = 25.0

    @classmethod
    def from_specs(cls, specs: Iterable[ParallelSpec]) -> "ConfigArrays":
        specs = list(specs)
        first = specs[0]
        col = lambda f: np.array([f(s) for s in specs])  # noqa: E731
        return cls(tp=col(lambda s: s.tp), pp=col(lambda s: s.pp), dp=col(lambda s: s.dp),
                   micro_batch=col(lambda s: s.micro_batch), zero=col(lambda s: s.zero),
                   recompute=col(lambda s: RECOMPUTE_CODES[s.recompute]),
                   sequence_parallel=col(lambda s: bool(s.sequence_parallel)),
                   interleave=col(lambda s: s.interleave), schedule=col(lambda s: SCHEDULE_CODES[s.schedule]),
                   overlap_grad_reduce=first.overlap_grad_reduce, bucket_mb=first.bucket_mb)

    def __len__(self) -> int:
        return len(self.tp)

    def take(self, index) -> "ConfigArrays":
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in out.items():
            if isinstance(value, np.ndarray):
                out[name] = value[index]
        return ConfigArrays(**out)

    def spec(self, i: int) -> ParallelSpec:
        recompute = {v: k for k, v in RECOMPUTE_CODES.items()}[int(self.recompute[i])]
        schedule = {v: k for k, v in SCHEDULE_CODES.items()}[int(self.schedule[i])]
        return ParallelSpec(tp=int(self.tp[i]), pp=int(self.pp[i]), dp=int(self.dp[i]),
                            micro_batch=int(self.micro_batch[i]), zero=int(self.zero[i]), recompute=recompute,
                            sequence_parallel=bool(self.sequence_parallel[i]), interleave=int(self.interleave[i]),
                            schedule=schedule, overlap_grad_reduce=self.overlap_grad_reduce,
                            bucket_mb=self.bucket_mb)


def valid_mask(model: ModelSpec, cluster: Cluster, c: ConfigArrays) -> np.ndarray:
    """Configurations Megatron-LM-style training can run (same rules as `validate`)."""
    t, p, d, b, v = c.tp, c.pp, c.dp, c.micro_batch, c.interleave
    ok = (t * p * d == cluster.n_gpus) & (t >= 1) & (p >= 1) & (d >= 1) & (b >= 1) & (v >= 1)
    ok &= (model.heads % t == 0) & (model.layers % p == 0) & (model.global_batch % (d * b) == 0)
    ok &= (model.layers % (p * v) == 0)
    m = model.global_batch // np.maximum(d * b, 1)
    # Interleaving needs a pipeline and (in Megatron-LM) m divisible by p.
    ok &= (v == 1) | ((p > 1) & (m % p == 0) & (c.schedule == 0))
    ok &= ~c.sequence_parallel | (t > 1)
    ok &= (c.zero >= 0) & (c.zero <= 3)
    return ok


def evaluate(model: ModelSpec, cluster: Cluster, c: ConfigArrays) -> dict[str, np.ndarray]:
    """Step time, its breakdown, memory, energy and cost for every configuration in `c`."""
    dev, node, g = cluster.device, cluster.node, cluster.gpus_per_node
    peak = dev.peak(model.dtype)
    t, p, d = (np.asarray(x, dtype=float) for x in (c.tp, c.pp, c.dp))
    b, v = np.asarray(c.micro_batch, dtype=float), np.asarray(c.interleave, dtype=float)
    sp, code, zero = np.asarray(c.sequence_parallel, dtype=bool), np.asarray(c.recompute), np.asarray(c.zero)
    s, h, V = model.seq, model.hidden, model.vocab
    m = model.global_batch / (d * b)
    lps = model.layers / p
    single_stage = p == 1

    # -- one layer, one micro-batch, one GPU
    gemm_f, gemm_b = compute.layer_gemm_times_s(model, b, t, dev, peak)
    attn_f, attn_b = compute.attention_core_times_s(model, b, t, dev, peak)
    elem_f, elem_b = compute.layer_elementwise_times_s(model, b, t, sp, dev)
    gap_f, gap_b = compute.kernel_gaps_s(dev)
    layer_f = gemm_f + attn_f + elem_f + gap_f
    layer_b = gemm_b + attn_b + elem_b + gap_b
    layer_recompute = np.where(code == 2, layer_f, np.where(code == 1, attn_f, 0.0))

    # -- tensor-parallel collectives: Megatron's f/g pairs, two per layer each way;
    #    with SP each all-reduce becomes a reduce-scatter + all-gather of the same volume.
    act_bytes = b * s * h * model.activation_bytes
    tp_local = coll.group_members_per_node(t, 1, g)
    tp_pair = np.where(sp, coll.reduce_scatter_s(act_bytes, t, tp_local, node)
                       + coll.all_gather_s(act_bytes, t, tp_local, node),
                       coll.all_reduce_s(act_bytes, t, tp_local, node))
    tp_layer_f = 2 * tp_pair
    tp_layer_b = 2 * tp_pair + np.where(code == 2, tp_layer_f, 0.0)

    # -- pipeline sends: each chunk boundary, forward activation and backward gradient;
    #    Megatron's scatter/gather splits the message over the tp ranks.
    stages_across_nodes = t * d >= g
    p2p_one = coll.p2p_s(act_bytes / t, stages_across_nodes, node)
    p2p_mb = np.where(single_stage, 0.0, 2 * v * p2p_one)

    # -- parameters per GPU of the first and last stage (embedding tied: a copy on the last stage)
    layer_params_here = lps * model.layer_params / t
    embed_params_here = V * h / t
    first_params = layer_params_here + embed_params_here + s * h + np.where(single_stage, 2 * h, 0.0)
    last_params = np.where(single_stage, first_params, layer_params_here + embed_params_here + 2 * h)

    # -- compute per micro-batch per stage
    emb_f, emb_b = compute.embedding_times_s(model, b, dev)
    out_f, out_b = compute.output_layer_times_s(model, b, t, dev, peak)
    first_compute_f = lps * layer_f + emb_f + np.where(single_stage, out_f, 0.0)
    first_compute_b = lps * (layer_b + layer_recompute) + emb_b + np.where(single_stage, out_b, 0.0)
    last_compute_f = lps * layer_f + out_f + np.where(single_stage, emb_f, 0.0)
    last_compute_b = lps * (layer_b + layer_recompute) + out_b + np.where(single_stage, emb_b, 0.0)
    # vocab-parallel embedding output (forward) and logits input gradient (backward): one pair each
    first_tp = lps * (tp_layer_f + tp_layer_b) + tp_pair + np.where(single_stage, tp_pair, 0.0)
    last_tp = lps * (tp_layer_f + tp_layer_b) + tp_pair + np.where(single_stage, tp_pair, 0.0)

    # -- ZeRO traffic inside the step (per micro-batch) on the data-parallel group
    dp_local = coll.group_members_per_node(d, t, g)

    def zero_per_microbatch_s(params, compute_f, compute_b):
        shard_bytes = params * memory.WEIGHT_BYTES_PER_PARAM
        gather = coll.all_gather_s(shard_bytes, d, dp_local, node)
        scatter = coll.reduce_scatter_s(shard_bytes, d, dp_local, node)
        # ZeRO-3 / FSDP: prefetch hides each layer's gather behind the previous layer's compute,
        # except the first unit's; backward gathers again and reduce-scatters gradients.
        stage3 = (np.maximum(gather - compute_f, 0.0) + gather / (lps + 1)
                  + np.maximum(gather + scatter - compute_b, 0.0))
        # ZeRO-2: gradients reduce-scattered in buckets behind every micro-batch's backward.
        latency = coll.reduce_scatter_s(0.0, d, dp_local, node)
        stage2 = coll.bucketed_overlap_exposed_s(scatter, latency, np.ceil(shard_bytes / (c.bucket_mb * 1e6)),
                                                 compute_b)
        return np.where(zero == 3, stage3, np.where(zero == 2, stage2, 0.0))

    first_zero = zero_per_microbatch_s(first_params, first_compute_f, first_compute_b)
    last_zero = zero_per_microbatch_s(last_params, last_compute_f, last_compute_b)

    first_stage = first_compute_f + first_compute_b + first_tp + p2p_mb + first_zero
    last_stage = last_compute_f + last_compute_b + last_tp + p2p_mb + last_zero
    last_is_slowest = last_stage > first_stage
    t_stage = np.maximum(first_stage, last_stage)
    pick = lambda first, last: np.where(last_is_slowest, last, first)  # noqa: E731

    pipeline_s = m * t_stage
    bubble_s = (p - 1) / v * t_stage

    # -- end of step: data-parallel gradient sync for what ZeRO did not already do per micro-batch
    sync_params = np.maximum(first_params, last_params)
    grad_bytes = sync_params * memory.GRAD_BYTES_PER_PARAM
    all_reduce = coll.all_reduce_s(grad_bytes, d, dp_local, node)
    all_reduce_latency = coll.all_reduce_s(0.0, d, dp_local, node)
    scatter_end = coll.reduce_scatter_s(grad_bytes, d, dp_local, node)
    scatter_latency = coll.reduce_scatter_s(0.0, d, dp_local, node)
    gather_end = coll.all_gather_s(sync_params * memory.WEIGHT_BYTES_PER_PARAM, d, dp_local, node)
    buckets = np.ceil(grad_bytes / (c.bucket_mb * 1e6))
    window = np.maximum(first_compute_b, last_compute_b)  # the last micro-batch's backward
    if c.overlap_grad_reduce:
        reduce_exposed = np.where(zero == 0,
                                  coll.bucketed_overlap_exposed_s(all_reduce, all_reduce_latency, buckets, window),
                                  coll.bucketed_overlap_exposed_s(scatter_end, scatter_latency, buckets, window))
    else:
        reduce_exposed = np.where(zero == 0, all_reduce, scatter_end)
    dp_sync_s = np.where(zero == 0, reduce_exposed,
                         np.where(zero == 1, reduce_exposed + gather_end, np.where(zero == 2, gather_end, 0.0)))
    owned = sync_params / np.where(zero >= 1, d, 1.0)
    optimizer_s = compute.optimizer_step_s(owned, dev)
    embedding_sync_s = np.where(single_stage, 0.0,
                                coll.all_reduce_s(embed_params_here * memory.GRAD_BYTES_PER_PARAM, 2.0,
                                                  np.where(stages_across_nodes, 1.0, 2.0), node))
    step_s = pipeline_s + bubble_s + dp_sync_s + optimizer_s + embedding_sync_s

    # -- throughput
    n_gpus = t * p * d
    hardware_flops = compute.hardware_flops_per_iteration(model, code)
    model_flops = compute.model_flops_per_iteration(model)
    tflops_per_gpu = hardware_flops / (step_s * n_gpus) / 1e12
    mfu = model_flops / (step_s * n_gpus * peak)
    hfu = hardware_flops / (step_s * n_gpus * peak)

    # -- memory on the first and last stage; the peak is the larger
    scores_stored = model.attention == "unfused"
    ffn_ratio = model.ffn / h
    per_layer = memory.activation_bytes_per_layer_coded(s, b, h, model.heads, t, sp, code, ffn_ratio, scores_stored)
    per_layer_whole = memory.activation_bytes_per_layer_coded(s, b, h, model.heads, t, sp, 0, ffn_ratio,
                                                              scores_stored)
    recompute_working_set = per_layer_whole - per_layer  # one layer rematerialised during its backward
    first_in_flight = memory.in_flight_layer_microbatches(lps, p, m, v, c.schedule)
    last_chunks = np.minimum(m * v, (v - 1) * p + 1)
    last_in_flight = np.where(np.asarray(c.schedule) == 1, lps * m, lps * last_chunks / v)
    output_act = memory.output_layer_activation_bytes(s, b, V, t)
    first_act = (per_layer * first_in_flight + recompute_working_set
                 + memory.embedding_activation_bytes(s, b, h, first_in_flight / lps)
                 + np.where(single_stage, output_act, 0.0))
    last_act = per_layer * last_in_flight + recompute_working_set + output_act
    last_act = np.where(single_stage, first_act, last_act)
    prefetch_buffers = np.where(zero == 3, 2 * model.layer_params / t * memory.WEIGHT_BYTES_PER_PARAM, 0.0)
    other = dev.framework_overhead_bytes + prefetch_buffers
    first_states = memory.model_state_bytes(first_params, d, zero)
    last_states = memory.model_state_bytes(last_params, d, zero)
    first_total = sum(first_states.values()) + first_act + other
    last_total = sum(last_states.values()) + last_act + other
    last_is_fullest = last_total > first_total
    fullest = lambda first, last: np.where(last_is_fullest, last, first)  # noqa: E731
    memory_bytes = np.maximum(first_total, last_total)

    n = np.asarray(n_gpus)
    return {
        "step_time_s": step_s,
        "tflops_per_gpu": tflops_per_gpu,
        "mfu": mfu,
        "hfu": hfu,
        "tokens_per_s_per_gpu": model.global_batch * s / step_s / n,
        "samples_per_s": model.global_batch / step_s,
        "micro_batches": m,
        "bubble_fraction": bubble_s / pipeline_s,
        "compute_s": m * pick(first_compute_f + first_compute_b, last_compute_f + last_compute_b),
        "tp_comm_s": m * pick(first_tp, last_tp),
        "pp_p2p_s": m * p2p_mb,
        "zero_comm_s": m * pick(first_zero, last_zero),
        "bubble_s": bubble_s,
        "dp_sync_s": dp_sync_s,
        "optimizer_s": optimizer_s,
        "embedding_sync_s": embedding_sync_s,
        "recompute_s": m * lps * layer_recompute,
        "memory_bytes": memory_bytes,
        "parameters_bytes": fullest(first_states["parameters"], last_states["parameters"]),
        "gradients_bytes": fullest(first_states["gradients"], last_states["gradients"]),
        "optimizer_bytes": fullest(first_states["optimizer"], last_states["optimizer"]),
        "activations_bytes": fullest(first_act, last_act),
        "other_bytes": other + 0.0 * memory_bytes,
        "fits": memory_bytes <= dev.memory_bytes,
        "energy_kwh": n * dev.power_w * step_s / 3.6e6,
        "cost_usd": n * dev.price_usd_per_hour * step_s / 3600.0,
        "spot_cost_usd": n * dev.spot_price_usd_per_hour * step_s / 3600.0,
    }


BREAKDOWN_KEYS = ("compute_s", "tp_comm_s", "pp_p2p_s", "zero_comm_s", "dp_sync_s", "embedding_sync_s",
                  "bubble_s", "optimizer_s")
