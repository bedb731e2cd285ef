"""Well-known models by name (predict/models.toml): `predict --model llama3-8b` instead of seven sizes."""

from __future__ import annotations

import functools
import tomllib
from importlib import resources
from typing import Any


@functools.lru_cache(maxsize=1)
def model_presets() -> dict[str, dict[str, Any]]:
    """Preset name -> its table: `model` (gpt or hf:ARCH), the sizes, and `source`."""
    return tomllib.loads(resources.files("ddlscope.predict").joinpath("models.toml").read_text())


def expand_preset(model: dict[str, Any]) -> dict[str, Any]:
    """A [model] table naming a preset as the table of the model it is, the preset's sizes under the
    table's own keys (what a user gives beside a preset wins); any other table as it is."""
    preset = model_presets().get(model.get("name")) if isinstance(model.get("name"), str) else None
    if preset is None:
        return model
    sizes = {k: v for k, v in preset.items() if k not in ("model", "source")}
    return {**sizes, **model, "name": preset["model"]}
