"""Model averaging, the local SGD family: localsgd, diloco, cocod.

Every worker takes local optimizer steps on its own shard of the batch and
the workers average their models every `period` steps instead of their
gradients every step; `period` = 1 with plain SGD is the same update as
DDP's. The schedule is torch's PeriodicModelAverager's: after `warmup_steps`
steps whose gradients are all-reduced (post-local SGD, Lin et al. 2020),
the models are averaged after the optimizer step of steps warmup,
warmup + period, warmup + 2 period, ... (`averages_after`).

- localsgd: the average is blocking. With `group_period` set, hierarchical
  averaging: within groups of `group_size` ranks every `group_period` steps,
  across all ranks every `period` steps (torch's HierarchicalModelAverager).
- diloco (built on localsgd, its knobs included): the average is a pseudo-gradient (model at the last average minus
  the new average) stepped by an outer SGD with Nesterov momentum (Douillard
  et al. 2023). Outer lr 1 and momentum 0 is plain local SGD.
- cocod: CoCoD-SGD (PAPERS.md item 19): the average of round r is in flight
  (a non-blocking all-reduce) while round r + 1's local steps compute; when it
  lands, the worker keeps its progress since: average + (now - snapshot).
  With `overlap` off the average completes before the next step: plain local SGD.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from ddlscope.specs.base import ConfigError
from ddlscope.specs.strategy import StrategySpec, Traits, strategy_spec


class ModelAveragingSpec(StrategySpec):
    """What every model-averaging strategy shares: the period and the warm-up."""

    period: int = Field(8, ge=1, description="H: average the models every H local steps (1: every step)")
    warmup_steps: int = Field(0, ge=0, description="post-local SGD: all-reduce gradients (DDP) for this many steps "
                                                   "before local steps start")

    def averages_after(self, step: int) -> Literal["all", "group"] | None:
        """Who averages after `step`'s optimizer step: every rank ("all"), each group, or nobody (None).
        PeriodicModelAverager's rule: steps warmup, warmup + period, ..."""
        return "all" if step >= self.warmup_steps and (step - self.warmup_steps) % self.period == 0 else None

    def averages_per_step(self) -> float:
        """Averages per local step in the long run (the estimators' amortisation)."""
        return 1.0 / self.period


@strategy_spec
class LocalSGDSpec(ModelAveragingSpec):
    traits = Traits(family="collective", simplicity=3, synchronous=False)
    description = "local SGD: local steps, models averaged every `period` steps (torch's model averagers)"
    advice = "a slow network: one model all-reduce every `period` steps instead of a gradient all-reduce every step"

    name: Literal["localsgd"] = "localsgd"
    group_period: int = Field(0, ge=0, description="hierarchical averaging: average within groups of `group_size` "
                                                   "ranks every this many steps (0: off; below `period`)")
    group_size: int = Field(0, ge=0, description="ranks per group for `group_period` (0: the ranks of one node)")
    # --- compression of the model average (strategies/localsgd.py: CompressedAverage)
    compression: Literal["none", "fp16", "bf16"] = Field(
        "none", description="none (torch's averagers, fp32), fp16 / bf16: all-reduce each model's change since "
                            "the last average in 16 bits (half the bytes); not with group_period")

    @model_validator(mode="after")
    def _group_below_period(self) -> "LocalSGDSpec":
        if self.group_period and self.group_period >= self.period:
            raise ValueError(f"group_period = {self.group_period}: must be below period = {self.period} "
                             "(the across-ranks average is the rarer one)")
        if self.group_period and self.compression != "none":
            raise ValueError(f"compression = {self.compression!r}: not with hierarchical averaging "
                             f"(group_period = {self.group_period}); use one or the other")
        return self

    def check_experiment(self, exp: Any) -> None:
        world = exp.cluster.world_size
        # torch's subgroups split the ranks into equal groups: a size past the world or not dividing it
        # failed in every rank as it built them.
        if self.group_size and (self.group_size > world or world % self.group_size):
            divisors = ", ".join(str(d) for d in range(1, world + 1) if world % d == 0)
            raise ConfigError(f"strategy.group_size = {self.group_size}: must divide cluster.world_size = {world} "
                              f"(equal groups); allowed: {divisors}")

    def averages_after(self, step: int) -> Literal["all", "group"] | None:
        """HierarchicalModelAverager's rule when hierarchical: after warm-up, the largest period that
        divides the step (itself, not the steps since warm-up) picks the group."""
        if not self.group_period:
            return super().averages_after(step)
        if step < self.warmup_steps:
            return None
        return "all" if step % self.period == 0 else "group" if step % self.group_period == 0 else None

    def averages_per_step(self) -> float:
        return 1.0 / (self.group_period or self.period)


@strategy_spec
class DiLoCoSpec(LocalSGDSpec):
    traits = Traits(family="collective", simplicity=5, synchronous=False)
    description = "DiLoCo: local SGD whose averages are stepped by an outer Nesterov-momentum SGD"
    advice = "a very slow network: rare averages, the outer momentum keeps the progress per average"

    name: Literal["diloco"] = "diloco"
    period: int = Field(20, ge=1, description="H: inner steps between outer steps")
    outer_lr: float = Field(0.7, gt=0, le=1e6, description="outer learning rate on the pseudo-gradient (1 with momentum 0: "
                                                   "plain local SGD)")
    outer_momentum: float = Field(0.9, ge=0, lt=1, description="outer Nesterov momentum (0: none)")
    # With hierarchical averaging the outer step follows the averages across all ranks only.


@strategy_spec
class CoCoDSpec(ModelAveragingSpec):
    traits = Traits(family="collective", simplicity=4, synchronous=False)
    description = "CoCoD-SGD: local SGD whose model average stays in flight during the next round's local steps"
    advice = "a slow network with compute to hide it behind: the average costs nothing while a round lasts longer"

    name: Literal["cocod"] = "cocod"
    overlap: bool = Field(True, description="the average completes during the next round (off: before the next "
                                            "step, which is plain local SGD)")
