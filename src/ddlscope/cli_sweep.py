"""`ddlscope sweep GRID.toml`: every combination of a grid of experiment fields, resumable, with the
same progress bar, cell table and HTML report as `ddlscope study`.

`register(app)` adds the command to a typer app. Bad input raises
`ddlscope.specs.ConfigError`; the CLI's main() prints its one-line message
and exits with status 2, before any cell runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer


def register(app: typer.Typer) -> None:
    """Add the `sweep` command to `app`."""
    app.command("sweep")(sweep_command)


def sweep_command(
    grid: Annotated[Path, typer.Argument(metavar="GRID.toml", help="Sweep file: name, repeats, [base] experiment, "
                                         "[grid] of dotted fields and their values (docs/user-guide.md).")],
    fresh: Annotated[bool, typer.Option("--fresh", help="Rerun every cell instead of reusing finished ones.")] = False,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="HTML report path (default: NAME-report.html).")] = None,
    db: Annotated[Path, typer.Option("--db", help="SQLite store holding runs and their rows.")] = Path("ddlscope.db"),
) -> None:
    """Run a grid of experiments (reusing cells already in the store), then print and write its report."""
    from ddlscope.cli_study import check_db_folder, run_study_command
    from ddlscope.studies.sweep import load_sweep

    study, cells = load_sweep(grid)  # every cell validated before the first one starts
    check_db_folder(db)
    run_study_command("sweep", study, study.name, cells, db, fresh, output or Path(f"{study.name}-report.html"),
                      f"ddlscope sweep {study.name}")
