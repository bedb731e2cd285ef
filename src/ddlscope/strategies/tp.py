"""`tp`: each transformer block split over the ranks with torch's tensor parallel (DTensor).

Megatron-LM's layout: the QKV and first MLP linear colwise (each rank its heads, its MLP columns),
the attention and MLP projections rowwise (partial sums all-reduced), embeddings, norms and the head
replicated. Every rank takes the whole batch, so the replicated parameters get the same gradients
everywhere and need no synchronisation.

The GPT fuses q, k and v in one linear; a colwise split of it would hand rank 0 queries only. Before
sharding, its output rows are reordered so that rank r's contiguous shard is [q_r; k_r; v_r] for its
heads; `full_state_dict` puts them back in the single-process order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ddlscope.specs.strategies.tp import TPSpec
from ddlscope.strategies import RUNTIMES
from ddlscope.strategies.base import Strategy

PLAN = {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
        "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}


def qkv_order(hidden: int, ranks: int) -> torch.Tensor:
    """Row indices of the fused QKV output so that rank r's contiguous shard is [q_r; k_r; v_r]."""
    share = hidden // ranks
    return torch.cat([torch.arange(r * share, (r + 1) * share) + part * hidden
                      for r in range(ranks) for part in range(3)])


@RUNTIMES.register(TPSpec)
class TensorParallel(Strategy):
    spec: TPSpec

    def wrap(self, model: nn.Module) -> nn.Module:
        ranks = self.ctx.workers
        mesh = init_device_mesh(self.ctx.device.type, (ranks,))
        self._order = qkv_order(model.blocks[0].attn.proj.in_features, ranks)  # type: ignore[index]
        for block in model.blocks:  # type: ignore[attr-defined]
            with torch.no_grad():
                block.attn.qkv.weight.copy_(block.attn.qkv.weight[self._order])
                block.attn.qkv.bias.copy_(block.attn.qkv.bias[self._order])
            block.attn.heads //= ranks
            parallelize_module(block, mesh, PLAN)
        return model

    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        state = super().full_state_dict(model)
        back = torch.argsort(self._order)
        return {name: t[back] if name.endswith(("attn.qkv.weight", "attn.qkv.bias")) else t
                for name, t in state.items()}
