"""The one wrap-unit rule: how a model splits into blocks (FSDP's units, recompute's units).

FSDP's `wrap = "block"` shards each unit on its own (strategies/fsdp.py); the
local predictor prices FSDP per unit (calibrate's `fsdp_units`), advise
divides the gathered parameters by the unit count, and a model source's
`recompute = "full"` rebuilds each unit's activations in backward. All read
this rule.

For a model ddlscope did not write, the units are its repeated blocks, found
the way a person would find them: the classes a Hugging Face model names as
not to be split (`_no_split_modules`: its decoder layers), else the module
class that repeats and holds the most parameters (torchvision's and timm's
residual blocks, ConvNeXt blocks, ViT encoder blocks). `wrap_class` names the
class to use instead.
"""

from __future__ import annotations

from collections import defaultdict

from torch import nn

from ddlscope.specs import ConfigError

# Containers and single layers are never units themselves: a unit is a block with layers inside.
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
MIN_REPEATS = 2


def wrap_units(model: nn.Module, wrap_class: str | None = None) -> list[nn.Module]:
    """The modules to shard as units, outermost first, none inside another.

    `wrap_class` (a class name) if given; else transformer blocks if the model
    has them (`model.blocks`, a non-empty ModuleList: ddlscope's own models);
    else the classes a transformers model names in `_no_split_modules`; else
    its most parameter-heavy repeated block class; else each top-level child
    that holds parameters. Parameters outside every unit stay with the root.
    """
    if wrap_class:
        units = _outermost(model, {wrap_class})
        if not units:
            found = ", ".join(sorted(repeated_block_classes(model))[:8]) or "none"
            raise ConfigError(f"strategy.wrap_class = {wrap_class!r}: the model has no module of that class; "
                              f"its repeated blocks: {found}")
        return units
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList) and len(blocks):
        return list(blocks)
    no_split = {name for m in model.modules() for name in (getattr(m, "_no_split_modules", None) or [])}
    units = _outermost(model, no_split) if no_split else []
    if len(units) >= MIN_REPEATS:
        return units
    heaviest = _heaviest_repeated_class(model)
    if heaviest:
        return _outermost(model, {heaviest})
    return [child for child in model.children() if any(True for _ in child.parameters())]


def repeated_block_classes(model: nn.Module) -> dict[str, int]:
    """Block classes (modules with parameterised children, not containers) that occur at least twice:
    class name -> parameters held by all their instances that are not inside another of them."""
    instances: dict[str, list[nn.Module]] = defaultdict(list)
    for module in model.modules():
        if module is model or isinstance(module, _CONTAINERS):
            continue
        if any(any(True for _ in child.parameters()) for child in module.children()):
            instances[type(module).__name__].append(module)
    return {name: sum(_params(m) for m in _outermost(model, {name}))
            for name, found in instances.items() if len(found) >= MIN_REPEATS}


def _heaviest_repeated_class(model: nn.Module) -> str | None:
    weights = repeated_block_classes(model)
    # Ties (a block class and a class wrapping exactly one of it) go to the first found, the outer one.
    return max(weights, key=weights.__getitem__) if weights else None


def _outermost(model: nn.Module, class_names: set[str]) -> list[nn.Module]:
    """Modules of the named classes, in model order, skipping any inside another one found."""
    found: list[nn.Module] = []

    def walk(module: nn.Module) -> None:
        for child in module.children():
            if type(child).__name__ in class_names:
                found.append(child)
            else:
                walk(child)

    walk(model)
    return found


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
