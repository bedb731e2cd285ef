"""`calibrate`: measure this machine (compute, memory bandwidth, gloo collectives, what synchronisation
costs) and keep the profile in a TOML file and in the store, for `predict-run` and local:1xN clusters.

Bad input raises ConfigError / StoreError, which the CLI's main() prints as one line (exit 2).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from ddlscope.cli.common import DEFAULT_DB, console, db_option, json_option, max_ranks_per_node
from ddlscope.specs import ConfigError
from ddlscope.store import Store


def calibrate(
    world_sizes: Annotated[Optional[str], typer.Option("--world-sizes", help="Comma-separated world sizes to measure (3: a parameter server with two workers; default 2,3,4). Not with --model.")] = None,
    quick: Annotated[Optional[bool], typer.Option("--quick", help="Fewer sizes and repeats (seconds instead of a minute). Not with --model.")] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Profile TOML to write (--model: TOML, "
                                                   "or JSON for a .json path; default ddlscope-model-profile.toml).")] = None,
    db: Annotated[Optional[Path], db_option(f"Store that keeps the calibration too (predict-run reads the newest; "
                                            f"default {DEFAULT_DB}). Not with --model: a model profile is kept "
                                            "in its file only.")] = None,
    as_json: Annotated[bool, json_option("Print the profile as one JSON object.")] = False,
    model: Annotated[Optional[str], typer.Option(
        "--model", metavar="SOURCE:NAME", help="Profile this model instead (any workload: torchvision:, timm:, "
        "hf:, module:, or a built-in name): one rank's forward and backward per layer and as a whole step, on "
        "this device (for `predict --profile`; docs/profile.md).")] = None,
    set_: Annotated[Optional[list[str]], typer.Option(
        "--set", help="--model: override a field, section.key=value, e.g. workload.hidden=128 (repeatable).")] = None,
    batch: Annotated[Optional[int], typer.Option("--batch", help="--model: samples the rank computes "
                                                 "(default: the workload's batch_size).")] = None,
    repeats: Annotated[int, typer.Option("--repeats", help="--model: timed repeats per layer and step "
                                         "(medians, after 2 warm-up ones).")] = 5,
) -> None:
    """Measure this machine: matmul FLOP/s, memory bandwidth, gloo collectives per world size, and what
    synchronisation, DDP, FSDP and a parameter server's round cost here (for `predict-run`). With --model,
    profile a model instead: its layers' and whole step's forward and backward on this device."""
    if model is not None:
        unused = [flag for flag, value in (("--world-sizes", world_sizes), ("--quick", quick), ("--db", db))
                  if value is not None]
        if unused:  # they were silently ignored: a profile is one rank, kept in its file, not in the store
            raise ConfigError(f"--model profiles one rank into a file (-o): it does not use {', '.join(unused)}")
        calibrate_model(model, set_ or [], batch, repeats, output, as_json)
        return
    if set_ or batch is not None:
        raise ConfigError("--set and --batch go with --model (a model to profile)")
    db = db or DEFAULT_DB
    from ddlscope.calibrate import DEFAULT_PROFILE, calibrate as run_calibration, write_profile

    sizes = parse_world_sizes(world_sizes or "2,3,4")
    path = output or DEFAULT_PROFILE
    if path.parent and not path.resolve().parent.exists():
        raise ConfigError(f"--output {path}: folder {path.resolve().parent} does not exist")
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    with Store(db):  # a bad --db fails now, not after a minute of measuring
        pass
    profile = run_calibration(sizes, bool(quick))
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


DEFAULT_MODEL_PROFILE = Path("ddlscope-model-profile.toml")


def calibrate_model(model: str, sets: list[str], batch: int | None, repeats: int, output: Path | None,
                    as_json: bool) -> None:
    """`calibrate --model`: profile one rank of the model on this device, write it as TOML (JSON for a .json path)."""
    from ddlscope.calibrate.layer_profile import profile_model, write_model_profile
    from ddlscope.runtime.config import load_experiment, parse_override

    if batch is not None and batch < 1:
        raise ConfigError(f"--batch {batch}: must be >= 1")
    if repeats < 1:
        raise ConfigError(f"--repeats {repeats}: must be >= 1")
    path = output or DEFAULT_MODEL_PROFILE
    if not path.resolve().parent.is_dir():
        raise ConfigError(f"--output {path}: folder {path.resolve().parent} does not exist")
    overrides: dict[str, Any] = {"workload.name": model}
    for item in sets:
        key, value = parse_override(item)
        overrides[key] = value
    if batch is not None:
        overrides["workload.batch_size"] = batch
    overrides["cluster.world_size"] = 1  # one rank: the profile is what each rank of a run computes
    exp = load_experiment(None, overrides)
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    say = (lambda _: None) if as_json else (lambda text: console.print(f"[dim]{escape(text)}[/dim]"))
    profile = profile_model(exp.model_dump(mode="json"), repeats, progress=say)
    write_model_profile(profile, path)
    if as_json:
        print(json.dumps(profile))
        return
    console.print(model_table(profile))
    step = profile["step"]
    console.print(f"whole step measured as one: forward {step['forward_s'] * 1e3:.3f} ms + backward "
                  f"{step['backward_s'] * 1e3:.3f} ms; the layers sum to {profile['layers_sum_s'] * 1e3:.3f} ms, "
                  f"overhead beside them {profile['overhead_s'] * 1e3:+.3f} ms", markup=False, highlight=False)
    load, cores = profile["meta"]["load_average_1min"], profile["meta"]["cores"]
    if load > cores / 2:
        console.print(f"[yellow]note:[/yellow] load average {load:.1f} on {cores} cores while profiling: "
                      "other processes were running; figures may be pessimistic and noisy")
    if profile.get("untimed"):
        console.print(f"[yellow]note:[/yellow] not timed (no forward of theirs ran): {escape(', '.join(profile['untimed']))}; "
                      "their time is in the overhead beside the layers")
    console.print(f"profile: {path.resolve()}", markup=False, highlight=False)


def model_table(profile: dict[str, Any]) -> Table:
    from ddlscope.calibrate.layer_profile import summary_rows

    table = Table("layer", "forward ms", "backward ms", "GFLOP", title=escape(
        f"{profile['workload']['name']} at batch {profile['batch']} on {profile['device']['name']} "
        f"(split: {profile['split']})"))
    for name, forward_s, backward_s, flops in summary_rows(profile):
        table.add_row(escape(name), f"{forward_s * 1e3:.3f}", f"{backward_s * 1e3:.3f}", f"{flops / 1e9:.3f}")
    return table
