"""Catalogues: `strategies` and `workloads` list what the registries hold, with each knob's default."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from ddlscope.cli.common import console


def strategies() -> None:
    """List the registered strategies and their knobs."""
    from ddlscope.specs import strategy_specs

    table = Table("strategy", "traits", "description", "knobs (default)")
    for cls in strategy_specs():
        table.add_row(cls.registered_name, traits_text(cls.traits), cls.description,
                      _knobs(cls, {"name"}))
    console.print(table)


def traits_text(traits: Any) -> str:
    """What a strategy's traits say, in a few words: family, synchronous or not, what it shards."""
    words = [traits.family, "sync" if traits.synchronous else "async"]
    if traits.shards_model_states:
        words.append("sharded states")
    if not traits.local_optimizer:
        words.append("optimizer on servers")
    return ", ".join(words)


def workloads() -> None:
    """List the registered workloads and their knobs."""
    from ddlscope.specs import WorkloadSpec
    from ddlscope.workloads import WORKLOADS

    _print_catalogue("workload", WORKLOADS.items(), base_fields=set(WorkloadSpec.model_fields))
    shared = ", ".join(f"{name}={field.default!r}" for name, field in WorkloadSpec.model_fields.items()
                       if name != "name")
    # the data pipeline is a knob of every workload: say so where workloads are listed
    console.print(f"every workload also takes: {shared}, unless its row gives its own default (data = 'parquet': "
                  "sharded Parquet through loader workers, docs/data-pipeline.md)", soft_wrap=True)


def _print_catalogue(kind: str, items: list[tuple[str, Any]], base_fields: set[str]) -> None:
    table = Table(kind, "description", "knobs (default)")
    for name, plugin in items:
        table.add_row(name, plugin.description, _knobs(plugin.spec_class, base_fields))
    console.print(table)


def _knobs(spec_class: Any, base_fields: set[str]) -> str:
    """The spec's own knobs, and those of the base whose default it changes (gpt-char trains with adamw)."""
    base = next((c for c in spec_class.__mro__[1:] if set(getattr(c, "model_fields", {})) == base_fields), None)

    def default(cls: Any, k: str) -> Any:
        # get_default: a list knob's default comes from a factory (f.default is PydanticUndefined)
        return cls.model_fields[k].get_default(call_default_factory=True)

    shown = [k for k in spec_class.model_fields if k != "name" and (k not in base_fields or base is not None
                                                                   and default(spec_class, k) != default(base, k))]
    return ", ".join(f"{k}={default(spec_class, k)!r}" for k in shown) or "-"
