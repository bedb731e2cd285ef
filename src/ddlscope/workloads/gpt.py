"""A small decoder-only transformer in the style of nanoGPT, readable top to bottom.

    tokens -> token embedding + learned position embedding
           -> N x Block(x + attn(ln(x)), x + mlp(ln(x)))   (pre-LayerNorm)
           -> final LayerNorm -> lm_head (untied) -> logits

`GPT.blocks` is a plain nn.ModuleList so strategies can shard or pipeline
the model block by block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ddlscope.workloads.recompute import Recompute, recomputed

INIT_STD = 0.02  # GPT-2's initialisation scale


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    seq_len: int  # longest sequence the position embedding covers
    layers: int
    hidden: int
    heads: int
    mlp_ratio: int = 4
    dropout: float = 0.0
    recompute: Recompute = "none"  # workloads/recompute.py

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} must be divisible by heads {self.heads}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.dropout = cfg.dropout
        self.recompute_core = cfg.recompute == "selective"
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        qkv = self.qkv(x)
        y = recomputed(self._core, qkv) if self.recompute_core else self._core(qkv)
        return self.resid_dropout(self.proj(y))

    def _core(self, qkv: Tensor) -> Tensor:
        """q, k, v -> the heads' outputs side by side (B, T, C)."""
        # Widths from qkv's output, not from x: under tensor parallelism a rank computes only its
        # `heads` (set to heads / t) and qkv gives 3 C / t columns.
        batch, seq, width = qkv.shape
        # (B, T, 3C) -> three (B, heads, T, head_dim) tensors
        q, k, v = qkv.view(batch, seq, 3, self.heads, width // (3 * self.heads)).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return y.transpose(1, 2).reshape(batch, seq, width // 3)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.hidden, cfg.mlp_ratio * cfg.hidden)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.hidden, cfg.hidden)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_attn = nn.LayerNorm(cfg.hidden)
        self.attn = CausalSelfAttention(cfg)
        self.ln_mlp = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg)
        self.recompute_all = cfg.recompute == "full"

    def forward(self, x: Tensor) -> Tensor:
        return recomputed(self._forward, x) if self.recompute_all else self._forward(x)

    def _forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


def _embed(token_emb: nn.Embedding, pos_emb: nn.Embedding, dropout: nn.Module, idx: Tensor) -> Tensor:
    seq = idx.shape[1]
    if seq > pos_emb.num_embeddings:
        raise ValueError(f"sequence length {seq} exceeds the model's seq_len {pos_emb.num_embeddings}")
    positions = torch.arange(seq, device=idx.device)
    return dropout(token_emb(idx) + pos_emb(positions))


class Embedding(nn.Module):
    """Token + position embedding: a GPT's first layer as a pipeline stage holds it."""

    def __init__(self, token_emb: nn.Embedding, pos_emb: nn.Embedding, dropout: nn.Module):
        super().__init__()
        self.token_emb, self.pos_emb, self.emb_dropout = token_emb, pos_emb, dropout

    def forward(self, idx: Tensor) -> Tensor:
        return _embed(self.token_emb, self.pos_emb, self.emb_dropout, idx)


class Head(nn.Module):
    """Final LayerNorm + lm_head: a GPT's last layer as a pipeline stage holds it."""

    def __init__(self, ln_final: nn.LayerNorm, lm_head: nn.Linear):
        super().__init__()
        self.ln_final, self.lm_head = ln_final, lm_head

    def forward(self, x: Tensor) -> Tensor:
        return self.lm_head(self.ln_final(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.token_emb = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.emb_dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_final = nn.LayerNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        # GPT-2: each block adds two projections to the residual stream, so
        # shrink them to keep its variance independent of depth.
        for block in self.blocks:
            for proj in (block.attn.proj, block.mlp.proj):
                nn.init.normal_(proj.weight, mean=0.0, std=INIT_STD / math.sqrt(2 * self.cfg.layers))

    def forward(self, idx: Tensor) -> Tensor:
        """Token ids (B, T) -> next-token logits (B, T, vocab_size)."""
        x = _embed(self.token_emb, self.pos_emb, self.emb_dropout, idx)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_final(x))

    def pipeline_layers(self) -> list[nn.Module]:
        """The model as a sequence of layers a pipeline can cut anywhere: the embedding, each block, the
        final norm + head. They share this model's parameters; applied in order they are `forward`."""
        return [Embedding(self.token_emb, self.pos_emb, self.emb_dropout), *self.blocks,
                Head(self.ln_final, self.lm_head)]

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
