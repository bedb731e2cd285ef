"""`dbs`: dynamic batch size for synchronous data parallelism (PAPERS.md item 3).

DDP whose global batch is re-split over the workers every epoch (or every
`resplit_every_steps` steps) in proportion to the throughput each measured
since the last split (samples over its forward + backward compute, the
communication wait left out). Each worker's gradient is weighted by its
share, so the update is the global batch's exact mean gradient: with equal
speeds it is `ddp`. The split rule is specs/strategies/batching.py.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ddlscope.specs.strategies.ddp import DDPSpec
from ddlscope.specs.strategy import Traits, strategy_spec


@strategy_spec
class DBSSpec(DDPSpec):
    traits = Traits(family="collective", simplicity=3)
    description = "DDP with each worker's batch re-set every epoch in proportion to its measured throughput (DBS)"
    advice = "synchronous and exact like DDP, for workers of unequal speed: the fast ones take more of the batch"

    name: Literal["dbs"] = "dbs"  # type: ignore[assignment]
    # -- the dynamic split (DDP's knobs above still apply; batch_split sets the first split) -------
    resplit_every_steps: int = Field(
        0, ge=0, description="re-split the global batch every N steps from the throughput measured since the "
                             "last split (0: once per epoch)")
