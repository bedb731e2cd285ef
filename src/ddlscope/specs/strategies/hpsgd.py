"""`hpsgd`: gradient all-reduce overlapped with the next steps, applied late (PAPERS.md item 10).

Each step a worker launches the non-blocking all-reduce of its gradient and
applies the average launched `staleness` steps earlier, so the exchange runs
while the next steps compute. Every worker applies the same averaged
gradient, so the models stay equal; the gradient is stale. Staleness 0 waits
for the step's own average: DDP's update. The last step applies everything
still in flight, so a run applies as many updates as it has steps.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ddlscope.specs.strategy import StrategySpec, Traits, strategy_spec


@strategy_spec
class HPSGDSpec(StrategySpec):
    # Every worker applies the same update, but a stale one: not synchronous SGD's, so advise weighs its
    # staleness like the asynchronous strategies'.
    traits = Traits(family="collective", simplicity=4, synchronous=False)
    description = "HPSGD: the gradient all-reduce overlaps the next step's compute and is applied one step late"
    advice = "a network whose gradient all-reduce is about one step's compute: hidden, at one step of staleness"

    name: Literal["hpsgd"] = "hpsgd"
    staleness: int = Field(1, ge=0, description="steps between launching a gradient's all-reduce and applying it "
                                                "(0: at once, DDP's update)")

    def applies_after(self, step: int, last_step: int) -> list[int]:
        """The steps whose averaged gradients are applied at the end of `step`, oldest first."""
        if step == last_step:
            return list(range(max(0, step - self.staleness), step + 1))
        due = step - self.staleness
        return [due] if due >= 0 else []
