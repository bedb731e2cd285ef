"""`ddlscope buckets RUN`: MG-WFBP's optimal merge of a DDP run's layer gradients into buckets, and the
exposed communication it predicts, against DDP's size buckets and one bucket per layer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from ddlscope.cli.common import DEFAULT_DB, DbOption, JsonOption, RunArg, console, open_store


def buckets_command(
    run_ref: RunArg,
    db: DbOption = DEFAULT_DB,
    as_json: JsonOption = False,
    calibration: Annotated[Optional[Path], typer.Option(
        "--calibration", help="For a run without an emulated network: profile TOML from `ddlscope calibrate` "
                              "(default: the newest of the run's host in the store).")] = None,
) -> None:
    """The optimal bucket plan (MG-WFBP) for a run's model and network, and the predicted exposed
    communication of it, of DDP's bucket_mb buckets and of one bucket per layer; the run's measured one."""
    from ddlscope.studies.buckets import bucket_report

    with open_store(db) as store:
        report = bucket_report(store, store.get_run(run_ref), calibration)
    if as_json:
        print(json.dumps(report.to_dict()))
        return
    _print(report)


def _print(report) -> None:  # type: ignore[no-untyped-def]
    console.print(f"run {report.run_id}: {report.source}; all-reduce alpha {report.link.alpha_s * 1e3:.3f} ms, "
                  f"{1 / report.link.beta_s_per_byte / 1e6 if report.link.beta_s_per_byte else float('inf'):.1f} "
                  "MB/s", markup=False)
    layers = report.plans[0].layers
    table = Table("bucket plan", "buckets", "layers per bucket (backward order)", "predicted exposed ms",
                  title=f"{len(layers)} layers, backward {report.plans[0].backward_s * 1e3:.1f} ms")
    for plan in report.plans:
        sizes = ", ".join(str(e - s + 1) for s, e in plan.buckets)
        table.add_row(plan.name, str(len(plan.buckets)), sizes, f"{plan.exposed_s * 1e3:.2f}")
    console.print(table)
    optimal = report.plans[0]
    for i, (s, e) in enumerate(optimal.buckets):
        console.print(f"  bucket {i}: {', '.join(l.name for l in layers[s:e + 1])} "
                      f"({optimal.bucket_bytes()[i] / 1e3:.1f} kB)", markup=False)
    used = f"the run used {report.used.name}" if report.used else "the run used DDP's size buckets"
    measured = (f"{report.measured_exposed_s * 1e3:.2f} ms" if report.measured_exposed_s is not None
                else "not recorded")
    console.print(f"{used}; measured exposed communication per step: {measured}", markup=False)
