"""`ddp`: torch DistributedDataParallel's knobs."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, model_validator

from ddlscope.specs.strategies.batching import HeteroBatchKnobs
from ddlscope.specs.strategy import Traits, strategy_spec

_POWERSGD_CALL = re.compile(r"^powersgd\((\d+)\)$")
GATHERED_HOOKS = ("topk", "qsgd", "minmax8")  # lossy codes that do not sum in place: all-gathered, decoded by all
QSGD_CHUNK = 512  # entries per QSGD norm (the paper's bucket size d)


def qsgd_code_bits(levels: int) -> int:
    """QSGD's bits per entry: 2 s + 1 codes (sign and level) packed in 2, 4 or 8 bits."""
    values = 2 * levels + 1
    return 2 if values <= 4 else 4 if values <= 16 else 8


@strategy_spec
class DDPSpec(HeteroBatchKnobs):  # batch_split, worker_speeds: specs/strategies/batching.py
    traits = Traits(family="collective", simplicity=1)
    description = ("torch DistributedDataParallel: bucketed all-reduce overlapped with backward; compression hooks "
                   "(fp16, bf16, PowerSGD, top-k, QSGD, 8-bit), bucket plans (per layer, MG-WFBP)")
    advice = "the main study's choice for a homogeneous, gang-scheduled cluster whose model fits"

    name: Literal["ddp"] = "ddp"
    # At most 1 TiB: past every model's gradients (one bucket anyway); 1e308 overflowed DDP's int(bytes) in a rank.
    bucket_mb: float = Field(25.0, gt=0, le=2**20, description="gradient bucket size in MiB (DDP's bucket_cap_mb), "
                                                             "at most 1 TiB")
    gradient_as_bucket_view: bool = Field(False, description="gradients are views into the all-reduce buckets")
    static_graph: bool = Field(False, description="tell DDP the graph does not change between steps")
    comm_hook: Literal["none", "fp16", "bf16", "powersgd", "topk", "qsgd", "minmax8"] = Field(
        "none", description="none (plain all-reduce), fp16 / bf16 (cast to 16 bits), powersgd (low-rank; powersgd(R) "
                            "sets the rank), topk (largest k with error feedback), qsgd (s levels), minmax8 (8-bit "
                            "min-max, ByteGrad); see strategies/compression.py")
    powersgd_rank: int = Field(1, ge=1, le=1024, description="PowerSGD matrix approximation rank (the paper: 1-4)")
    powersgd_start_iter: int = Field(2, ge=2, description="plain all-reduce before this iteration (torch needs >= 2)")

    # --- gradient compression knobs of our own hooks (strategies/compression.py)
    topk_ratio: float = Field(0.01, gt=0, le=1, description="topk: fraction of each bucket's elements sent")
    qsgd_levels: int = Field(4, ge=1, le=127, description="qsgd: s, quantisation levels per sign (codes packed in "
                                                           "2, 4 or 8 bits: 1, <= 7, <= 127)")

    # --- bucketing (MG-WFBP, predict/bucketing.py)
    buckets: Literal["size", "per_layer", "mgwfbp"] = Field(
        "size", description="size (DDP's bucket_mb buckets), per_layer (one bucket per layer), mgwfbp (the optimal "
                            "merge of layers from measured backward times and the all-reduce's alpha-beta)")

    @model_validator(mode="before")
    @classmethod
    def _parse_powersgd_call(cls, data: Any) -> Any:
        """Accept comm_hook = "powersgd(4)" as shorthand for the hook plus its rank."""
        if isinstance(data, dict) and isinstance(data.get("comm_hook"), str):
            match = _POWERSGD_CALL.match(data["comm_hook"].strip())
            if match:
                data = {**data, "comm_hook": "powersgd", "powersgd_rank": int(match.group(1))}
        return data

    def payload_fraction(self) -> float | None:
        """Bytes a rank sends per byte of fp32 gradient with this hook (per-bucket headers aside); None for
        PowerSGD, whose share depends on the matrices' shapes."""
        return {"none": 1.0, "fp16": 0.5, "bf16": 0.5, "topk": 2 * self.topk_ratio,
                "qsgd": qsgd_code_bits(self.qsgd_levels) / 32 + 1 / QSGD_CHUNK, "minmax8": 0.25}.get(self.comm_hook)
