"""The one wrap-unit rule: how a model splits into FSDP units.

FSDP's `wrap = "block"` shards each unit on its own (strategies/fsdp.py); the
local predictor prices FSDP per unit (calibrate's `fsdp_units`) and advise
divides the gathered parameters by the unit count. All three read this rule.
"""

from __future__ import annotations

from torch import nn


def wrap_units(model: nn.Module) -> list[nn.Module]:
    """Transformer blocks if the model has them (`model.blocks`, a non-empty ModuleList), else each
    top-level child that holds parameters. Parameters outside every unit stay with the root."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList) and len(blocks):
        return list(blocks)
    return [child for child in model.children() if any(True for _ in child.parameters())]
