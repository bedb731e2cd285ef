"""`tp`: tensor parallelism on DTensor (torch.distributed.tensor.parallel), Megatron-LM's layout."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

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

    def check_experiment(self, exp: "Experiment") -> None:
        heads = getattr(exp.workload, "heads", None)
        if not isinstance(heads, int) or not hasattr(exp.workload, "layers"):
            raise ConfigError(f"workload.name = {exp.workload.name!r}: strategy tp splits a transformer's heads; "
                              "use a GPT workload (gpt-char, gpt-synthetic)")
        t = exp.cluster.world_size
        if heads % t:
            raise ConfigError(f"cluster.world_size = {t}: strategy tp needs the heads ({heads}) divisible by it")
        if exp.checkpoint_every or exp.checkpoint_every_s or exp.checkpoint_dir or exp.cluster.max_restarts:
            raise ConfigError("checkpoint_every: strategy tp does not checkpoint yet; drop checkpoints and "
                              "cluster.max_restarts")
