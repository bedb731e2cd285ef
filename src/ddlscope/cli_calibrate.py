"""`ddlscope calibrate` and `ddlscope predict-run`: measure this machine, predict a stored local run.

`register(app)` adds both commands to a typer app. Bad input raises
ConfigError / StoreError, which the CLI's main() prints as one line (exit 2).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from ddlscope.specs import ConfigError

console = Console()
err_console = Console(stderr=True)


def parse_world_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"--world-sizes = {text!r}: expected comma-separated integers, e.g. 2,4") from None
    if not sizes or any(s < 2 for s in sizes):
        raise ConfigError(f"--world-sizes = {text!r}: each world size must be >= 2")
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


def register(app: typer.Typer) -> None:
    """Add `calibrate` and `predict-run` to `app`."""

    @app.command()
    def calibrate(
        world_sizes: Annotated[str, typer.Option("--world-sizes", help="Comma-separated world sizes to measure (3: a parameter server with two workers).")] = "2,3,4",
        quick: Annotated[bool, typer.Option("--quick", help="Fewer sizes and repeats (seconds instead of a minute).")] = False,
        output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Profile TOML to write.")] = None,
        db: Annotated[Path, typer.Option("--db", help="Store that keeps the profile too (predict-run reads the newest).")] = Path("ddlscope.db"),
        as_json: Annotated[bool, typer.Option("--json", help="Print the profile as one JSON object.")] = False,
    ) -> None:
        """Measure this machine: matmul FLOP/s, memory bandwidth, gloo collectives per world size, and what
        synchronisation, DDP, FSDP and a parameter server's round cost here (for `predict-run`)."""
        from ddlscope.calibrate import DEFAULT_PROFILE, calibrate as run_calibration, write_profile
        from ddlscope.store import Store

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
        console.print(f"profile: {path.resolve()} (also calibration {calibration_id} in {db})")

    @app.command("predict-run")
    def predict_run(
        run_ref: Annotated[str, typer.Argument(metavar="RUN", help="Run id, uuid (prefix) or name.")],
        calibration: Annotated[Optional[Path], typer.Option("--calibration", help="Profile TOML from `ddlscope calibrate` (default: the newest in the store for the run's host, else ./ddlscope-calibration.toml).")] = None,
        db: Annotated[Path, typer.Option("--db", help="SQLite store holding runs and their rows.")] = Path("ddlscope.db"),
        as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    ) -> None:
        """Predict a stored local run from its config and this machine's calibration; compare with what it measured."""
        print_run_prediction(run_ref, db, calibration, as_json)


def print_run_prediction(run_ref: str, db: Path, calibration: Path | None, as_json: bool) -> None:
    """`predict-run RUN` and `predict --against RUN`: predicted next to measured."""
    result = predict_stored_run(run_ref, db, calibration)
    if as_json:
        print(json.dumps(result, default=str))
        return
    console.print(prediction_table(result))
    for note in result["predicted"]["notes"]:
        console.print(f"[yellow]note:[/yellow] {note}")


def predict_stored_run(run_ref: str, db: Path, calibration: Path | None) -> dict[str, Any]:
    """Prediction, measurement and errors for one stored run (the logic behind `predict-run`)."""
    from ddlscope.analysis.summary import summarize
    from ddlscope.calibrate import workload_facts
    from ddlscope.predict.local import compare, measured_from_summary, predict_local
    from ddlscope.store import Store, StoreError

    if not db.exists():
        raise StoreError(f"no store at {db} (run `ddlscope run` first, or pass --db)")
    with Store(db) as store:
        run = store.get_run(run_ref)
        summary = summarize(store, run).to_dict()
        profile, source = resolve_calibration(store, calibration, run.host)
    facts = workload_facts(run.config)
    predicted = predict_local(run.config, run.environment, facts, profile)
    measured = measured_from_summary(summary)
    return {"run": {"id": run.id, "name": run.name, "workload": run.workload, "strategy": run.strategy,
                    "world_size": run.world_size, "network": run.environment.get("network", {}).get("profile")},
            "calibration": source,
            "predicted": predicted, "measured": measured, "error": compare(predicted, measured)}


def resolve_calibration(store: Any, calibration: Path | None, host: str) -> tuple[dict[str, Any], str]:
    """The profile to predict with, and where it came from: --calibration FILE; else the newest
    calibration in the store taken on the run's host; else ./ddlscope-calibration.toml."""
    from ddlscope.calibrate import DEFAULT_PROFILE, load_profile

    if calibration is not None:
        return load_profile(calibration), str(calibration)
    stored = store.latest_calibration(host)
    if stored is not None:
        return stored[1], f"calibration {stored[0]} in {store.path}"
    if DEFAULT_PROFILE.is_file():
        return load_profile(DEFAULT_PROFILE), str(DEFAULT_PROFILE)
    raise ConfigError(f"no calibration of host {host!r} in {store.path} and no {DEFAULT_PROFILE}: "
                      "run `ddlscope calibrate` first (or pass --calibration FILE)")


def this_machine_profile(calibration: Path | None, db: Path) -> dict[str, Any]:
    """The profile that `local:1xN` clusters describe: --calibration FILE, else the newest
    calibration of this host in the store at `db` (when it exists), else ./ddlscope-calibration.toml."""
    import socket

    from ddlscope.calibrate import DEFAULT_PROFILE, load_profile
    from ddlscope.store import Store

    if calibration is None and db.is_file():
        with Store(db) as store:
            return resolve_calibration(store, None, socket.gethostname())[0]
    return load_profile(calibration or DEFAULT_PROFILE)


def prediction_table(result: dict[str, Any]) -> Table:
    p, m = result["predicted"], result["measured"]
    r = result["run"]
    table = Table("", "predicted", "measured", "error",
                  title=f"run {r['id']}: {r['strategy']} x{r['world_size']} {r['workload']} (network {r['network']})",
                  caption=f"machine profile: {result.get('calibration', '-')}")

    def ms(v: float | None) -> str:
        return f"{v * 1e3:.3f} ms" if v is not None else "-"

    def err(a: float | None, b: float | None) -> str:
        return f"{(a - b) / b * 100:+.1f}%" if a is not None and b else "-"

    table.add_row("step", ms(p["step_s"]), ms(m["step_s"]), err(p["step_s"], m["step_s"]))
    for phase, value in p["breakdown_s"].items():
        measured = m["breakdown_s"].get(phase)
        table.add_row(f"  {phase}", ms(value), ms(measured), err(value, measured))
    for cat, value in p["memory_bytes"]["worker"].items():
        measured = m["memory_bytes"].get(cat)
        table.add_row(f"{cat} bytes", str(value), str(measured), err(value, measured))
    table.add_row("model states bytes", str(p["model_state_bytes"]), str(m["model_state_bytes"]),
                  err(p["model_state_bytes"], m["model_state_bytes"]))
    return table
