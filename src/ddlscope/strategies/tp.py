"""`tp`: each transformer block split over the ranks with torch's tensor parallel (DTensor).

Megatron-LM's layout: the QKV and first MLP linear colwise (each rank its heads, its MLP columns),
the attention and MLP projections rowwise (partial sums all-reduced), embeddings, norms and the head
replicated. Every rank takes the whole batch, so the replicated parameters get the same gradients
everywhere and need no synchronisation.

The GPT fuses q, k and v in one linear; a colwise split of it would hand rank 0 queries only. Before
sharding, its output rows are reordered so that rank r's contiguous shard is [q_r; k_r; v_r] for its
heads; `full_state_dict` puts them back in the single-process order.

With `dp` > 1 the ranks form a 2-D DeviceMesh (dp, tp): each row of tp ranks splits the blocks as
above, and FSDP2 (`fully_shard` on the mesh's dp dimension, per block and at the root) shards those
states over the dp ranks and averages their gradients. Each tp group takes 1/dp of the batch. DDP
cannot take the place of FSDP here: its first broadcast of the parameters fails on DTensors
("Operator c10d.broadcast_.default does not have a sharding strategy registered", torch 2.13).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ddlscope.specs.strategies.tp import TPSpec
from ddlscope.strategies import RUNTIMES
from ddlscope.strategies.base import Batch, Strategy, StepTimer

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
        dp = self.spec.dp
        ranks = self.spec.tp_degree(self.ctx.workers)
        mesh2d: DeviceMesh | None = None
        if dp > 1:
            mesh2d = init_device_mesh(self.ctx.device.type, (dp, ranks), mesh_dim_names=("dp", "tp"))
            mesh = mesh2d["tp"]
            self._dp_rank, self._dp_group = mesh2d["dp"].get_local_rank(), mesh2d["dp"].get_group()
        else:
            mesh = init_device_mesh(self.ctx.device.type, (ranks,))
        self._order = qkv_order(model.blocks[0].attn.proj.in_features, ranks)  # type: ignore[index]
        for block in model.blocks:  # type: ignore[attr-defined]
            with torch.no_grad():
                block.attn.qkv.weight.copy_(block.attn.qkv.weight[self._order])
                block.attn.qkv.bias.copy_(block.attn.qkv.bias[self._order])
            block.attn.heads //= ranks
            parallelize_module(block, mesh, PLAN)
        if mesh2d is not None:
            for block in model.blocks:  # type: ignore[attr-defined]
                fully_shard(block, mesh=mesh2d["dp"])
            fully_shard(model, mesh=mesh2d["dp"])
        return model

    def train_step(self, batch: Batch, timer: StepTimer) -> float:
        """With dp > 1: this tp group's 1/dp of the batch; FSDP averages the gradients over the dp ranks
        in backward, and the loss is averaged over them for the step row."""
        if self.spec.dp == 1:
            return super().train_step(batch, timer)
        x, y = batch
        share = len(x) // self.spec.dp
        mine = slice(self._dp_rank * share, (self._dp_rank + 1) * share)
        loss = super().train_step((x[mine], y[mine]), timer)
        with timer.phase("synchronize"):
            t = torch.tensor([loss], dtype=torch.float64)
            dist.all_reduce(t, group=self._dp_group)
        return float(t.item()) / self.spec.dp

    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        state = super().full_state_dict(model)
        back = torch.argsort(self._order)
        return {name: t[back] if name.endswith(("attn.qkv.weight", "attn.qkv.bias")) else t
                for name, t in state.items()}
