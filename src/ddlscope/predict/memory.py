"""Memory model: model states by ZeRO stage, activations by TP/SP/recompute, pipeline in-flight work.

All sizes in bytes; element-wise over numpy arrays.
"""

from __future__ import annotations

import numpy as np

# Mixed-precision Adam (Rajbhandari et al. 2020, REFERENCE.md): 16 bytes per
# parameter = 2 (16-bit weights) + 2 (16-bit gradients) + 12 (fp32 master
# weights, momentum, variance).
WEIGHT_BYTES_PER_PARAM = 2
GRAD_BYTES_PER_PARAM = 2
OPTIMIZER_BYTES_PER_PARAM = 12


def model_state_bytes(params, dp, zero_stage) -> dict[str, np.ndarray]:
    """Weights, gradients and optimizer states on one GPU holding `params` parameters.

    ZeRO stage 1 shards the optimizer states over the `dp` data-parallel
    ranks, stage 2 also the gradients, stage 3 also the weights.
    """
    params, dp, zero = np.asarray(params, dtype=float), np.asarray(dp, dtype=float), np.asarray(zero_stage)
    return {
        "parameters": WEIGHT_BYTES_PER_PARAM * params / np.where(zero >= 3, dp, 1.0),
        "gradients": GRAD_BYTES_PER_PARAM * params / np.where(zero >= 2, dp, 1.0),
        "optimizer": OPTIMIZER_BYTES_PER_PARAM * params / np.where(zero >= 1, dp, 1.0),
    }


# ---------------------------------------------------------------------------- activations (Korthikanti et al. 2022)
def activation_bytes_per_layer(seq, micro_batch, hidden, heads, tp=1, sequence_parallel=False,
                               recompute: str = "none"):
    """Bytes of 16-bit activations one transformer layer keeps for its backward (REFERENCE.md):

    no parallelism                    s b h (34 + 5 a s / h)
    tensor parallel                   s b h (10 + 24/t + 5 a s / (h t))
    tensor + sequence parallel        s b h (34 + 5 a s / h) / t
    tensor + sequence + selective     34 s b h / t   (and s b h (10 + 24/t) without SP)
    full recomputation                2 s b h        (only the layer input; / t with SP)
    """
    code = {"none": 0, "selective": 1, "full": 2}[recompute]
    return activation_bytes_per_layer_coded(seq, micro_batch, hidden, heads, tp, sequence_parallel, code)


def activation_bytes_per_layer_coded(seq, micro_batch, hidden, heads, tp, sequence_parallel, recompute_code,
                                     ffn_ratio: float = 4.0, attention_scores_stored: bool = True,
                                     kv_fraction: float = 1.0, gated_mlp: bool = False):
    """`activation_bytes_per_layer` with recompute as 0/1/2 and array arguments.

    The 34 splits into 10 s b h that tensor parallelism leaves replicated
    (layer-norm outputs, two dropout masks, the inputs of the QKV and first
    MLP GEMMs) and 24 s b h it divides: queries and keys 4, values 2, the
    projection's input 2, the MLP's two f-wide activations 4 f/h (16 for
    f = 4h). Grouped-query attention shrinks keys and values by
    `kv_fraction`; SwiGLU keeps gate, up and product (6 f/h). The 5 a s / h
    term is the attention scores, softmax and dropout; FlashAttention never
    stores them (`attention_scores_stored=False`).
    """
    s, b, h, a = (np.asarray(x, dtype=float) for x in (seq, micro_batch, hidden, heads))
    t = np.asarray(tp, dtype=float)
    sp = np.asarray(sequence_parallel, dtype=bool)
    code = np.asarray(recompute_code)
    sbh = s * b * h
    replicated = 10.0
    divided = 4.0 + 4.0 * kv_fraction + (6.0 if gated_mlp else 4.0) * ffn_ratio
    scores = 5.0 * a * s / h if attention_scores_stored else 0.0 * a
    keep_scores = np.where(code >= 1, 0.0, scores)  # selective and full both drop them
    without_sp = sbh * (replicated + divided / t + keep_scores / t)
    with_sp = sbh * (replicated + divided + keep_scores) / t
    partial = np.where(sp, with_sp, without_sp)
    full = 2.0 * sbh / np.where(sp, t, 1.0)
    return np.where(code == 2, full, partial)


def in_flight_layer_microbatches(layers_per_stage, pp, micro_batches, interleave, schedule_code):
    """Layer x micro-batch activation sets the first pipeline stage holds at its peak.

    GPipe keeps all m micro-batches; 1F1B at most p (REFERENCE.md); the
    interleaved 1F1B schedule with v chunks per stage warms up with
    2(p-1) + (v-1)p chunk-micro-batches, so it holds (vp + p - 1) chunks of
    L/(pv) layers: L (1 + (p-1)/(pv)) in layer units (Korthikanti et al. 2022, sec. 4.2.3).
    """
    lps, p, m, v = (np.asarray(x, dtype=float) for x in (layers_per_stage, pp, micro_batches, interleave))
    gpipe = lps * m
    plain = lps * np.minimum(m, p)
    chunks = np.minimum(m * v, v * p + p - 1)
    interleaved = chunks * lps / v
    one_f_one_b = np.where(v > 1, interleaved, plain)
    return np.where(np.asarray(schedule_code) == 1, gpipe, one_f_one_b)


def output_layer_activation_bytes(seq, micro_batch, vocab, tp):
    """Last stage, one micro-batch: 16-bit logits plus the fp32 copy the cross entropy works on."""
    s, b, v, t = (np.asarray(x, dtype=float) for x in (seq, micro_batch, vocab, tp))
    return 6.0 * s * b * v / t


def embedding_activation_bytes(seq, micro_batch, hidden, in_flight_microbatches):
    """First stage: the embedding dropout's 1-byte mask per element, per micro-batch in flight."""
    s, b, h = (np.asarray(x, dtype=float) for x in (seq, micro_batch, hidden))
    return s * b * h * np.asarray(in_flight_microbatches, dtype=float)


# ---------------------------------------------------------------------------- the ZeRO paper's example
def zero_paper_example_gb(params: float = 7.5e9, dp: int = 64) -> dict[int, float]:
    """Model states per GPU, GB, for each ZeRO stage (Rajbhandari et al. 2020, Figure 1)."""
    out = {}
    for stage in range(4):
        states = model_state_bytes(params, dp, stage)
        out[stage] = float(sum(states.values())) / 1e9
    return out
