"""Compute model: FLOPs (closed form) and the time one GPU takes for them, kernel by kernel.

Time = sum over a layer's kernels of
    GEMMs            2 M N K / (peak x gemm_kernel_fraction x quantisation(M, N, batch)),
                     or the time to move their operands once if that is longer (a roofline)
  + attention core   FlashAttention at its own measured rate, or unfused as batched GEMMs plus
                     the softmax / dropout passes over the s x s scores
  + element-wise     bytes moved / (datasheet HBM bandwidth x STREAM-measured fraction)
  + kernels x per-kernel launch gap

`quantisation` is the GEMM's tile and wave quantisation on the device's SMs
(NVIDIA, "Matrix Multiplication Background User's Guide": the output is cut
into tiles, one thread block per tile, and the blocks run in waves of one per
SM, so a last, partly filled wave and the padding of edge tiles cost their
full time). The kernel library picks the tile shape that does best, as
cuBLAS's heuristics do; a smaller tile fills waves better but reads more
bytes per FLOP from L2, so its rate is capped by the L2 bandwidth
(datasheet). `gemm_kernel_fraction` is the rate of the best-shaped large
GEMM measured in isolation (published matmul benchmarks, catalogue.toml).
A device without an SM count (a calibrated CPU, `local`) keeps the smooth
curve sat(M) sat(N), sat(x) = x / (x + half_dim).

No constant here or in catalogue.toml is fitted to a training run; each says
its source. `sustained_fraction` (1 in the catalogue) is the user's knob for
a stack they measured (`predict --measured-step-s`). Everything is element-wise
over numpy arrays.
"""

from __future__ import annotations

import numpy as np

from ddlscope.predict import memory
from ddlscope.predict.catalogue import Device
from ddlscope.predict.specs import ModelSpec

# Kernels per layer in an eager framework (layer norms, GEMMs, attention,
# bias/activation/dropout/residual fusions, collectives): about a dozen
# forward, twice that backward. Only their launch gaps are charged here.
KERNELS_FORWARD_PER_LAYER = 12
KERNELS_BACKWARD_PER_LAYER = 24

# Bytes read + written per token-hidden element by the element-wise ops of
# one layer's forward pass (16-bit activations): layer norm 2 x 4 (read +
# write), bias+dropout+residual 2 x 7 (two reads, a write, a 1-byte mask),
# i.e. 22; the bias+GeLU pair reads and writes the f-wide MLP activation
# (4 f/h per element). Backward moves about twice the forward traffic.
# The unfused attention core streams the s x s scores (a s^2 b of them per
# micro-batch) between its two batched GEMMs (whose own reads and writes are
# in `gemm_s`): fused scale-mask-softmax reads and writes them (4 bytes),
# dropout reads, writes and stores a 1-byte mask (5); backward, softmax reads
# the probabilities and the gradient and writes one (6), dropout reads the
# gradient and the mask and writes (5).
ELEMENTWISE_REPLICATED_BYTES = 22
ELEMENTWISE_MLP_BYTES_PER_FFN_RATIO = 4
UNFUSED_SCORE_BYTES_FORWARD = 9
UNFUSED_SCORE_BYTES_BACKWARD = 11
BACKWARD_TRAFFIC_RATIO = 2.0
# Layout copies of Megatron-LM's unfused attention (megatron/model/transformer.py, 2020-21), per element of
# the rank's b x s x h/tp attention activation: forward, the context `permute(2, 0, 1, 3).contiguous()` (read 2,
# write 2); backward, that copy's gradient (4) and autograd's `cat` of the q, k, v gradients that the split of
# the fused QKV output needs (read and write 3 x 2). The batched GEMMs read q, k, v in place (strided views).
UNFUSED_LAYOUT_BYTES_FORWARD = 4
UNFUSED_LAYOUT_BYTES_BACKWARD = 16
# An MoE layer gathers each routed token's hidden vector into its expert's buffer and scatters the
# result back: a read and a write of 2 bytes each, twice, per routed token-hidden element.
MOE_PERMUTE_BYTES = 8
# FlashAttention-2's backward does 2.5x the forward's matmul work (it
# recomputes the scores); causal masking lets it skip half the blocks.
FLASH_BACKWARD_FLOPS_RATIO = 2.5
CAUSAL_WORK_FRACTION = 0.5
# Rotary position embedding (a model without learned positions: Llama, Mixtral) rotates every query and key
# element after the QKV GEMM. One fused kernel (Megatron-core's --apply-rope-fusion, FlashAttention's rotary,
# Transformer Engine) reads and writes it once: 4 bytes per element forward, and the inverse rotation of the
# gradient the same backward. Eager PyTorch as torchtitan writes it (models/llama/model.py apply_rotary_emb:
# `view_as_complex(x.float())`, a complex multiply by freqs_cis, `view_as_real(...).type_as(x)`) runs three
# passes: the fp32 copy (read 2, write 4), the multiply (read 4, write 4; the small freqs table stays in L2) and
# the cast back (read 4, write 2): 20 bytes forward, 20 backward (autograd runs the same three on the gradient).
ROPE_BYTES_FUSED = 4.0
ROPE_BYTES_EAGER = 20.0
# Eager element-wise passes (`fused_elementwise` False), as torchtitan writes a Llama layer without
# torch.compile (models/norms.py RMSNorm: `self._norm(x.float()).type_as(x) * self.weight`, `_norm` =
# `x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)`): per element, the fp32 copy (read 2, write 4),
# pow (4, 4), mean (read 4), the multiply by the rsqrt (4, 4), the cast back (4, 2) and the weight (2, 2):
# 36 bytes where one fused norm kernel moves 4, twice per layer: 64 more forward. Its SwiGLU
# `F.silu(w1(x)) * w3(x)` runs silu (read 2, write 2) and the product (read 4, write 2): 10 bytes per f-wide
# element where a fused silu-and-multiply moves 6: 4 f/h more. Backward, as every element-wise pass here,
# about twice the forward.
EAGER_NORM_EXTRA_BYTES = 64.0
EAGER_GATED_EXTRA_BYTES_PER_FFN_RATIO = 4.0
# Vocab-parallel cross entropy on fp32 logits: ~14 bytes per logit forward, as much backward.
CROSS_ENTROPY_BYTES_PER_LOGIT = 28


# ---------------------------------------------------------------------------- FLOPs
def megatron_flops_per_iteration(batch, seq, layers, hidden, vocab, recompute: str = "full"):
    """Narayanan et al. 2021 as REFERENCE.md states it: 96 B s l h^2 (1 + s/6h + V/16lh) with full
    recomputation; "without recomputation the leading 96 becomes 72". Selective recomputation
    (Korthikanti et al. 2022) re-runs only the attention core's forward, adding 4 B s^2 l h.

    (Taken literally, 72 x V/16lh undercounts the logits GEMM, 6 B s h V, by a quarter: 0.05% of
    a 530B model's FLOPs. `model_flops_per_iteration` counts it exactly.)
    """
    b, s, l, h, v = (np.asarray(x, dtype=float) for x in (batch, seq, layers, hidden, vocab))
    lead = 96.0 if recompute == "full" else 72.0
    flops = lead * b * s * l * h**2 * (1 + s / (6 * h) + v / (16 * l * h))
    if recompute == "selective":
        flops = flops + 4 * b * s**2 * l * h
    return flops


def model_flops_per_iteration(model: ModelSpec, batch=None):
    """FLOPs of one step without recomputation (MFU's numerator, PaLM's definition), any MLP width."""
    b = np.asarray(model.global_batch if batch is None else batch, dtype=float)
    s, l, h, v = model.seq, model.layers, model.hidden, model.vocab
    attention_per_seq = 4 * s * s * h  # QK^T and AV, forward, per layer
    forward = b * (s * l * model.dense_flops_per_token + l * attention_per_seq + 2 * s * h * v)
    return 3 * forward


def hardware_flops_per_iteration(model: ModelSpec, recompute_code, batch=None):
    """FLOPs actually executed: model FLOPs plus the forward work recomputation repeats.

    `recompute_code`: 0 none, 1 selective (attention core), 2 full (every layer's forward).
    """
    b = np.asarray(model.global_batch if batch is None else batch, dtype=float)
    s, l, h = model.seq, model.layers, model.hidden
    layer_forward = b * l * (s * model.dense_flops_per_token + 4 * s * s * h)
    attention_forward = b * l * 4 * s * s * h
    code = np.asarray(recompute_code)
    extra = np.where(code == 2, layer_forward, np.where(code == 1, attention_forward, 0.0))
    return model_flops_per_iteration(model, b) + extra


# ---------------------------------------------------------------------------- GEMM efficiency
def dimension_saturation(x, half_dim: float):
    x = np.asarray(x, dtype=float)
    return x / (x + half_dim)


# Thread-block tiles (rows x columns of the output) the GEMM library chooses among: CUTLASS/cuBLAS
# tensor-core kernels for 16-bit inputs on Ampere and Hopper (NVIDIA's matmul guide uses 256x128 as the
# large tile; 128x128, 128x64 and 64x64 are the smaller ones it falls back to for small outputs).
GEMM_TILES: tuple[tuple[int, int], ...] = ((256, 128), (128, 256), (128, 128), (128, 64), (64, 128), (64, 64))
LARGEST_TILE = GEMM_TILES[0]


def tile_rate_fraction(tile_m: int, tile_n: int, device: Device, bytes_per_element: float = 2.0) -> float:
    """Rate of a tile shape relative to the largest tile's, as the L2 bandwidth caps it.

    Each k-step a block reads (tile_m + tile_n) k elements and does 2 tile_m tile_n k FLOPs, so it needs
    peak / L2 bandwidth FLOPs per byte to keep the tensor cores busy; a tile with less runs at the L2's pace.
    """
    e = device.efficiency
    if e.l2_bytes_per_s <= 0:
        return 1.0
    needed = max(device.peak_flops.values()) / e.l2_bytes_per_s  # the 16-bit tensor peak, the most demanding

    def rate(tm: int, tn: int) -> float:
        return min(1.0, 2.0 * tm * tn / ((tm + tn) * bytes_per_element) / needed)

    return rate(tile_m, tile_n) / rate(*LARGEST_TILE)


# Split-K: a GEMM with fewer output tiles than SMs and a long reduction dimension splits K over
# several blocks that add their partial sums (cuBLAS / CUTLASS split-K and stream-K kernels); each
# split keeps at least this many K elements (a few main-loop iterations of 32-64).
SPLIT_K_MIN_K = 256


def wave_quantisation(m, n, batch, sms: int, tile_m: int, tile_n: int, k=None):
    """Useful share of the thread-block slots a GEMM occupies: tile padding x the partial last wave.

    `batch` independent GEMMs (a batched GEMM) share the waves. One block per SM at a time. Given
    `k`, a GEMM whose tiles leave SMs idle splits K into as many parts as fill them (split-K).
    """
    m, n, batch = (np.asarray(x, dtype=float) for x in (m, n, batch))
    tiles = np.ceil(m / tile_m) * np.ceil(n / tile_n) * batch
    splits = 1.0 if k is None else np.clip(np.minimum(np.floor(sms / tiles),
                                                      np.floor(np.asarray(k, dtype=float) / SPLIT_K_MIN_K)), 1.0, None)
    blocks = tiles * splits
    waves = np.ceil(blocks / sms)
    padding = (m * n * batch) / np.maximum(tiles * tile_m * tile_n, 1.0)
    return padding * blocks / np.maximum(waves * sms, 1.0)


def gemm_quantisation(m, n, device: Device, batch=1.0, k=None):
    """Best fraction of the large-GEMM rate over the tiles the library can choose (cuBLAS's heuristic)."""
    e = device.efficiency
    if e.sms <= 0:
        d = e.gemm_half_dim
        return dimension_saturation(m, d) * dimension_saturation(n, d)
    best = None
    for tm, tn in GEMM_TILES:
        value = wave_quantisation(m, n, batch, e.sms, tm, tn, k) * tile_rate_fraction(tm, tn, device)
        best = value if best is None else np.maximum(best, value)
    return best


def gemm_efficiency(m, n, k, device: Device, batch=1.0):
    """Achieved fraction of peak for the tensor-core work of `batch` (m x k) @ (k x n) GEMMs.

    The output dimensions pay tile/wave quantisation; k only lets a GEMM with idle SMs split
    (split-K), and a short k shows up instead as low arithmetic intensity (see `gemm_s`).
    """
    e = device.efficiency
    return e.gemm_kernel_fraction * e.sustained_fraction * gemm_quantisation(m, n, device, batch, k)


def gemm_s(m, n, k, device: Device, peak_flops: float, batch=1.0, bytes_per_element: float = 2.0,
           operand_bytes=None):
    """Time of `batch` independent (m x k) @ (k x n) GEMMs: a roofline of tensor-core time and
    the time to read both operands and write the result once.

    `operand_bytes`: what the kernel really moves where that is not the two operands and the
    result (an implicit-GEMM convolution reads its input, not the k^2-times larger im2col matrix).
    """
    m, n, k, batch = (np.asarray(x, dtype=float) for x in (m, n, k, batch))
    flops = 2.0 * batch * m * n * k
    if operand_bytes is None:
        operand_bytes = bytes_per_element * batch * (m * k + k * n + m * n)
    # No kernel finishes sooner than its launch takes (the launch latency is the catalogue's per-kernel
    # overhead): a small model's GEMMs are launch-bound, as on a real GPU.
    return np.maximum.reduce([flops / (peak_flops * gemm_efficiency(m, n, k, device, batch)),
                              memory_bound_s(operand_bytes, device),
                              np.full_like(flops, device.efficiency.kernel_overhead_s)])


def linear_forward_s(tokens, n_out, k_in, device: Device, peak_flops: float):
    return gemm_s(tokens, n_out, k_in, device, peak_flops)


def linear_backward_s(tokens, n_out, k_in, device: Device, peak_flops: float):
    """Input gradient (tokens x n_out) @ (n_out x k_in) plus weight gradient (k_in x tokens) @ (tokens x n_out)."""
    return gemm_s(tokens, k_in, n_out, device, peak_flops) + gemm_s(k_in, n_out, tokens, device, peak_flops)


def memory_bound_s(bytes_moved, device: Device):
    return np.asarray(bytes_moved, dtype=float) / (device.memory_bandwidth_bytes_per_s
                                                   * device.efficiency.memory_fraction)


# ---------------------------------------------------------------------------- one transformer layer
def layer_gemm_times_s(model: ModelSpec, micro_batch, tp, device: Device, peak_flops: float, ep=1.0):
    """(forward, backward) seconds of the weight GEMMs of one layer on one tensor-parallel rank.

    A mixture-of-experts layer runs its router (tokens x h x experts) and, on each rank, its
    experts / ep local experts as one grouped GEMM: each expert gets the ep ranks' tokens x top_k /
    experts on average, x `expert_load` on the busiest rank (capacity padding or imbalance).
    """
    tokens = np.asarray(micro_batch, dtype=float) * model.seq
    tp, ep = np.asarray(tp, dtype=float), np.asarray(ep, dtype=float)
    h, f = model.hidden, model.ffn
    up = (model.mlp_matrices - 1) * f  # gate and up projections fused for SwiGLU
    attention = ((model.qkv_width / tp, h),  # QKV, column-parallel
                 (h, h / tp))                # attention output projection, row-parallel
    mlp = ((up / tp, h),                     # MLP up, column-parallel
           (h, f / tp))                      # MLP down, row-parallel
    forward = sum(linear_forward_s(tokens, n, k, device, peak_flops) for n, k in attention)
    backward = sum(linear_backward_s(tokens, n, k, device, peak_flops) for n, k in attention)
    if not model.is_moe:
        return (forward + sum(linear_forward_s(tokens, n, k, device, peak_flops) for n, k in mlp),
                backward + sum(linear_backward_s(tokens, n, k, device, peak_flops) for n, k in mlp))
    local = model.experts / ep
    per_expert = tokens * ep * model.top_k / model.experts * model.expert_load
    router_f = linear_forward_s(tokens, model.experts, h, device, peak_flops)
    router_b = linear_backward_s(tokens, model.experts, h, device, peak_flops)
    expert_f = sum(gemm_s(per_expert, n, k, device, peak_flops, local) for n, k in mlp)
    expert_b = sum(gemm_s(per_expert, k, n, device, peak_flops, local) + gemm_s(k, n, per_expert, device, peak_flops,
                                                                               local) for n, k in mlp)
    return forward + router_f + expert_f, backward + router_b + expert_b


def attention_core_times_s(model: ModelSpec, micro_batch, tp, device: Device, peak_flops: float):
    """(forward, backward) seconds of softmax(QK^T)V for the heads on one tensor-parallel rank."""
    b = np.asarray(micro_batch, dtype=float)
    heads_here = model.heads / np.asarray(tp, dtype=float)
    s, d = model.seq, model.head_dim
    if model.attention == "flash":
        work = CAUSAL_WORK_FRACTION if model.causal else 1.0
        forward_flops = 4.0 * b * heads_here * s * s * d * work
        rate = peak_flops * device.efficiency.flash_attention_fraction * device.efficiency.sustained_fraction
        return forward_flops / rate, FLASH_BACKWARD_FLOPS_RATIO * forward_flops / rate
    # Unfused: QK^T and AV as batched GEMMs over all s x s scores (no causal skipping),
    # with the score tensor streamed through memory by softmax and dropout.
    n_mats = b * heads_here
    forward_gemm = gemm_s(s, s, d, device, peak_flops, n_mats) + gemm_s(s, d, s, device, peak_flops, n_mats)
    backward_gemm = (gemm_s(s, d, s, device, peak_flops, n_mats) + gemm_s(d, s, s, device, peak_flops, n_mats)
                     + gemm_s(s, s, d, device, peak_flops, n_mats) + gemm_s(s, d, s, device, peak_flops, n_mats))
    scores = n_mats * s * s
    layout = n_mats * s * d  # b x s x h / tp elements
    forward = forward_gemm + memory_bound_s(UNFUSED_SCORE_BYTES_FORWARD * scores
                                            + UNFUSED_LAYOUT_BYTES_FORWARD * layout, device)
    backward = backward_gemm + memory_bound_s(UNFUSED_SCORE_BYTES_BACKWARD * scores
                                              + UNFUSED_LAYOUT_BYTES_BACKWARD * layout, device)
    return forward, backward


def layer_elementwise_times_s(model: ModelSpec, micro_batch, tp, sequence_parallel, device: Device,
                              rope_bytes: float = ROPE_BYTES_FUSED, fused: bool = True):
    """(forward, backward) seconds of the memory-bound ops around the GEMMs of one layer.

    Without sequence parallelism the layer norms, dropouts and residual adds
    run on the full activation on every tensor-parallel rank; with it each
    rank handles 1/tp of the sequence (Korthikanti et al. 2022). A model without learned positions
    rotates its queries and keys (`rope_bytes` per element each way; the rank's heads: / tp). `fused` False:
    eager norms and SwiGLU (EAGER_NORM_EXTRA_BYTES, EAGER_GATED_EXTRA_BYTES_PER_FFN_RATIO).
    """
    tp = np.asarray(tp, dtype=float)
    elements = np.asarray(micro_batch, dtype=float) * model.seq * model.hidden * (model.activation_bytes / 2)
    replicated_bytes = ELEMENTWISE_REPLICATED_BYTES + (0.0 if fused else EAGER_NORM_EXTRA_BYTES)
    replicated = replicated_bytes * elements / np.where(np.asarray(sequence_parallel), tp, 1.0)
    # GeLU reads and writes f wide (4 bytes per f/h); SwiGLU reads two and writes one (6)
    per_ratio = ELEMENTWISE_MLP_BYTES_PER_FFN_RATIO + (2 if model.gated_mlp else 0)
    if model.gated_mlp and not fused:
        per_ratio += EAGER_GATED_EXTRA_BYTES_PER_FFN_RATIO
    mlp = per_ratio * (model.ffn / model.hidden) * elements / tp
    if model.is_moe:  # activations of top_k x load copies of each token; permute in and out (read + write each)
        routed = model.top_k * model.expert_load
        mlp = mlp * routed + MOE_PERMUTE_BYTES * routed * elements
    forward_bytes = replicated + mlp
    rope = 0.0
    if not model.learned_positions:
        rope = rope_bytes * (elements / model.hidden) * (model.hidden + model.kv * model.head_dim) / tp
    return (memory_bound_s(forward_bytes + rope, device),
            memory_bound_s(BACKWARD_TRAFFIC_RATIO * forward_bytes + rope, device))


def kernel_gaps_s(device: Device):
    gap = device.efficiency.kernel_overhead_s
    return KERNELS_FORWARD_PER_LAYER * gap, KERNELS_BACKWARD_PER_LAYER * gap


def output_layer_times_s(model: ModelSpec, micro_batch, tp, device: Device, peak_flops: float):
    """(forward, backward) seconds of the last stage's logits GEMM (vocab-parallel) and cross entropy."""
    tokens = np.asarray(micro_batch, dtype=float) * model.seq
    vocab_here = model.vocab / np.asarray(tp, dtype=float)
    forward = linear_forward_s(tokens, vocab_here, model.hidden, device, peak_flops)
    backward = linear_backward_s(tokens, vocab_here, model.hidden, device, peak_flops)
    loss_bytes = CROSS_ENTROPY_BYTES_PER_LOGIT / 2 * tokens * vocab_here
    return forward + memory_bound_s(loss_bytes, device), backward + memory_bound_s(loss_bytes, device)


def embedding_times_s(model: ModelSpec, micro_batch, device: Device):
    """(forward, backward) seconds of the first stage's lookup, position add and dropout."""
    elements = np.asarray(micro_batch, dtype=float) * model.seq * model.hidden
    forward_bytes = 7.0 * elements
    return memory_bound_s(forward_bytes, device), memory_bound_s(BACKWARD_TRAFFIC_RATIO * forward_bytes, device)


# The mixed-precision optimizer step, per parameter the rank owns, as Megatron-LM's Float16Optimizer runs it
# (megatron/optimizer/optimizer.py: each a separate multi-tensor pass over memory):
#   copy the 16-bit gradient to an fp32 one            read 2,  write 4   6
#   unscale and check for inf/NaN                      read 4,  write 4   8
#   gradient norm for clipping                         read 4             4
#   Adam (apex FusedAdam): weight, gradient, m, v      read 16, write 12 28
#   copy the fp32 master weight to the 16-bit one      read 4,  write 2   6
#   zero the gradient buffer for the next step                 write 2   2
OPTIMIZER_BYTES_PER_PARAM = 54


def optimizer_step_s(owned_params, device: Device):
    return memory_bound_s(OPTIMIZER_BYTES_PER_PARAM * np.asarray(owned_params, dtype=float), device)


# Gradient accumulation, once per micro-batch per parameter whose gradient the rank accumulates: the
# backward's fresh 16-bit weight gradient is added into the accumulation buffer (Megatron-LM's local DDP:
# `param.main_grad.add_(param.grad)` in its backward hook; PyTorch's AccumulateGrad; DeepSpeed's
# pipeline engine): read the new gradient (2 bytes), read and write the 2-byte buffer (first principles).
GRAD_ACCUMULATION_BYTES_PER_PARAM = 6


def gradient_accumulation_s(accumulated_params, device: Device):
    """Memory-bound pass that adds one micro-batch's weight gradients into the step's gradient buffer."""
    return memory_bound_s(GRAD_ACCUMULATION_BYTES_PER_PARAM * np.asarray(accumulated_params, dtype=float), device)


# PyTorch FSDP's own copies on the compute stream, per unsharded parameter of a unit, per micro-batch (ZeRO 3,
# FULL_SHARD, and ZeRO 2, SHARD_GRAD_OP; `fsdp_version`: 0 prices none, the kernel ceiling). Counted from
# torch.distributed's code:
#   FSDP1 (torch.distributed.fsdp, FlatParameter; llm-foundry / Composer): the unit's parameters are views of
#     the gathered flat parameter (`_flat_param.py` _get_unflat_views_unaligned: torch.split, then view), so
#     autograd's SplitWithSizesBackward concatenates their gradients into the flat gradient every backward:
#     read 2, write 2. (The all-gather writes into the flat parameter itself: no copy-out; a reduce-dtype
#     cast runs on the post-backward stream, with the reduce-scatter.)
#   FSDP2 (fully_shard; torchtitan): `foreach_all_gather_copy_out` splits the all-gather output into each
#     parameter's tensor on the current stream (wait_for_unshard), read 2, write 2, at each of the micro-batch's
#     all-gathers (FULL_SHARD: forward and backward; without reshard_after_forward: forward only); and
#     `foreach_reduce` runs its reduce-scatter copy-in (`torch._chunk_cat` of the gradients into the
#     reduce-dtype buffer) on the current stream before the reduce-scatter stream waits for it: read 2, write
#     the reduce dtype's bytes.
FSDP1_GRADIENT_CAT_BYTES_PER_PARAM = 4.0
FSDP2_COPY_OUT_BYTES_PER_PARAM = 4.0


def fsdp_copy_bytes_per_param(fsdp_version: int, reduce_bytes: float, gathers_per_micro_batch: int = 2) -> float:
    """Bytes per unsharded parameter per micro-batch that FSDP's own copies move on the compute stream."""
    if fsdp_version == 1:
        return FSDP1_GRADIENT_CAT_BYTES_PER_PARAM
    if fsdp_version == 2:
        copy_in = memory.GRAD_BYTES_PER_PARAM + reduce_bytes
        return gathers_per_micro_batch * FSDP2_COPY_OUT_BYTES_PER_PARAM + copy_in
    return 0.0
