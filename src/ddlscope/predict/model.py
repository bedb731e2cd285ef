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
from typing import Any, Iterable

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
    fused_grad_accumulation: bool = False
    cp: np.ndarray | None = None  # None: 1 everywhere
    ep: np.ndarray | None = None
    grad_reduce_bytes: float = 2.0  # bytes per gradient element the data-parallel reductions carry
    fused_rope: bool = True  # rotary embedding in one fused kernel (False: eager PyTorch's three passes)
    fused_elementwise: bool = True  # norms and SwiGLU in fused kernels (False: torchtitan's eager passes)
    fsdp_version: int = 0  # ZeRO-3 as PyTorch FSDP 1 or 2 runs it (its copies on the compute stream); 0: none priced

    def __post_init__(self) -> None:
        ones = np.ones(len(self.tp), dtype=int)
        self.cp = ones if self.cp is None else np.asarray(self.cp)
        self.ep = ones if self.ep is None else np.asarray(self.ep)

    @classmethod
    def with_defaults(cls, **arrays: np.ndarray) -> "ConfigArrays":
        """Configurations of these arrays (`tp`, `pp`, `dp`, `micro_batch` at least), every knob not given
        at a value no rule of `valid_mask` refuses: ZeRO 0, no recomputation or SP, no interleaving, 1F1B."""
        default = np.zeros(len(arrays["tp"]), dtype=int)
        return cls(**{"zero": default, "recompute": default, "sequence_parallel": default.astype(bool),
                      "interleave": default + 1, "schedule": default, **arrays})

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
                   overlap_grad_reduce=first.overlap_grad_reduce, bucket_mb=first.bucket_mb,
                   fused_grad_accumulation=first.fused_grad_accumulation,
                   cp=col(lambda s: s.cp), ep=col(lambda s: s.ep), grad_reduce_bytes=first.grad_reduce_bytes,
                   fused_rope=first.fused_rope, fused_elementwise=first.fused_elementwise,
                   fsdp_version=first.fsdp_version)

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
                            bucket_mb=self.bucket_mb, fused_grad_accumulation=self.fused_grad_accumulation,
                            cp=int(self.cp[i]), ep=int(self.ep[i]), grad_reduce_bytes=int(self.grad_reduce_bytes),
                            fused_rope=self.fused_rope, fused_elementwise=self.fused_elementwise,
                            fsdp_version=self.fsdp_version)


def valid_mask(model: ModelSpec, cluster: Cluster, c: ConfigArrays) -> np.ndarray:
    """Configurations Megatron-LM-style training can run (same rules as `validate`)."""
    t, p, d, b, v, cp, ep = c.tp, c.pp, c.dp, c.micro_batch, c.interleave, c.cp, c.ep
    ok = (t * cp * p * d <= cluster.n_gpus) & (t >= 1) & (p >= 1) & (d >= 1) & (b >= 1) & (v >= 1)
    ok &= (cp >= 1) & (ep >= 1) & (model.seq % (2 * cp) == 0) & ((cp == 1) | (model.attention == "flash"))
    ok &= (ep == 1) | ((model.experts % ep == 0) & ((d * cp) % ep == 0))
    ok &= (model.heads % t == 0) & (model.kv % t == 0) & (model.layers % p == 0)
    ok &= model.global_batch % (d * b) == 0
    ok &= (model.layers % (p * v) == 0)
    m = model.global_batch // np.maximum(d * b, 1)
    # Interleaving needs a pipeline and (in Megatron-LM) m divisible by p.
    ok &= (v == 1) | ((p > 1) & (m % p == 0) & (c.schedule == 0))
    ok &= ~c.sequence_parallel | (t > 1)
    ok &= (c.zero >= 0) & (c.zero <= 3)
    return ok


@dataclass
class _Shape:
    """The configuration arrays as floats, plus what follows from them."""

    t: np.ndarray  # tensor-parallel size
    p: np.ndarray  # pipeline stages
    d: np.ndarray  # data-parallel size
    b: np.ndarray  # micro-batch
    v: np.ndarray  # chunks per stage
    sp: np.ndarray  # sequence parallel (bool)
    recompute: np.ndarray  # 0 none, 1 selective, 2 full
    zero: np.ndarray
    schedule: np.ndarray  # 0 1F1B, 1 GPipe
    m: np.ndarray  # micro-batches per step
    layers_per_stage: np.ndarray
    single_stage: np.ndarray
    c: np.ndarray  # context-parallel size
    e: np.ndarray  # expert-parallel size
    bt: np.ndarray  # micro-batch x seq / cp: the sequences' worth of tokens one rank holds (b / cp)

    @classmethod
    def of(cls, model: ModelSpec, c: ConfigArrays) -> "_Shape":
        t, p, d, b, v, cp, ep = (np.asarray(x, dtype=float)
                                 for x in (c.tp, c.pp, c.dp, c.micro_batch, c.interleave, c.cp, c.ep))
        return cls(t=t, p=p, d=d, b=b, v=v, sp=np.asarray(c.sequence_parallel, dtype=bool),
                   recompute=np.asarray(c.recompute), zero=np.asarray(c.zero), schedule=np.asarray(c.schedule),
                   m=model.global_batch / (d * b), layers_per_stage=model.layers / p, single_stage=p == 1,
                   c=cp, e=ep, bt=b / cp)


def _per_distinct(fn, *keys):
    """`fn(*keys)` evaluated once per distinct combination of the key arrays, spread back to every element.

    The kernel times depend on the micro-batch, the TP size and SP only: a few dozen combinations
    among the planner's thousands of configurations, each priced over several GEMM tile shapes.
    """
    shape = np.shape(keys[0])
    columns = [np.broadcast_to(np.asarray(k), shape).ravel().astype(np.int64) for k in keys]
    first, inverse = _distinct_rows(columns)
    distinct = [column[first].astype(float) for column in columns]
    results = fn(*distinct)
    return tuple(np.asarray(r, dtype=float)[inverse].reshape(shape) for r in results)


def _distinct_rows(columns: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(an index of each distinct row of the non-negative integer columns, each row's distinct row).

    One integer per row (mixed radix) and one sort, where the radices' product fits an int64; rows
    compared whole (slower) where it does not."""
    radices = [int(column.max(initial=0)) + 1 for column in columns]
    if float(np.prod(np.array(radices, dtype=float))) < 2.0**62:
        code = np.zeros(columns[0].shape, dtype=np.int64)
        for column, radix in zip(columns, radices):
            code = code * radix + column
        _, first, inverse = np.unique(code, return_index=True, return_inverse=True)
    else:
        _, first, inverse = np.unique(np.stack(columns, axis=1), axis=0, return_index=True, return_inverse=True)
    return first, inverse.ravel()


def _distinct_sizes(model: ModelSpec, c: ConfigArrays) -> tuple["_Shape", np.ndarray]:
    """The distinct (TP, CP, PP, DP, EP, micro-batch, SP) of the configurations, as a `_Shape` (the other
    knobs at their defaults), and each configuration's row in it.

    Every collective of the step depends on these alone: the planner's configurations share a few
    hundred of them (ZeRO stage, recomputation, interleaving and schedule multiply each), so the
    collectives are priced once per distinct row and spread back, not once per configuration."""
    columns = [np.asarray(a).astype(np.int64) for a in (c.tp, c.cp, c.pp, c.dp, c.ep, c.micro_batch,
                                                         c.sequence_parallel)]
    first, inverse = _distinct_rows(columns)
    t, cp, pp, dp, ep, b, sp = (column[first] for column in columns)
    sizes = ConfigArrays.with_defaults(tp=t, pp=pp, dp=dp, micro_batch=b, sequence_parallel=sp.astype(bool), cp=cp,
                                       ep=ep)
    return _Shape.of(model, sizes), inverse


def _kernel_times_s(model: ModelSpec, cluster: Cluster, b, t, sp, ep, peak: float,
                    rope_bytes: float = compute.ROPE_BYTES_FUSED, fused: bool = True):
    """(layer forward, layer backward, attention forward, embedding f/b, logits f/b) for one micro-batch.

    `b` is the rank's share in whole sequences (micro-batch / cp): under context parallelism each rank
    runs every GEMM and element-wise pass on seq / cp tokens and FlashAttention on 1/cp of the score blocks
    (its queries against all keys, causal work balanced by Megatron's chunk order), exactly b / cp sequences' work.
    """
    dev = cluster.device
    gemm_f, gemm_b = compute.layer_gemm_times_s(model, b, t, dev, peak, ep)
    attn_f, attn_b = compute.attention_core_times_s(model, b, t, dev, peak)
    elem_f, elem_b = compute.layer_elementwise_times_s(model, b, t, sp.astype(bool), dev, rope_bytes, fused)
    gap_f, gap_b = compute.kernel_gaps_s(dev)
    emb_f, emb_b = compute.embedding_times_s(model, b, dev)
    out_f, out_b = compute.output_layer_times_s(model, b, t, dev, peak)
    return (gemm_f + attn_f + elem_f + gap_f, gemm_b + attn_b + elem_b + gap_b, attn_f + 0.0 * b,
            attn_b + 0.0 * b, emb_f + 0.0 * b, emb_b + 0.0 * b, out_f, out_b)


def _layer_times_s(model: ModelSpec, cluster: Cluster, x: _Shape, peak: float,
                   rope_bytes: float = compute.ROPE_BYTES_FUSED, fused: bool = True):
    """(forward, backward, recomputed, attention core f/b, embedding f/b, logits f/b) seconds, one micro-batch, one GPU,
    no communication; a layer's recomputation re-runs its forward (full) or its attention core (selective)."""
    forward, backward, attn_f, attn_b, emb_f, emb_b, out_f, out_b = _per_distinct(
        lambda b, cp, t, sp, ep: _kernel_times_s(model, cluster, b / cp, t, sp, ep, peak, rope_bytes, fused),
        x.b, x.c, x.t, x.sp, x.e)
    recomputed = np.where(x.recompute == 2, forward, np.where(x.recompute == 1, attn_f, 0.0))
    return forward, backward, recomputed, (attn_f, attn_b), (emb_f, emb_b), (out_f, out_b)


def _tensor_parallel_pair_s(model: ModelSpec, cluster: Cluster, x: _Shape):
    """One of Megatron's f/g collectives on the b x s x h activation; with SP a reduce-scatter + all-gather."""
    act_bytes = x.bt * model.seq * model.hidden * model.activation_bytes
    local = coll.group_members_per_node(x.t, 1, cluster.gpus_per_node)
    node = cluster.node
    split = coll.reduce_scatter_s(act_bytes, x.t, local, node) + coll.all_gather_s(act_bytes, x.t, local, node)
    return np.where(x.sp, split, coll.all_reduce_s(act_bytes, x.t, local, node))


def _expert_all_to_all_s(model: ModelSpec, cluster: Cluster, x: _Shape):
    """One of an MoE layer's all-to-alls (dispatch or combine) over the ep group, per micro-batch.

    Each rank sends its tokens' hidden vectors to the top_k experts chosen for them (1/tp of them per TP rank
    with sequence parallelism); the ep ranks are tp x cp apart (Megatron-core's order tp, cp, ep, dp).
    Not overlapped with compute (Megatron-core's default dispatcher).
    """
    if not model.is_moe:
        return np.zeros_like(x.t)
    routed_bytes = (x.bt * model.seq * model.hidden * model.activation_bytes * model.top_k
                    / np.where(x.sp, x.t, 1.0))
    local = coll.group_members_per_node(x.e, x.t * x.c, cluster.gpus_per_node)
    return coll.all_to_all_s(routed_bytes, x.e, local, cluster.node)


def _context_ring_transfer_s(model: ModelSpec, cluster: Cluster, x: _Shape):
    """Ring-attention traffic of one layer, one micro-batch: (forward, backward) seconds on the wire.

    Each of the cp ranks passes its chunk's keys and values (its kv heads on this TP rank) around the
    ring, cp - 1 hops, while it computes attention on the chunk it has (Megatron-core overlaps them:
    `evaluate` charges what the attention does not hide); backward passes keys and values again with
    their gradients, twice the bytes. CP ranks are tp apart.
    """
    if not np.any(x.c > 1):
        return np.zeros_like(x.t), np.zeros_like(x.t)
    kv_bytes = (x.bt * model.seq * 2 * model.kv * model.head_dim / x.t) * model.activation_bytes
    across = x.t * x.c > cluster.gpus_per_node
    hops = x.c - 1
    return hops * coll.p2p_s(kv_bytes, across, cluster.node), hops * coll.p2p_s(2 * kv_bytes, across, cluster.node)


def _stage_params(model: ModelSpec, x: _Shape):
    """Parameters on one GPU of the first and of the last stage (the output layer, tied or not, on the last),
    without the experts, and the experts' parameters on one GPU (divided by TP and by EP)."""
    h = model.hidden
    layers_here = x.layers_per_stage * (model.layer_params - model.expert_params_per_layer) / x.t
    experts_here = x.layers_per_stage * model.expert_params_per_layer / (x.t * x.e)
    embedding_here = model.vocab * h / x.t
    positions = model.seq * h if model.learned_positions else 0.0
    # One stage holds the output layer too: a second table unless it is the tied embedding itself.
    own_output = 0.0 if model.tied_embeddings else embedding_here
    first = layers_here + embedding_here + positions + np.where(x.single_stage, 2 * h + own_output, 0.0)
    last = np.where(x.single_stage, first, layers_here + embedding_here + 2 * h)
    return first, last, embedding_here, experts_here


def _data_group(cluster: Cluster, x: _Shape, experts: bool = False):
    """(size, members per node) of the group that holds copies of a weight: dp x cp ranks, tp x cp apart
    ... tp apart (Megatron's order tp, cp, dp); an expert's copies are ep times fewer and further apart."""
    size = x.d * x.c / np.where(experts, x.e, 1.0)
    stride = x.t * np.where(experts, x.e, 1.0)
    return size, coll.group_members_per_node(size, stride, cluster.gpus_per_node)


def _zero_collectives_s(cluster: Cluster, x: _Shape, params, reduce_bytes: float = 2.0, fsdp_version: int = 0):
    """(all-gather of the weights, reduce-scatter of the gradients, one reduce-scatter's latency) over the
    data-parallel group, for `params` parameters on a GPU: ZeRO-2/3's traffic per micro-batch.

    Gradients reduced in a wider dtype than computed (`reduce_bytes` 4: FSDP's fp32 reduce dtype) carry that
    many bytes each, and FSDP first copies the unit's 16-bit gradients into its fp32 reduce-scatter input
    (FSDP1 casts the flat gradient on its post-backward stream): read 2 bytes, write `reduce_bytes`,
    memory-bound, on the reduce-scatter's stream (counted with it). FSDP2 (`fsdp_version` 2) copies them in on
    the compute stream instead: `compute.fsdp_copy_bytes_per_param` counts it there."""
    node, (group, local) = cluster.node, _data_group(cluster, x)
    shard_bytes = params * memory.WEIGHT_BYTES_PER_PARAM
    scatter = coll.reduce_scatter_s(params * reduce_bytes, group, local, node)
    if reduce_bytes > memory.GRAD_BYTES_PER_PARAM and fsdp_version != 2:
        scatter = scatter + compute.memory_bound_s(params * (memory.GRAD_BYTES_PER_PARAM + reduce_bytes),
                                                   cluster.device)
    return (coll.all_gather_s(shard_bytes, group, local, node), scatter,
            coll.reduce_scatter_s(0.0, group, local, node))


def _zero_in_step_s(cluster: Cluster, x: _Shape, params, collectives, compute_f, compute_b, bucket_mb: float,
                    fsdp_version: int = 0, reduce_bytes: float = 2.0):
    """ZeRO-2/3 traffic per micro-batch that compute could not hide (`collectives`: _zero_collectives_s's), and
    under PyTorch FSDP (`fsdp_version` 1 or 2) its own copies on the compute stream (compute.py)."""
    gather, scatter, latency = collectives
    shard_bytes = params * memory.WEIGHT_BYTES_PER_PARAM
    # ZeRO-3 / FSDP: prefetch hides each layer's gather behind the previous layer's compute,
    # except the first unit's; backward gathers again and reduce-scatters gradients.
    # Each overlapped collective also holds NCCL's SMs while the compute beside it runs (sm_contention_s).
    sms = cluster.device.efficiency.sms
    forward_gathers = (np.maximum(gather - compute_f, 0.0) + gather / (x.layers_per_stage + 1)
                       + coll.sm_contention_s(gather, compute_f, sms))
    copies_s = lambda gathers: compute.memory_bound_s(  # noqa: E731
        params * compute.fsdp_copy_bytes_per_param(fsdp_version, reduce_bytes, gathers), cluster.device)
    stage3 = (forward_gathers + np.maximum(gather + scatter - compute_b, 0.0)
              + coll.sm_contention_s(gather + scatter, compute_b, sms) + copies_s(2))
    # ZeRO-2: gradients reduce-scattered in buckets behind every micro-batch's backward. FSDP's SHARD_GRAD_OP
    # also gathers the parameters for every micro-batch's forward (and keeps them through its backward): its
    # weights are not whole between micro-batches, as DeepSpeed's ZeRO-2 keeps them.
    stage2 = (coll.bucketed_overlap_exposed_s(scatter, latency, np.ceil(shard_bytes / (bucket_mb * 1e6)), compute_b)
              + coll.sm_contention_s(scatter, compute_b, sms))
    if fsdp_version:
        stage2 = stage2 + forward_gathers + copies_s(1)
    return np.where(x.zero == 3, stage3, np.where(x.zero == 2, stage2, 0.0))


def _data_parallel_collectives_s(cluster: Cluster, x: _Shape, params, experts: bool = False,
                                 reduce_bytes: float = 2.0):
    """(all-reduce and reduce-scatter of the gradients, all-gather of the weights, and the first two's
    latencies) over the group holding copies of `params` parameters on a GPU: the end-of-step sync
    (`reduce_bytes` per gradient element)."""
    node, (group, local) = cluster.node, _data_group(cluster, x, experts)
    grad_bytes = params * reduce_bytes
    return (coll.all_reduce_s(grad_bytes, group, local, node), coll.reduce_scatter_s(grad_bytes, group, local, node),
            coll.all_gather_s(params * memory.WEIGHT_BYTES_PER_PARAM, group, local, node),
            coll.all_reduce_s(0.0, group, local, node), coll.reduce_scatter_s(0.0, group, local, node))


def _data_parallel_sync_s(cluster: Cluster, x: _Shape, params, collectives, backward_s, c: ConfigArrays):
    """End-of-step gradient sync left to do after the last micro-batch (what ZeRO-2/3 did not do already);
    `collectives`: _data_parallel_collectives_s's."""
    all_reduce, scatter, gather, all_reduce_latency, scatter_latency = collectives
    grad_bytes = params * c.grad_reduce_bytes
    reduce = np.where(x.zero == 0, all_reduce, scatter)
    if c.overlap_grad_reduce:  # buckets go out while the last micro-batch's backward runs
        latency = np.where(x.zero == 0, all_reduce_latency, scatter_latency)
        reduce = (coll.bucketed_overlap_exposed_s(reduce, latency, np.ceil(grad_bytes / (c.bucket_mb * 1e6)),
                                                  backward_s)
                  + coll.sm_contention_s(reduce, backward_s, cluster.device.efficiency.sms))
    # ZeRO-2 gathers the updated weights once after the step; FSDP's SHARD_GRAD_OP at the next forward instead
    zero2_gather = 0.0 if c.fsdp_version else gather
    return np.where(x.zero == 0, reduce, np.where(x.zero == 1, reduce + gather, np.where(x.zero == 2, zero2_gather,
                                                                                           0.0)))


def _collectives_s(model: ModelSpec, cluster: Cluster, x: _Shape, reduce_bytes: float = 2.0,
                   fsdp_version: int = 0) -> dict[str, Any]:
    """Every collective of the step, by name (an array, or a tuple of them for a group's several), for
    the distinct sizes of `_distinct_sizes`: they depend on the sizes, the micro-batch and SP alone."""
    g, node = cluster.gpus_per_node, cluster.node
    first_params, last_params, embedding_here, experts_here = _stage_params(model, x)
    # Megatron's scatter/gather sends 1/tp of the activation per rank, each chunk, each way
    stages_across_nodes = x.t * x.c * x.d >= g
    act_bytes = x.bt * model.seq * model.hidden * model.activation_bytes
    # and the receiving tp ranks all-gather the pieces back into the whole activation (megatron/p2p_communication.py,
    # gather_split_1d_tensor) before they use it: one all-gather over the tp group per received tensor. With
    # sequence parallelism each rank's activation is its 1/tp of the sequence already: sent as it is, no gather.
    gathered = coll.all_gather_s(act_bytes, x.t, coll.group_members_per_node(x.t, 1, g), node)
    regather = np.where((x.t > 1) & ~x.sp, gathered, 0.0)
    ring_f, ring_b = _context_ring_transfer_s(model, cluster, x)
    out = {"tp_pair": _tensor_parallel_pair_s(model, cluster, x), "a2a": _expert_all_to_all_s(model, cluster, x),
           "ring_f": ring_f, "ring_b": ring_b,
           "p2p_chunk": coll.p2p_s(act_bytes / x.t, stages_across_nodes, node) + regather,
           "embedding_sync": coll.all_reduce_s(embedding_here * memory.GRAD_BYTES_PER_PARAM, 2.0,
                                               np.where(stages_across_nodes, 1.0, 2.0), node),
           "first_zero": _zero_collectives_s(cluster, x, first_params + experts_here, reduce_bytes, fsdp_version),
           "last_zero": _zero_collectives_s(cluster, x, last_params + experts_here, reduce_bytes, fsdp_version),
           "dp": _data_parallel_collectives_s(cluster, x, np.maximum(first_params, last_params),
                                              reduce_bytes=reduce_bytes)}
    if model.is_moe:
        out["expert_dp"] = _data_parallel_collectives_s(cluster, x, experts_here, True, reduce_bytes)
    return out


def _activation_bytes(model: ModelSpec, x: _Shape):
    """Activations held at the peak by the first and by the last stage."""
    s, b, h = model.seq, x.bt, model.hidden
    # an MoE layer keeps its experts' activations for top_k copies of each token, padded to the load
    routed = model.top_k * model.expert_load if model.is_moe else 1.0
    shape = dict(ffn_ratio=routed * model.ffn / h, attention_scores_stored=model.attention == "unfused",
                 kv_fraction=model.kv / model.heads, gated_mlp=model.gated_mlp)
    per_layer = memory.activation_bytes_per_layer_coded(s, b, h, model.heads, x.t, x.sp, x.recompute, **shape)
    per_layer_whole = memory.activation_bytes_per_layer_coded(s, b, h, model.heads, x.t, x.sp, 0, **shape)
    working_set = per_layer_whole - per_layer  # one layer rematerialised during its backward
    lps = x.layers_per_stage
    first_in_flight = memory.in_flight_layer_microbatches(lps, x.p, x.m, x.v, x.schedule)
    last_chunks = np.minimum(x.m * x.v, (x.v - 1) * x.p + 1)  # the last stage warms up least
    last_in_flight = np.where(x.schedule == 1, lps * x.m, lps * last_chunks / x.v)
    output = memory.output_layer_activation_bytes(s, b, model.vocab, x.t)
    first = (per_layer * first_in_flight + working_set + memory.embedding_activation_bytes(s, b, h, first_in_flight / lps)
             + np.where(x.single_stage, output, 0.0))
    last = np.where(x.single_stage, first, per_layer * last_in_flight + working_set + output)
    return first, last


def evaluate(model: ModelSpec, cluster: Cluster, c: ConfigArrays) -> dict[str, np.ndarray]:
    """Step time, its breakdown, memory, energy and cost for every configuration in `c`."""
    dev, g = cluster.device, cluster.gpus_per_node
    peak = dev.peak(model.dtype)
    x = _Shape.of(model, c)
    lps, single, m = x.layers_per_stage, x.single_stage, x.m
    extra_on_single = lambda value: np.where(single, value, 0.0)  # noqa: E731

    # -- per micro-batch, per stage: compute, tensor-parallel collectives, pipeline sends
    layer_f, layer_b, layer_recompute, (attn_f, attn_b), (emb_f, emb_b), (out_f, out_b) = _layer_times_s(
        model, cluster, x, peak, compute.ROPE_BYTES_FUSED if c.fused_rope else compute.ROPE_BYTES_EAGER,
        c.fused_elementwise)
    first_compute_f = lps * layer_f + emb_f + extra_on_single(out_f)
    first_compute_b = lps * (layer_b + layer_recompute) + emb_b + extra_on_single(out_b)
    last_compute_f = lps * layer_f + out_f + extra_on_single(emb_f)
    last_compute_b = lps * (layer_b + layer_recompute) + out_b + extra_on_single(emb_b)

    sizes, inverse = _distinct_sizes(model, c)
    collectives = _collectives_s(model, cluster, sizes, float(c.grad_reduce_bytes), int(c.fsdp_version))
    def spread(name: str):  # a collective of the distinct sizes at every configuration
        value = collectives[name]
        return tuple(v[inverse] for v in value) if isinstance(value, tuple) else value[inverse]

    tp_pair = spread("tp_pair")
    # two pairs forward, two backward, two more when full recompute re-runs the forward;
    # plus the vocab-parallel embedding (first stage) and logits-gradient (last stage) pair
    tp_per_layer = 4 * tp_pair + np.where(x.recompute == 2, 2 * tp_pair, 0.0)
    stage_tp = lps * tp_per_layer + tp_pair + extra_on_single(tp_pair)
    # MoE: dispatch + combine forward, the same backward, again when full recompute re-runs the forward
    stage_ep = lps * spread("a2a") * (4 + np.where(x.recompute == 2, 2, 0))
    # ring attention: what the attention on the chunk at hand does not hide
    ring_f = np.where(x.c > 1, np.maximum(spread("ring_f") - attn_f, 0.0), 0.0)
    ring_b = np.where(x.c > 1, np.maximum(spread("ring_b") - attn_b, 0.0), 0.0)
    stage_cp = lps * (ring_b + ring_f * np.where(x.recompute == 2, 2, 1))
    p2p_mb = np.where(single, 0.0, 2 * x.v * spread("p2p_chunk"))

    first_params, last_params, embedding_here, experts_here = _stage_params(model, x)
    fsdp = (int(c.fsdp_version), float(c.grad_reduce_bytes))
    first_zero = _zero_in_step_s(cluster, x, first_params + experts_here, spread("first_zero"),
                                 first_compute_f, first_compute_b, c.bucket_mb, *fsdp)
    last_zero = _zero_in_step_s(cluster, x, last_params + experts_here, spread("last_zero"),
                                last_compute_f, last_compute_b, c.bucket_mb, *fsdp)

    # every micro-batch adds its weight gradients into the step's buffer (ZeRO-2/3: into the rank's shard),
    # unless the weight-gradient GEMM accumulates into it itself (its C operand, inside the GEMM's roofline)
    unfused = 0.0 if c.fused_grad_accumulation else 1.0
    accumulating_share = np.where(x.zero >= 2, 1.0 / _data_group(cluster, x)[0], 1.0)
    accumulated = lambda params: (  # noqa: E731
        unfused * compute.gradient_accumulation_s(params * accumulating_share, dev))
    first_accumulate = accumulated(first_params + experts_here)
    last_accumulate = accumulated(last_params + experts_here)

    stage_comm = stage_tp + stage_ep + stage_cp + p2p_mb
    first_stage = first_compute_f + first_compute_b + stage_comm + first_zero + first_accumulate
    last_stage = last_compute_f + last_compute_b + stage_comm + last_zero + last_accumulate
    last_is_slowest = last_stage > first_stage
    t_stage = np.maximum(first_stage, last_stage)
    slowest = lambda first, last: np.where(last_is_slowest, last, first)  # noqa: E731

    # -- the step
    pipeline_s = m * t_stage
    bubble_s = (x.p - 1) / x.v * t_stage
    sync_params = np.maximum(first_params, last_params)
    last_backward = np.maximum(first_compute_b, last_compute_b)
    dp_sync_s = _data_parallel_sync_s(cluster, x, sync_params, spread("dp"), last_backward, c)
    if model.is_moe:
        dp_sync_s = dp_sync_s + _data_parallel_sync_s(cluster, x, experts_here, spread("expert_dp"),
                                                      last_backward, c)
    dense_group, expert_group = _data_group(cluster, x)[0], _data_group(cluster, x, True)[0]
    owned = (sync_params / np.where(x.zero >= 1, dense_group, 1.0)
             + experts_here / np.where(x.zero >= 1, expert_group, 1.0))
    optimizer_s = compute.optimizer_step_s(owned, dev)
    embedding_sync_s = np.where(single, 0.0, spread("embedding_sync"))
    step_s = pipeline_s + bubble_s + dp_sync_s + optimizer_s + embedding_sync_s

    # -- throughput
    n_gpus = x.t * x.c * x.p * x.d
    hardware_flops = compute.hardware_flops_per_iteration(model, x.recompute)
    model_flops = compute.model_flops_per_iteration(model)

    # -- memory: the fuller of the first and last stage
    first_act, last_act = _activation_bytes(model, x)
    other = dev.framework_overhead_bytes + np.where(
        x.zero == 3, 2 * (model.layer_params - model.expert_params_per_layer + model.expert_params_per_layer / x.e)
        / x.t * memory.WEIGHT_BYTES_PER_PARAM, 0.0)  # prefetched layers
    expert_states = memory.model_state_bytes(experts_here, expert_group, x.zero)
    first_states = memory.model_state_bytes(first_params, dense_group, x.zero)
    last_states = memory.model_state_bytes(last_params, dense_group, x.zero)
    first_states = {k: v + expert_states[k] for k, v in first_states.items()}
    last_states = {k: v + expert_states[k] for k, v in last_states.items()}
    first_total = sum(first_states.values()) + first_act + other
    last_total = sum(last_states.values()) + last_act + other
    last_is_fullest = last_total > first_total
    fullest = lambda first, last: np.where(last_is_fullest, last, first)  # noqa: E731
    memory_bytes = np.maximum(first_total, last_total)

    return {
        "step_time_s": step_s,
        "tflops_per_gpu": hardware_flops / (step_s * n_gpus) / 1e12,
        "mfu": model_flops / (step_s * n_gpus * peak),
        "hfu": hardware_flops / (step_s * n_gpus * peak),
        "tokens_per_s_per_gpu": model.global_batch * model.seq / step_s / n_gpus,
        "samples_per_s": model.global_batch / step_s,
        "micro_batches": m,
        "bubble_fraction": bubble_s / pipeline_s,
        "compute_s": m * slowest(first_compute_f + first_compute_b, last_compute_f + last_compute_b),
        "tp_comm_s": m * stage_tp,
        "ep_comm_s": m * stage_ep,
        "cp_comm_s": m * stage_cp,
        "pp_p2p_s": m * p2p_mb,
        "zero_comm_s": m * slowest(first_zero, last_zero),
        "grad_accumulation_s": m * slowest(first_accumulate, last_accumulate),
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
        "other_bytes": other,
        "fits": memory_bytes <= dev.memory_bytes,
        "energy_kwh": n_gpus * dev.power_w * step_s / 3.6e6,
        "cost_usd": n_gpus * dev.price_usd_per_hour * step_s / 3600.0,
        "spot_cost_usd": n_gpus * dev.spot_price_usd_per_hour * step_s / 3600.0,
    }


BREAKDOWN_KEYS = ("compute_s", "tp_comm_s", "ep_comm_s", "cp_comm_s", "pp_p2p_s", "zero_comm_s", "dp_sync_s",
                  "embedding_sync_s", "bubble_s", "optimizer_s", "grad_accumulation_s")
