"""`single`: one process, no communication. The baseline for speedups."""

from __future__ import annotations

from typing import ClassVar, Literal

from ddlscope.specs import StrategySpec, remember_spec_class
from ddlscope.strategies import STRATEGIES
from ddlscope.strategies.base import Strategy


class SingleSpec(StrategySpec):
    single_process: ClassVar[bool] = True
    splits_global_batch: ClassVar[bool] = False

    name: Literal["single"] = "single"


remember_spec_class(SingleSpec)


@STRATEGIES.register("single")
class Single(Strategy):
    spec_class = SingleSpec
    description = "one process, whole global batch per step; the baseline for speedup"
