"""`calibrate`: measure this machine (compute, memory bandwidth, gloo collectives, what synchronisation
costs) and keep the profile in a TOML file and in the store, for `predict-run` and local:1xN clusters.

Bad input raises ConfigError / StoreError, which the CLI's main() prints as one line (exit 2).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from ddlscope.cli.common import DEFAULT_DB, console, db_option, json_option, max_ranks_per_node
from ddlscope.specs import ConfigError
from ddlscope.store import Store


def calibrate(
    world_sizes: Annotated[str, typer.Option("--world-sizes", help="Comma-separated world sizes to measure (3: a parameter server with two workers).")] = "2,3,4",
    quick: Annotated[bool, typer.Option("--quick", help="Fewer sizes and repeats (seconds instead of a minute).")] = False,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Profile TOML to write.")] = None,
    db: Annotated[Path, db_option("Store that keeps the profile too (predict-run reads the newest).")] = DEFAULT_DB,
    as_json: Annotated[bool, json_option("Print the profile as one JSON object.")] = False,
) -> None:
    """Measure this machine: matmul FLOP/s, memory bandwidth, gloo collectives per world size, and what
    synchronisation, DDP, FSDP and a parameter server's round cost here (for `predict-run`)."""
    from ddlscope.calibrate import DEFAULT_PROFILE, calibrate as run_calibration, write_profile

    sizes = parse_world_sizes(world_sizes)
    path = output or DEFAULT_PROFILE
    if path.parent and not path.resolve().parent.exists():
        raise ConfigError(f"--output {path}: folder {path.resolve().parent} does not exist")
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    with Store(db):  # a bad --db fails now, not after a minute of measuring
        pass
    profile = run_calibration(sizes, quick)
    write_profile(profile, path)
    with Store(db) as store:
        calibration_id = store.add_calibration(profile)
    if as_json:
        print(json.dumps(profile))
        return
    console.print(compute_table(profile))
    console.print(calibration_table(profile))
    load, cores = profile["meta"]["load_average_1min"], profile["meta"]["cores"]
    if load > cores / 2:
        console.print(f"[yellow]note:[/yellow] load average {load:.1f} on {cores} cores during calibration: "
                      "other processes were running; figures may be pessimistic and noisy")
    console.print(f"profile: {path.resolve()} (also calibration {calibration_id} in {db})", markup=False,
                  highlight=False)


def parse_world_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"--world-sizes = {text!r}: expected comma-separated integers, e.g. 2,4") from None
    if not sizes or any(s < 2 for s in sizes):
        raise ConfigError(f"--world-sizes = {text!r}: each world size must be >= 2")
    limit, why = max_ranks_per_node()
    if max(sizes) > limit:
        raise ConfigError(f"--world-sizes = {text!r}: {max(sizes)} ranks is more than this machine starts "
                          f"({limit}: {why})")
    return sorted(set(sizes))


def calibration_table(profile: dict[str, Any]) -> Table:
    table = Table("collective", "ranks", "alpha us", "beta MB/s", "R^2 (bw fit)", "R^2 (all sizes)",
                  title="gloo collectives: time = alpha + bytes / beta")
    for key, entry in profile["collectives"].items():
        for op, fit in entry.items():
            table.add_row(op, key.removeprefix("ws"), f"{fit['alpha_s'] * 1e6:.1f}",
                          f"{fit['beta_bytes_per_s'] / 1e6:.1f}", f"{fit['r2']:.4f}", f"{fit['r2_all']:.4f}")
    return table


def compute_table(profile: dict[str, Any]) -> Table:
    c = profile["compute"]
    table = Table("matmul n", "GFLOP/s", title=f"fp32 matmul, {c['threads']} thread")
    for n, f in zip(c["matmul"]["sizes"], c["matmul"]["flops"]):
        table.add_row(str(n), f"{f / 1e9:.1f}")
    table.add_row("peak", f"{c['peak_flops'] / 1e9:.1f}")
    table.add_row("fit peak", f"{c['matmul']['peak_flops'] / 1e9:.1f} (R^2 {c['matmul']['r2']:.4f})")
    if c.get("bf16"):
        table.add_row(f"bf16 {c['bf16']['size']}", f"{c['bf16']['flops'] / 1e9:.1f}")
    table.add_row("memory copy", f"{c['memory_bandwidth_bytes_per_s'] / 1e9:.2f} GB/s")
    table.add_row("per-op overhead", f"{c['op_overhead_s'] * 1e6:.2f} us")
    return table
