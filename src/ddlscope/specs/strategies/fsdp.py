"""`fsdp`: torch FSDP2 (`fully_shard`)'s knobs."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ddlscope.specs.strategy import StrategySpec, Traits, strategy_spec


@strategy_spec
class FSDPSpec(StrategySpec):
    # Every unit's all-gather needs all ranks, evaluation included.
    traits = Traits(family="collective", simplicity=2, collective_forward=True, shards_model_states=True)
    description = "torch FSDP2 (fully_shard): parameters, gradients and optimizer state sharded over all ranks"
    advice = "the main study's choice when the model does not fit replicated"

    name: Literal["fsdp"] = "fsdp"
    reshard_after_forward: bool = Field(
        True, description="free gathered parameters after each unit's forward and gather them again for backward "
                          "(ZeRO-3); False keeps them until backward (less communication, more memory)")
    wrap: Literal["block", "model"] = Field(
        "block", description="block: one FSDP unit per block (ddlscope's model.blocks, a transformers model's "
                             "decoder layers, else the repeated block class holding the most parameters, else "
                             "each top-level child with parameters), plus the root; model: one unit for the whole model")
    wrap_class: str | None = Field(
        None, description="with wrap = 'block': the class name of the modules to shard as units (e.g. Bottleneck), "
                          "instead of the ones found")
    mixed_precision: Literal["none", "bf16"] = Field(
        "none", description="bf16: gather and compute in bf16, reduce gradients and keep sharded parameters in fp32")
