"""`ddlscope partition CFG --stages P --memory-limit X`: the pipeline partition that balances time under a
memory limit, from this machine's per-layer profile of the experiment's model."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from ddlscope.cli.common import JsonOption, UserError, console

UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> float:
    """'512MiB', '1.5GB', '2e8' -> bytes."""
    match = _SIZE.match(text)
    if not match or match.group(2).lower() not in UNITS:
        raise UserError(f"--memory-limit {text!r}: expected a size such as 512MiB, 1.5GB or 200000000 "
                        f"(units: {', '.join(u for u in UNITS if u)})")
    value = float(match.group(1)) * UNITS[match.group(2).lower()]
    if value <= 0:
        raise UserError(f"--memory-limit {text!r}: must be more than 0 bytes")
    return value


def partition_command(
    config: Annotated[Optional[Path], typer.Argument(help="TOML experiment file (as for `ddlscope run`); "
                                                          "its workload is profiled layer by layer here.")] = None,
    stages: Annotated[int, typer.Option("--stages", help="Pipeline stages (one per rank).", min=1)] = 2,
    memory_limit: Annotated[str, typer.Option("--memory-limit", help="Per-stage memory: parameters, gradients, "
                                              "optimizer state and in-flight activations, e.g. 256MiB.")] = "1GiB",
    micro_batches: Annotated[int, typer.Option("--micro-batches", help="Micro-batches per step; the workload's "
                                               "batch_size / this is the micro-batch profiled.", min=1)] = 4,
    schedule: Annotated[str, typer.Option("--schedule", help="gpipe (a stage holds all m micro-batches) or 1f1b "
                                          "(stage s holds p - s).")] = "1f1b",
    no_recompute: Annotated[bool, typer.Option("--no-recompute", help="Search boundaries only, never "
                                               "recomputation.")] = False,
    workload: Annotated[Optional[str], typer.Option("--workload", "-w", help="Workload name (overrides the file).")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override any field: section.key=value (repeatable).")] = None,
    as_json: JsonOption = False,
) -> None:
    """Cut the model into stages: the exact search (dynamic programming over layer boundaries and
    per-stage recompute) that minimises the slowest stage under the memory limit, against equal layers."""
    from ddlscope.runtime.config import load_experiment, parse_override
    from ddlscope.studies.partition import partition_report

    if schedule not in ("gpipe", "1f1b"):
        raise UserError(f"--schedule {schedule!r}: allowed: gpipe, 1f1b")
    limit = parse_bytes(memory_limit)
    overrides: dict[str, Any] = {"cluster.world_size": 1}  # the profile runs here, in one process
    if workload:
        overrides["workload.name"] = workload
    for item in set_ or []:
        key, value = parse_override(item)
        overrides[key] = value
    exp = load_experiment(config, overrides)
    report = partition_report(exp, stages, limit, micro_batches, schedule, allow_recompute=not no_recompute)
    if as_json:
        print(json.dumps(report.to_dict()))
        return
    _print(report)


def _print(report: Any) -> None:
    mib = 2**20
    console.print(f"{report.stages} stages, {report.micro_batches} micro-batches of {report.micro_batch} samples, "
                  f"{report.schedule}, memory limit {report.memory_limit_bytes / mib:.1f} MiB per stage")
    names = [l.name for l in report.layers]
    for label, plan in (("balanced (exact search)", report.balanced), ("equal blocks per stage", report.equal)):
        if plan is None:
            console.print(f"{label}: no partition fits the limit", markup=False)
            continue
        table = Table("stage", "layers", "recompute", "ms / micro-batch", "MiB", title=label)
        for i, s in enumerate(plan.stages):
            over = s.memory_bytes > report.memory_limit_bytes
            table.add_row(str(i), f"{names[s.start]} .. {names[s.stop - 1]}", "yes" if s.recompute else "no",
                          f"{s.time_s * 1e3:.2f}", f"{'[red]' if over else ''}{s.memory_bytes / mib:.1f}")
        console.print(table)
        console.print(f"  predicted step {report.predicted_step_s(plan) * 1e3:.1f} ms, slowest stage "
                      f"{plan.slowest_s * 1e3:.2f} ms, fullest {plan.fullest_bytes / mib:.1f} MiB; run it with "
                      f"--set 'strategy.partition={plan.cuts}'"
                      + (f" --set 'strategy.recompute={[i for i, s in enumerate(plan.stages) if s.recompute]}'"
                         if any(s.recompute for s in plan.stages) else ""), markup=False)
    largest = report.largest_micro_batch
    console.print("largest micro-batch under the limit: " + ", ".join(f"{k} {v}" for k, v in largest.items()),
                  markup=False)
