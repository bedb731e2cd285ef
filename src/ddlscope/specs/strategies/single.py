"""`single`: one process, no communication. The baseline for speedups."""

from __future__ import annotations

from typing import Literal

from ddlscope.specs.strategy import StrategySpec, Traits, strategy_spec


@strategy_spec
class SingleSpec(StrategySpec):
    traits = Traits(family="single", simplicity=0, single_process=True, splits_global_batch=False)
    description = "one process, whole global batch per step; the baseline for speedup"
    advice = "one device: no distribution at all"

    name: Literal["single"] = "single"
