"""The `ddlscope` command line: the typer app and its entry point.

Each command lives in the module of its group (run, study, catalogue, slurm, report, predict, advise,
partition, calibrate); what groups share (consoles, --db, --json, the one-line user-error path) is in `common`.
This module only puts the commands on the app, in the order `ddlscope --help` lists them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import typer

from ddlscope.cli import (advise, buckets, calibrate, catalogue, memory, partition, predict, report, run, slurm,
                          study, traces)
from ddlscope.cli.common import run_app

__all__ = ["COMMANDS", "app", "main"]

app = typer.Typer(
    help="ddlscope: run, measure, explain and predict distributed deep-learning training strategies.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

# (name, function): the measuring commands first, then the predicting ones.
COMMANDS: tuple[tuple[str, Callable[..., Any]], ...] = (
    ("run", run.run),
    ("launch", run.launch),
    ("runs", run.runs),
    ("show", run.show),
    ("export", run.export),
    ("trace", run.trace),
    ("import-trace", traces.import_trace),
    ("study", study.study),
    ("studies", study.studies),
    ("sweep", study.sweep),
    ("omnivore-tune", study.omnivore_tune),
    ("scaling", run.scaling),
    ("strategies", catalogue.strategies),
    ("workloads", catalogue.workloads),
    ("slurm", slurm.slurm),
    ("report", report.report),
    ("predict", predict.predict_command),
    ("plan", predict.plan_command),
    ("advise", advise.advise_command),
    ("partition", partition.partition_command),
    ("buckets", buckets.buckets_command),
    ("calibrate", calibrate.calibrate),
    ("predict-run", predict.predict_run),
    ("memory", memory.memory_command),
)
for name, command in COMMANDS:
    app.command(name)(command)


def main(argv: list[str] | None = None) -> int:
    """Console-script entry: user errors become one line on stderr and exit status 2."""
    return run_app(app, argv)  # reads `app` now, so that a test may swap it
