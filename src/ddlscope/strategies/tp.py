"""`tp`: each transformer block split over the ranks with torch's tensor parallel (DTensor).

Megatron-LM's layout: the QKV and first MLP linear colwise (each rank its heads, its MLP columns),
the attention and MLP projections rowwise (partial sums all-reduced), embeddings, norms and the head
replicated. Every rank takes the whole batch, so the replicated parameters get the same gradients
everywhere and need no synchronisation.

The GPT fuses q, k and v in one linear; a colwise split of it would hand rank 0 queries only. Before
sharding, its output rows are reordered so that rank r's contiguous shard is [q_r; k_r; v_r] for its
heads; `full_state_dict` puts them back in the single-process order.

A Hugging Face decoder of the llama family (`hf:llama`, `hf:mistral`, `hf:qwen2`, `hf:qwen3`) is split
by its modules' roles as its config's `base_model_tp_plan` names them: in each decoder layer q_proj,
k_proj, v_proj, gate_proj and up_proj colwise, o_proj and down_proj rowwise. Its attention reshapes to
(-1 heads, head_dim), so a rank's shard is its own heads (and key/value heads) with no reordering.

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

from ddlscope.specs import ConfigError, StrategySpec
from ddlscope.specs.strategies.tp import TPSpec
from ddlscope.strategies import RUNTIMES
from ddlscope.strategies.base import Batch, Strategy, StepTimer
from ddlscope.workloads.sequential import LLAMA_LIKE

PLAN = {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
        "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}


# A transformers tp plan's styles that are one of torch's: the rest (gathered outputs, replicated
# inputs, packed experts) are not built here.
HF_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
HF_LAYER = "layers.*."  # the plan's entries for each decoder layer start so


def hf_layer_plan(model: nn.Module, workload: str | None = None) -> tuple[list[nn.Module], dict[str, Any]]:
    """A Hugging Face llama-family decoder's layers and the plan for each (module path in a layer ->
    torch's style), from its config's base_model_tp_plan; a ConfigError of one line where there is none."""
    hf = getattr(model, "hf", None)
    kind = getattr(getattr(hf, "config", None), "model_type", type(model).__name__)
    what = f"workload.name = {workload!r}" if workload else kind
    if hf is None or kind not in LLAMA_LIKE or not model._causal:  # type: ignore[attr-defined]
        raise ConfigError(f"{what}: strategy tp splits a GPT's blocks or, by module role, a llama-family "
                          "decoder's (hf:llama, hf:mistral, hf:qwen2, hf:qwen3); this model is neither")
    plan = getattr(hf.config, "base_model_tp_plan", None) or {}
    odd = {k: v for k, v in plan.items() if not k.startswith(HF_LAYER) or v not in HF_STYLES}
    if not plan or odd:
        raise ConfigError(f"{what}: strategy tp: its tensor-parallel plan has entries ddlscope does not build "
                          f"({', '.join(f'{k}: {v}' for k, v in list(odd.items())[:3]) or 'none given'})")
    return list(hf.base_model.layers), {k[len(HF_LAYER):]: HF_STYLES[v]() for k, v in plan.items()}


def qkv_order(hidden: int, ranks: int) -> torch.Tensor:
    """Row indices of the fused QKV output so that rank r's contiguous shard is [q_r; k_r; v_r]."""
    share = hidden // ranks
    return torch.cat([torch.arange(r * share, (r + 1) * share) + part * hidden
                      for r in range(ranks) for part in range(3)])


@RUNTIMES.register(TPSpec)
class TensorParallel(Strategy):
    spec: TPSpec

    @classmethod
    def check_model(cls, spec: StrategySpec, model: nn.Module) -> None:
        """A GPT (its blocks), or a Hugging Face decoder with a plan by module role."""
        assert isinstance(spec, TPSpec)
        if not isinstance(getattr(model, "blocks", None), nn.ModuleList):
            hf_layer_plan(model, spec._workload)

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
        blocks = self._split_gpt(model, mesh, ranks) if self._is_gpt(model) else self._split_hf(model, mesh)
        if mesh2d is not None:
            for block in blocks:
                fully_shard(block, mesh=mesh2d["dp"])
            fully_shard(model, mesh=mesh2d["dp"])
        return model

    @staticmethod
    def _is_gpt(model: nn.Module) -> bool:
        return isinstance(getattr(model, "blocks", None), nn.ModuleList)

    def _split_gpt(self, model: nn.Module, mesh: DeviceMesh, ranks: int) -> list[nn.Module]:
        hidden = model.blocks[0].attn.proj.in_features  # type: ignore[index]
        self._order: torch.Tensor | None = qkv_order(hidden, ranks)
        for block in model.blocks:  # type: ignore[attr-defined]
            with torch.no_grad():
                block.attn.qkv.weight.copy_(block.attn.qkv.weight[self._order])
                block.attn.qkv.bias.copy_(block.attn.qkv.bias[self._order])
            block.attn.heads //= ranks
            parallelize_module(block, mesh, PLAN)
        return list(model.blocks)  # type: ignore[arg-type]

    def _split_hf(self, model: nn.Module, mesh: DeviceMesh) -> list[nn.Module]:
        self._order = None  # separate q, k, v projections: nothing to reorder
        layers, plan = hf_layer_plan(model)
        for layer in layers:
            parallelize_module(layer, mesh, plan)
        return layers

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
        if self._order is None:
            return state
        back = torch.argsort(self._order)
        return {name: t[back] if name.endswith(("attn.qkv.weight", "attn.qkv.bias")) else t
                for name, t in state.items()}
