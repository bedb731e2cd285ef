"""Studies: `study NAME` runs a named experiment set and writes its report; `studies` lists them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Column, Table

from ddlscope.cli.common import DEFAULT_DB, DbOption, UserError, console, err_console
from ddlscope.specs import is_baseline
from ddlscope.store import Store

MAX_STUDY_REPEATS = 10


def study(
    name: Annotated[str, typer.Argument(help="Study name (see `ddlscope studies`); `paper` is the main study.")],
    quick: Annotated[bool, typer.Option("--quick", help="Only the cells each headline needs (about 4 minutes here).")] = False,
    fresh: Annotated[bool, typer.Option("--fresh", help="Rerun every cell instead of reusing finished ones.")] = False,
    repeats: Annotated[int, typer.Option("--repeats", help="Seeds per cell whose outcome varies from run to run "
                                         "(the parameter servers'); headlines read their medians.")] = 3,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="HTML report path (default: NAME-report.html).")] = None,
    db: DbOption = DEFAULT_DB,
) -> None:
    """Run a study's cells (reusing those already in the store), then print and write its report."""
    from ddlscope.studies import STUDIES
    from ddlscope.studies.base import StudyCellFailed, run_cells

    try:
        study_obj = STUDIES.get(name)()
    except KeyError as exc:
        raise UserError(str(exc)) from None
    if db.parent and not db.resolve().parent.exists():
        raise UserError(f"--db {db}: folder {db.resolve().parent} does not exist")
    if not 1 <= repeats <= MAX_STUDY_REPEATS:
        raise UserError(f"--repeats {repeats}: must be between 1 and {MAX_STUDY_REPEATS}")
    report_path = output or Path(f"{name}-report.html")
    cells = study_obj.cells(quick, repeats)
    show = console.is_terminal
    with Progress(TextColumn("[bold]{task.fields[label]}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=not show) as bar:
        task = bar.add_task("cells", total=len(cells), label="study")

        def on_cell(index: int, cell: Any, state: str) -> None:
            bar.update(task, completed=index, label=f"{cell.key} ({state})")
            if not show:
                err_console.print(f"[{index + 1}/{len(cells)}] {cell.key}: {state}", markup=False, highlight=False)

        try:
            results = run_cells(name, cells, db, fresh, on_cell)
        except StudyCellFailed as exc:
            err_console.print(f"study {name} stopped: {exc}; rerun to resume", markup=False, highlight=False,
                              soft_wrap=True)
            raise typer.Exit(1)
        bar.update(task, completed=len(cells), label="analysis")
    findings = study_obj.analyse(results, quick)
    _print_findings(name, results, findings)
    from ddlscope.report.html import study_report, write_report

    with Store(db) as store:
        cells_data = [{"key": r.cell.key, "run": r.run, "labels": r.cell.labels} for r in results]
        html = study_report(store, f"ddlscope study {name}{' (quick)' if quick else ''}", cells_data,
                            findings.headlines, findings.decisions, findings.notes)
    write_report(html, report_path)
    console.print(f"report: {report_path.resolve()}")


def studies() -> None:
    """List the registered studies."""
    from ddlscope.studies import STUDIES

    table = Table("study", "description")
    for study_name, cls in STUDIES.items():
        table.add_row(study_name, cls.description)
    console.print(table)


def _print_findings(name: str, results: list[Any], findings: Any) -> None:
    reused = sum(r.reused for r in results)
    console.print(f"[bold]study {name}[/bold]: {len(results)} cells ({reused} reused from the store)")
    # A cell's key is what the store names its run (paper:KEY): wrapped, never cut to '…'
    cells = Table(Column("cell", overflow="fold"), "step ms", "speedup", "accuracy", "wall s", "staleness",
                  box=None, pad_edge=False)
    single = next((r for r in results if is_baseline(r.cell.labels.get("strategy", ""))), None)
    for r in results:
        s = r.summary
        speed = (single.summary.effective_step_s / s.effective_step_s
                 if single and s.effective_step_s and r.cell.labels.get("part") == "accuracy" else None)
        cells.add_row(r.cell.key, f"{(s.effective_step_s or 0) * 1e3:.1f}", f"{speed:.2f}x" if speed else "-",
                      f"{s.final_eval['metric']:.3f}" if s.final_eval and s.final_eval["metric_name"] == "accuracy" else "-",
                      f"{s.effective_wall_s or 0:.1f}", f"{s.staleness['mean']:.2f}" if s.staleness else "-")
    console.print(cells)
    headlines = Table("headline", "main study reports", "ddlscope measured here", "verdict", title="headlines")
    for h in findings.headlines:
        headlines.add_row(h["headline"], h["paper"], h["measured"], h["verdict"])
    console.print(headlines)
    for decision in findings.decisions:
        console.print(f"- {decision}")
    for note in findings.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
