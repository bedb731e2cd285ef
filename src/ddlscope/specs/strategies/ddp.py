"""`ddp`: torch DistributedDataParallel's knobs."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, model_validator

from ddlscope.specs.strategies.batching import HeteroBatchKnobs
from ddlscope.specs.strategy import Traits, strategy_spec

_POWERSGD_CALL = re.compile(r"^powersgd\((\d+)\)$")


@strategy_spec
class DDPSpec(HeteroBatchKnobs):  # batch_split, worker_speeds: specs/strategies/batching.py
    traits = Traits(family="collective", simplicity=1)
    description = "torch DistributedDataParallel: bucketed all-reduce overlapped with backward; fp16/PowerSGD hooks"
    advice = "the main study's choice for a homogeneous, gang-scheduled cluster whose model fits"

    name: Literal["ddp"] = "ddp"
    bucket_mb: float = Field(25.0, gt=0, description="gradient bucket size in MiB (DDP's bucket_cap_mb)")
    gradient_as_bucket_view: bool = Field(False, description="gradients are views into the all-reduce buckets")
    static_graph: bool = Field(False, description="tell DDP the graph does not change between steps")
    comm_hook: Literal["none", "fp16", "powersgd"] = Field(
        "none", description="none (plain all-reduce), fp16 (compress to fp16), powersgd (low-rank); powersgd(R) sets the rank")
    powersgd_rank: int = Field(1, ge=1, description="PowerSGD matrix approximation rank")
    powersgd_start_iter: int = Field(2, ge=2, description="plain all-reduce before this iteration (torch needs >= 2)")

    @model_validator(mode="before")
    @classmethod
    def _parse_powersgd_call(cls, data: Any) -> Any:
        """Accept comm_hook = "powersgd(4)" as shorthand for the hook plus its rank."""
        if isinstance(data, dict) and isinstance(data.get("comm_hook"), str):
            match = _POWERSGD_CALL.match(data["comm_hook"].strip())
            if match:
                data = {**data, "comm_hook": "powersgd", "powersgd_rank": int(match.group(1))}
        return data
