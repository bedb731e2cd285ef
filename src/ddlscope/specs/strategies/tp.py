"""`tp`: tensor parallelism on DTensor (torch.distributed.tensor.parallel), Megatron-LM's layout, on a GPT
or a llama-family Hugging Face decoder (hf:llama, ...: split by module role, strategies/tp.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, PrivateAttr

from ddlscope.specs.base import ConfigError
from ddlscope.specs.strategy import StrategySpec, Traits, strategy_spec

if TYPE_CHECKING:
    from ddlscope.specs.experiment import Experiment


@strategy_spec
class TPSpec(StrategySpec):
    # Every rank computes every layer on the whole batch, its share of each block's heads and MLP
    # columns; the block outputs are all-reduced, so all ranks evaluate together.
    traits = Traits(family="tensor", simplicity=5, collective_forward=True, splits_global_batch=False,
                    shards_model_states=True)
    description = ("tensor parallel on DTensor: each block's attention heads and MLP columns split over the ranks "
                   "(colwise QKV and fc, rowwise projections), an all-reduce after each")
    advice = "when one layer's weights or activations are too large for a device and ranks share a fast link"

    name: Literal["tp"] = "tp"
    dp: int = Field(1, ge=1, description="data-parallel degree: world_size = dp x tp; each group of tp ranks "
                                         "takes 1/dp of the batch, FSDP2 shards its states over the dp ranks "
                                         "(a 2-D DeviceMesh, FSDP x TP)")

    # The workload check_experiment saw, for the runtime's check_model (handed this spec alone) to name it.
    _workload: str | None = PrivateAttr(None)

    def tp_degree(self, world_size: int) -> int:
        """Ranks that split each block (world_size / dp)."""
        return world_size // self.dp

    def check_experiment(self, exp: "Experiment") -> None:
        heads = getattr(exp.workload, "heads", None)
        name = self._workload = exp.workload.name
        if ":" in name and not name.startswith("hf:"):
            raise ConfigError(f"workload.name = {name!r}: strategy tp splits a transformer's heads; use a GPT "
                              "workload (gpt-char, gpt-synthetic) or a llama-family decoder (hf:llama, hf:mistral, "
                              "hf:qwen2)")
        if not isinstance(heads, int) or not hasattr(exp.workload, "layers"):
            raise ConfigError(f"workload.name = {name!r}: strategy tp splits a transformer's heads; "
                              "use a GPT workload (gpt-char, gpt-synthetic)")
        if exp.cluster.world_size % self.dp:
            raise ConfigError(f"strategy.dp = {self.dp}: cluster.world_size = {exp.cluster.world_size} must be "
                              "dp x tp, a multiple of it")
        if exp.workload.batch_size % self.dp:
            raise ConfigError(f"workload.batch_size = {exp.workload.batch_size}: must be divisible by "
                              f"strategy.dp = {self.dp}")
        t = self.tp_degree(exp.cluster.world_size)
        if heads % t:
            degree = "it" if self.dp == 1 else f"its tp degree {t} (world_size / dp)"
            raise ConfigError(f"cluster.world_size = {exp.cluster.world_size}: strategy tp needs the heads ({heads}) "
                              f"divisible by {degree}")
        kv_heads = getattr(exp.workload, "kv_heads", None)  # a Hugging Face decoder's key/value heads
        if isinstance(kv_heads, int) and kv_heads % t:
            raise ConfigError(f"workload.kv_heads = {kv_heads}: strategy tp splits the key/value heads too; they "
                              f"must be divisible by the tp degree {t}")
        if exp.checkpoint_every or exp.checkpoint_every_s or exp.checkpoint_dir or exp.cluster.max_restarts:
            raise ConfigError("checkpoint_every: strategy tp does not checkpoint yet; drop checkpoints and "
                              "cluster.max_restarts")
