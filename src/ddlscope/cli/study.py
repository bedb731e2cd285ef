"""Studies: `study NAME` runs a named experiment set, `sweep GRID.toml` a user-defined grid, `studies`
lists the named ones. Both run on the studies layer's run_study (run -> analyse -> report) and show
it the same way here: the progress bar over the cells, the cell table, headlines, decisions and
notes, and the one line of a cell that failed (exit 1; a rerun resumes).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.markup import escape
from rich.table import Column, Table

from ddlscope.cli.common import (DEFAULT_DB, DbOption, UserError, check_local_ranks, check_output_folder,
                                 check_run_outputs, console,
                                 err_console, progress_phase)
from ddlscope.specs import ConfigError

# Seeds of each cell whose outcome varies from run to run: three for the full study's medians, two for
# the quick one (its time budget); `--repeats` sets either.
QUICK_REPEATS, FULL_REPEATS = 2, 3

if TYPE_CHECKING:  # the studies layer imports torch (through the runtime): load it when a command runs
    from ddlscope.studies.base import Cell, CellResult, Study
    from ddlscope.studies.runner import StudyOutcome


def study(
    name: Annotated[str, typer.Argument(help="Study name (see `ddlscope studies`); `paper` is the main study.")],
    quick: Annotated[bool, typer.Option("--quick", help="Only the cells each headline needs (about 6 minutes on 2 cores).")] = False,
    fresh: Annotated[bool, typer.Option("--fresh", help="Rerun every cell instead of reusing finished ones.")] = False,
    repeats: Annotated[Optional[int], typer.Option("--repeats", help="Seeds per cell whose outcome varies from run to "
                                                   "run (the asynchronous parameter servers'); headlines read their "
                                                   f"medians. Default: {QUICK_REPEATS} with --quick, else {FULL_REPEATS}.")] = None,
    workload: Annotated[Optional[str], typer.Option("--workload", "-w", help="The workload its accuracy cells train "
                                                    "(paper: resnet-cifar, the default, or cnn-digits).")] = None,
    models: Annotated[Optional[str], typer.Option("--models", help="paper: also run its cells on these torchvision "
                                                  "models at 32x32, comma-separated (the paper's: resnet50, vgg16, "
                                                  "densenet121, efficientnet_v2_s, convnext_large), for step time "
                                                  "and memory; states the expected time first.")] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="HTML report path (default: NAME-report.html).")] = None,
    db: DbOption = DEFAULT_DB,
) -> None:
    """Run a study's cells (reusing those already in the store), then print and write its report."""
    from ddlscope.studies import STUDIES
    from ddlscope.studies.base import MAX_REPEATS

    if models is not None and name != "paper":
        raise UserError(f"--models: only `study paper` runs its cells on other models; study {name} has its own")
    try:
        study_cls = STUDIES.get(name)
        study_obj = study_cls(workload, models=tuple(models.split(","))) if models is not None else study_cls(workload)
    except KeyError as exc:
        raise UserError(str(exc)) from None
    except ValueError as exc:
        raise UserError(f"study {name}: {exc}") from None
    check_db_folder(db)
    if repeats is None:
        repeats = QUICK_REPEATS if quick else FULL_REPEATS
    if not 1 <= repeats <= MAX_REPEATS:
        raise UserError(f"--repeats {repeats}: must be between 1 and {MAX_REPEATS}")
    cells = study_obj.cells(quick, repeats)  # every model checked here, before anything is written
    named = f" --models {','.join(study_obj.models)}" if models else ""  # the report's title names the models
    title = f"ddlscope study {name}{named}{' (quick)' if quick else ''}"
    if models:
        _say_expected_time(_to_run(cells, db, fresh), quick)
    run_study_command("study", study_obj, name, cells, db, fresh, output or Path(f"{name}-report.html"), title, quick)


def _to_run(cells: list[Cell], db: Path, fresh: bool) -> list[Cell]:
    """The cells the run will start: those without a finished run of the same experiment in the store
    (read only where the store exists already: this check creates nothing)."""
    from ddlscope.store import Store
    from ddlscope.studies.base import find_reusable, run_name

    if fresh or not db.exists():
        return cells
    with Store(db) as store:
        return [c for c in cells if find_reusable(store, run_name("paper", c), c.experiment.model_copy(
            update={"name": run_name("paper", c)})) is None]


def _say_expected_time(cells: list[Cell], quick: bool) -> None:
    """The models' cells can take hours (slow emulated links, large gradients): say so before they start."""
    from ddlscope.studies.paper import expected_models_s

    model_cells = sum("model" in c.labels for c in cells)
    if not model_cells:
        return
    own = sum("model" not in c.labels for c in cells)
    after = (f", after the small model's {own} cells (about 5 min for all of --quick's)" if quick and own else
             f", after the small model's {own} cells" if own else "")
    err_console.print(f"study paper: {model_cells} model cells to run, expected to take about "
                      f"{_duration(expected_models_s(cells))} on 2 cores (from step times measured here){after}",
                      markup=False, highlight=False, soft_wrap=True)


def _duration(seconds: float) -> str:
    minutes = round(seconds / 60)
    return f"{minutes // 60} h {minutes % 60} min" if minutes >= 60 else f"{max(minutes, 1)} min"


def sweep(
    grid: Annotated[Path, typer.Argument(metavar="GRID.toml", help="Sweep file: name, repeats, \\[base] experiment, "  # \\[: rich markup reads [base] as a tag
                                         "\\[grid] of dotted fields and their values (docs/user-guide.md).")],
    fresh: Annotated[bool, typer.Option("--fresh", help="Rerun every cell instead of reusing finished ones.")] = False,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="HTML report path (default: NAME-report.html).")] = None,
    repeats: Annotated[Optional[int], typer.Option(
        "--repeats", help="Seeds per cell instead of the file's `repeats` (medians and spreads; a lead within "
                          "the spread is called noise).")] = None,
    db: DbOption = DEFAULT_DB,
) -> None:
    """Run a grid of experiments (reusing cells already in the store), then print and write its report."""
    from ddlscope.studies.sweep import load_sweep

    study, cells = load_sweep(grid, repeats)  # every cell validated before the first one starts
    for cell in cells:  # and each one runnable here: no cell fails after the others have run
        check_run_outputs(cell.experiment)
        check_local_ranks(cell.experiment)
    check_db_folder(db)
    report_path = output or Path(f"{study.name}-report.html")
    check_output_folder(report_path, "--output")  # the report is written after the last cell
    run_study_command("sweep", study, study.name, cells, db, fresh, report_path, f"ddlscope sweep {study.name}")


def studies() -> None:
    """List the registered studies."""
    from ddlscope.studies import STUDIES

    table = Table("study", "description")
    for study_name, cls in STUDIES.items():
        table.add_row(study_name, cls.description)
    console.print(table)


def check_db_folder(db: Path) -> None:
    """Refuse a store path whose folder does not exist, before any cell starts."""
    if db.parent and not db.resolve().parent.exists():
        raise ConfigError(f"--db {db}: folder {db.resolve().parent} does not exist")


def run_study_command(kind: str, study: Study, name: str, cells: list[Cell], db: Path, fresh: bool,
                      report_path: Path, title: str, quick: bool = False) -> StudyOutcome:
    """Run a study with a progress bar, print its summary and report path; exit 1 when a cell fails.

    `kind` ("study", "sweep") is the word the messages use.
    """
    from ddlscope.studies.base import StudyCellFailed
    from ddlscope.studies.runner import run_study

    show = console.is_terminal
    with Progress(TextColumn("[bold]{task.fields[label]}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=not show) as bar:
        task = bar.add_task("cells", total=len(cells), label=kind)

        current = {"key": ""}

        def on_cell(index: int, cell: Cell, state: str) -> None:
            current["key"] = cell.key
            bar.update(task, completed=index, label=escape(f"{cell.key} ({state})"))
            if not show:  # a log, one line per cell, where no bar can be drawn
                err_console.print(f"[{index + 1}/{len(cells)}] {cell.key}: {state}", markup=False, highlight=False)

        def on_row(row: dict[str, Any]) -> None:
            """A running cell's phase, so that its ranks' start, training and ingest never look stalled."""
            phase = progress_phase(row)
            if phase == "training" and row["kind"] == "step":
                phase = f"training, step {row['step'] + 1}"
            if phase:
                bar.update(task, label=escape(f"{current['key']} ({phase})"))

        def on_analysis() -> None:
            bar.update(task, completed=len(cells), label="analysis and report")

        try:
            outcome = run_study(study, name, cells, db, fresh, report_path, title, quick, on_cell, on_analysis,
                                on_row if show else None)
        except StudyCellFailed as exc:
            err_console.print(f"{kind} {name} stopped: {exc}; rerun to resume", markup=False, highlight=False,
                              soft_wrap=True)
            raise typer.Exit(1)
    print_outcome(console, kind, outcome)
    console.print(f"report: {outcome.report_path.resolve()}", markup=False, highlight=False)
    return outcome


def print_outcome(out: Console, kind: str, outcome: StudyOutcome) -> None:
    """The cell table, then headlines (for studies that have them), decisions and notes."""
    results, findings = outcome.results, outcome.findings
    reused = sum(r.reused for r in results)
    out.print(f"[bold]{kind} {escape(outcome.name)}[/bold]: {len(results)} cells ({reused} reused from the store)")
    out.print(cell_table(results, outcome.study.cell_columns))
    if outcome.study.has_headlines:
        headlines = Table("headline", "main study reports", "ddlscope measured here", "predicted on the paper's clusters",
                          "verdict", title="headlines")
        for h in findings.headlines:
            headlines.add_row(*(escape(str(h.get(k, ""))) for k in ("headline", "paper", "measured", "predicted",
                                                                   "verdict")))
        out.print(headlines)
    for title, lines in findings.extra.get("tables", {}).items():  # a study's own tables (e.g. beyond's sections)
        out.print(f"[bold]{escape(title)}[/bold]")
        out.print("\n".join(lines), markup=False, highlight=False, soft_wrap=True)
    for decision in findings.decisions:
        out.print(f"- {decision}", markup=False, highlight=False)
    for note in findings.notes:
        out.print(f"[yellow]note:[/yellow] {escape(str(note))}")


def cell_table(results: list[CellResult], titles: tuple[str, ...]) -> Table:
    """One row per cell; a column no cell has a value for (speedup without a one-process cell,
    staleness without a parameter server) is left out."""
    from ddlscope.studies.base import cell_rows

    rows = cell_rows(results)
    columns = {
        "step ms": [_num(r.step_s, 1e3, "{:.1f}") for r in rows],
        "samples/s": [_num(r.throughput, 1, "{:.0f}") for r in rows],
        "speedup": [_num(r.speedup, 1, "{:.2f}x") for r in rows],
        "accuracy": [_num(r.accuracy, 1, "{:.3f}") for r in rows],
        # a cell that never reached its target shows "-", as one without a target
        "to target s": [_num(r.time_to_target_s, 1, "{:.1f}") for r in rows],
        "wall s": [_num(r.wall_s, 1, "{:.1f}") for r in rows],
        "staleness": [_num(r.staleness, 1, "{:.2f}") for r in rows],
    }
    shown = {title: columns[title] for title in titles if any(v != "-" for v in columns[title])}
    # A cell's key is what the store names its run (NAME:KEY): wrapped, never cut to '…'
    table = Table(Column("cell", overflow="fold"), *shown, box=None, pad_edge=False)
    for i, row in enumerate(rows):
        table.add_row(escape(row.key), *(values[i] for values in shown.values()))
    return table


def _num(value: float | None, scale: float, fmt: str) -> str:
    return "-" if value is None else fmt.format(value * scale)


def omnivore_tune(
    workers: Annotated[int, typer.Option("--workers", "-n", help="Workers in each probe run (groups divide it).")] = 2,
    steps: Annotated[int, typer.Option("--steps", help="Steps of each probe run.")] = 30,
    workload: Annotated[str, typer.Option("--workload", "-w", help="The probes' workload (a small one: mlp-digits, "
                                          "cnn-digits).")] = "mlp-digits",
    batch_size: Annotated[int, typer.Option("--batch-size", help="Global batch of each probe.")] = 32,
    lr: Annotated[float, typer.Option("--lr", help="Learning rate of every probe.")] = 0.05,
    momentum: Annotated[float, typer.Option("--momentum", help="Total momentum to keep: each k groups get explicit "
                                            "momentum max(0, this - (1 - 1/k)).")] = 0.9,
    groups: Annotated[Optional[str], typer.Option("--groups", help="Comma-separated group counts to probe "
                                                  "(default: every divisor of --workers).")] = None,
    keep_momentum: Annotated[bool, typer.Option("--keep-momentum/--lowered-only", help="Also probe each k > 1 at "
                                                "the total momentum unlowered.")] = True,
    target_loss: Annotated[Optional[float], typer.Option("--target-loss", help="Training loss to reach (default: "
                                                         "halfway from the start to the lowest any probe reached).")] = None,
    fresh: Annotated[bool, typer.Option("--fresh", help="Rerun every probe instead of reusing finished ones.")] = False,
    db: DbOption = DEFAULT_DB,
) -> None:
    """Omnivore's optimizer: probe (groups, momentum) pairs in short omnivore runs, print what each measured
    (time per sample, loss decrease per sample) and pick the least predicted time to a target loss."""
    from ddlscope.analysis.omnivore_tuner import check_settings, table_rows
    from ddlscope.studies.base import StudyCellFailed
    from ddlscope.studies.omnivore_tune import STUDY_NAME, TuneSettings, probe_cells, tune

    try:
        chosen_groups = tuple(int(g) for g in groups.split(",")) if groups else ()
    except ValueError:
        raise UserError(f"--groups {groups!r}: give comma-separated integers, e.g. 1,2") from None
    try:
        check_settings(workers, momentum, list(chosen_groups), target_loss)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    settings = TuneSettings(workers, steps, workload, batch_size, lr, momentum, chosen_groups, keep_momentum)
    check_db_folder(db)
    for cell in probe_cells(settings):  # every probe validated (groups, workers, momentum) before the first runs
        check_local_ranks(cell.experiment)

    def on_cell(index: int, cell: Cell, state: str) -> None:
        err_console.print(f"probe {index + 1}: {cell.key}: {state}", markup=False, highlight=False)

    try:
        probes, choice = tune(settings, db, fresh, target_loss, on_cell)
    except StudyCellFailed as exc:
        err_console.print(f"{STUDY_NAME} stopped: {exc}; rerun to resume", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    rows = table_rows(choice, probes)
    table = Table(*rows[0].keys(), title=f"omnivore probes: {workers} workers, {steps} steps, start loss "
                                         f"{choice.start_loss:.3f}, target {choice.target_loss:.3f}")
    for row in rows:
        table.add_row(*row.values())
    console.print(table)
    console.print(f"chose {choice.reason}", markup=False, highlight=False, soft_wrap=True)
