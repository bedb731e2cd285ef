"""Catalogues: `strategies` and `workloads` list what the registries hold, with each knob's default."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from ddlscope.cli.common import console


def strategies() -> None:
    """List the registered strategies and their knobs."""
    from ddlscope.specs import strategy_specs

    _print_catalogue("strategy", [(cls.model_fields["name"].default, cls) for cls in strategy_specs()],
                     base_fields={"name"})


def workloads() -> None:
    """List the registered workloads and their knobs."""
    from ddlscope.specs import WorkloadSpec
    from ddlscope.workloads import WORKLOADS

    _print_catalogue("workload", WORKLOADS.items(), base_fields=set(WorkloadSpec.model_fields))


def _print_catalogue(kind: str, items: list[tuple[str, Any]], base_fields: set[str]) -> None:
    table = Table(kind, "description", "knobs (default)")
    for name, plugin in items:
        spec_class = getattr(plugin, "spec_class", plugin)  # a workload plugin, or a strategy's spec class
        knobs = ", ".join(f"{k}={f.default!r}" for k, f in spec_class.model_fields.items()
                          if k not in base_fields)
        table.add_row(name, plugin.description, knobs or "-")
    console.print(table)
