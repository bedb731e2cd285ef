"""`report RUN... -o report.html`: one self-contained HTML page comparing stored runs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ddlscope.cli.common import (DEFAULT_DB, DbOption, UserError, check_not_special, err_console, require_store,
                                 run_ref_callback)
from ddlscope.store import Store


def report(
    run_refs: Annotated[list[str], typer.Argument(metavar="RUN", help="Run ids, uuid prefixes or names (one or more).",
                                                  callback=run_ref_callback)],
    output: Annotated[Path, typer.Option("--output", "-o", help="HTML file to write.")] = Path("report.html"),
    db: DbOption = DEFAULT_DB,
    title: Annotated[Optional[str], typer.Option("--title", help="Page title (default: the runs).")] = None,
) -> None:
    """Write a self-contained HTML report of RUNs: configs, summary, breakdowns, memory, curves, PS views."""
    require_store(db)
    if output.is_dir():
        raise UserError(f"--output {output} is a directory; give a file name, e.g. {output / 'report.html'}")
    check_not_special(output, "--output")
    if not output.resolve().parent.is_dir():
        raise UserError(f"--output {output}: folder {output.resolve().parent} does not exist")
    from ddlscope.report.html import run_label, runs_report, write_report

    with Store(db) as store:
        runs, seen = [], set()
        for ref in run_refs:
            run = store.get_run(ref)  # StoreError for a bad ref: main() makes it one line + exit 2
            if run.id not in seen:
                seen.add(run.id)
                runs.append(run)
        page = runs_report(store, runs, title or "ddlscope report: " + ", ".join(run_label(r) for r in runs))
    write_report(page, output)
    err_console.print(f"wrote {output} ({len(page) / 1024:.0f} KiB, {len(runs)} run"
                      f"{'s' if len(runs) != 1 else ''})", markup=False, highlight=False)
