"""What a prediction is about: the model, how it is parallelised, and what comes out.

Plain frozen dataclasses (the predictor needs no pydantic and no torch). The
cluster is `ddlscope.predict.catalogue.Cluster`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, get_args

# One list of allowed values for the CLI's input (specs/prediction.py) and the predictor.
from ddlscope.specs.prediction import Attention, Recompute, Schedule

RECOMPUTE_CODES: dict[str, int] = {name: code for code, name in enumerate(get_args(Recompute))}
SCHEDULE_CODES: dict[str, int] = {name: code for code, name in enumerate(get_args(Schedule))}
BYTES_PER_ELEMENT: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class ModelSpec:
    """A GPT-style decoder-only transformer and the batch it trains with.

    `attention`: "flash" (fused kernel, never materialises the s x s scores;
    FlashAttention, 2022+) or "unfused" (separate batched GEMMs, softmax and
    dropout over s x s tensors, as Megatron-LM did in 2020-2021).
    `kv_heads` < `heads` is grouped-query attention (Llama 2/3); `gated_mlp`
    a SwiGLU MLP (three f x h matrices instead of two). Defaults: GPT.

    Mixture of experts (`experts` > 0): every layer's MLP becomes `experts`
    MLPs of width `ffn`, a router (h x experts) sends each token to `top_k`
    of them. `capacity_factor` > 0 pads every expert's buffer to
    capacity_factor x its mean load (GShard/Switch: the busiest rank computes
    that many slots; overflow is dropped); 0 is dropless (Megatron-core's
    default), where the busiest expert computes `expert_imbalance` x the mean.
    """

    hidden: int
    heads: int
    layers: int
    seq: int
    vocab: int
    global_batch: int
    ffn_hidden: int = 0  # 0: 4 x hidden
    kv_heads: int = 0  # 0: = heads (multi-head attention)
    gated_mlp: bool = False
    attention: Attention = "flash"
    dtype: str = "bf16"
    causal: bool = True
    name: str = "gpt"
    experts: int = 0  # 0: a dense MLP
    tied_embeddings: bool = True  # the output layer reuses the input embedding (GPT-2); False: its own (Llama 3)
    learned_positions: bool = True  # a seq x hidden position table (GPT-2); False: rotary, no parameters (Llama)
    top_k: int = 2
    capacity_factor: float = 0.0  # 0: dropless
    expert_imbalance: float = 1.0  # tokens of the busiest expert / the mean (dropless)

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def expert_load(self) -> float:
        """Token slots the busiest expert computes, over the mean load T k / E."""
        return self.capacity_factor if self.capacity_factor > 0 else self.expert_imbalance

    @property
    def mlp_params(self) -> int:
        """Weights and biases of one MLP (one expert)."""
        h, f = self.hidden, self.ffn
        return self.mlp_matrices * h * f + (self.mlp_matrices - 1) * f + h

    @property
    def expert_params_per_layer(self) -> int:
        """All experts' weights in one layer (0 for a dense model): what expert parallelism divides."""
        return self.experts * self.mlp_params

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def qkv_width(self) -> int:
        """Output width of the fused QKV projection: queries plus (grouped) keys and values."""
        return self.hidden + 2 * self.kv * self.head_dim

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated_mlp else 2

    @property
    def layer_params(self) -> int:
        """Weights and biases of one layer: QKV + projection, the MLP matrices, two layer norms.

        For GPT (f = 4h, no GQA) this is Megatron-LM's 12 h^2 + 13 h.
        """
        h, q = self.hidden, self.qkv_width
        attention = h * q + q + h * h + h
        mlp = self.expert_params_per_layer + h * self.experts if self.is_moe else self.mlp_params  # + router
        return attention + mlp + 4 * h

    @property
    def dense_flops_per_token(self) -> int:
        """Forward FLOPs of one layer's weight GEMMs per token (2 per multiply-add); 24 h^2 for GPT."""
        h = self.hidden
        mlp = self.mlp_matrices * h * self.ffn
        if self.is_moe:  # the router, and top_k experts per token (the active parameters)
            mlp = self.top_k * mlp + h * self.experts
        return 2 * (h * self.qkv_width + h * h + mlp)

    @property
    def params(self) -> int:
        """All parameters: the layers, the input embedding (and the output layer when not tied), the
        learned positions if any, the final norm."""
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        positions = self.seq * self.hidden if self.learned_positions else 0
        return self.layers * self.layer_params + embeddings + positions + 2 * self.hidden

    @property
    def activation_bytes(self) -> int:
        return BYTES_PER_ELEMENT.get(self.dtype, 2)


DECODER_SHAPE = ("hidden", "heads", "layers", "seq", "vocab", "kv_heads", "ffn_hidden", "tied_embeddings",
                 "learned_positions", "experts", "top_k")


def decoder_model_spec(facts: Mapping[str, Any], **knobs: Any) -> ModelSpec:
    """A transformers decoder as the step model's GPT, from `workloads.sources.hf_decoder_facts`: its shapes
    as read, `knobs` (name, global_batch, ...) as given. Configs name a gated (SwiGLU) MLP in no common
    way, so it is the one of the two MLPs whose layer has the parameters one built layer has."""
    shape = {k: facts[k] for k in DECODER_SHAPE if k in facts}  # a dense decoder may leave out experts, top_k
    plain, gated = (ModelSpec(**shape, gated_mlp=g, **knobs) for g in (False, True))
    if not facts.get("layer_params"):  # no layer found to count: the plain MLP, as GPT-2 has
        return plain
    return min((plain, gated), key=lambda m: abs(m.layer_params - facts["layer_params"]))


@dataclass(frozen=True)
class ParallelSpec:
    """How one training step is spread over the GPUs.

    tp x cp x pp x dp may not exceed the cluster's GPU count (fewer: the job uses a subset). `zero`: 0 plain data
    parallel, 1 optimizer states sharded over dp, 2 + gradients, 3 + parameters
    (FSDP FULL_SHARD). `interleave`: model chunks per pipeline stage (1 = plain
    1F1B). `overlap_grad_reduce`: data-parallel gradient reduction runs in
    buckets behind the last micro-batch's backward (DDP/Megatron-core default).
    `fused_grad_accumulation`: the weight-gradient GEMM accumulates straight into the gradient buffer
    (Megatron-LM's `--gradient-accumulation-fusion`), so no separate accumulation pass per micro-batch.
    `grad_reduce_bytes`: bytes per gradient element the data-parallel reductions carry (2: the 16-bit
    gradients as computed; 4: reduced in fp32, as FSDP2 under torchtitan's default reduce dtype, with
    FSDP's copy of each unit's 16-bit gradients into the fp32 reduce-scatter buffer).
    `fused_rope`: a rotary model's query/key rotation in one fused kernel (False: eager PyTorch's three passes).
    `fused_elementwise`: norms and SwiGLU in fused kernels (False: torchtitan's eager RMSNorm and SwiGLU passes).
    `fsdp_version`: ZeRO-3 as PyTorch FSDP runs it, with its own copies on the compute stream (1: FSDP1's
    gradient concatenation, llm-foundry; 2: FSDP2's all-gather copy-out and reduce-scatter copy-in, torchtitan);
    0 prices none (the kernel ceiling). Set by a named stack.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch: int = 1
    cp: int = 1  # context parallel: each rank holds seq / cp of every sequence (ring attention)
    ep: int = 1  # expert parallel: experts spread over ep of the dp x cp ranks
    zero: int = 0
    recompute: Recompute = "none"
    sequence_parallel: bool = False
    interleave: int = 1
    schedule: Schedule = "1f1b"
    overlap_grad_reduce: bool = True
    bucket_mb: float = 25.0
    fused_grad_accumulation: bool = False
    grad_reduce_bytes: int = 2
    fused_rope: bool = True
    fused_elementwise: bool = True
    fsdp_version: int = 0

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def label(self) -> str:
        parts = [f"TP{self.tp}"] + ([f"CP{self.cp}"] if self.cp > 1 else []) + [f"PP{self.pp}", f"DP{self.dp}"]
        parts += ([f"EP{self.ep}"] if self.ep > 1 else []) + [f"mb{self.micro_batch}", f"ZeRO-{self.zero}",
                                                              f"recompute={self.recompute}"]
        if self.sequence_parallel:
            parts.append("SP")
        if self.interleave > 1:
            parts.append(f"v{self.interleave}")
        if self.schedule != "1f1b":
            parts.append(self.schedule)
        return " ".join(parts)


@dataclass
class Prediction:
    """One configuration's predicted step: time, throughput, memory, energy, cost."""

    cluster: str
    model: dict[str, Any]
    parallel: dict[str, Any]
    step_time_s: float
    tflops_per_gpu: float  # hardware FLOP/s per GPU, recomputation counted (Megatron-LM's figure)
    mfu: float  # model FLOPs only / peak (PaLM's definition)
    hfu: float  # hardware FLOPs (with recomputation) / peak
    tokens_per_s_per_gpu: float
    samples_per_s: float
    memory_gb_per_gpu: float  # peak on the most loaded GPU, 1e9 bytes
    memory_breakdown_gb: dict[str, float]
    memory_capacity_gb: float
    fits: bool
    energy_kwh_per_step: float
    cost_usd_per_step: float
    breakdown_s: dict[str, float]
    micro_batches: int
    bubble_fraction: float
    notes: list[str] = field(default_factory=list)
    # [low, high] of step_time_s, tflops_per_gpu, mfu with every measured efficiency at the low and at
    # the high end of its published sources (catalogue.toml `*_range`); empty where not computed
    range: dict[str, list[float]] = field(default_factory=dict)
    # [low, high] of the same figures from the slowest published stack to the fast end of `range`:
    # down to the lowest share of a prediction a published training run reached (catalogue.toml
    # [validation], docs/predict.md "Validation"); empty where nothing was validated (`local`, CNNs)
    stack_range: dict[str, list[float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
