"""A study from start to end: run its cells, analyse them, write the HTML report.

Every study goes through here, the named ones (`ddlscope study`) and the
user's grids (`ddlscope sweep`), so they share the resumable runner, the
cell table and the report. Each cell is summarised once, by run_cells;
the analysis, the terminal table and the report all read that summary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ddlscope.studies.base import Cell, CellResult, Findings, Study, cell_rows, run_cells
from ddlscope.store import Store


@dataclass
class StudyOutcome:
    study: Study
    name: str
    results: list[CellResult]
    findings: Findings
    report_path: Path


def run_study(study: Study, name: str, cells: list[Cell], db: Path, fresh: bool, report_path: Path, title: str,
              quick: bool = False, on_cell: Callable[[int, Cell, str], None] | None = None,
              on_analysis: Callable[[], None] | None = None,
              on_row: Callable[[dict[str, Any]], None] | None = None) -> StudyOutcome:
    """Run the cells not already in the store, analyse them all and write the report to `report_path`.

    `on_cell(index, cell, state)` is called as each cell starts ("running" or
    "reused"), `on_row(row)` with a running cell's steps and phases, `on_analysis()` once they are all
    done. A failed cell raises
    StudyCellFailed before anything is analysed; rerunning resumes.
    """
    results = run_cells(name, cells, db, fresh, on_cell, on_row)
    if on_analysis:
        on_analysis()
    findings = study.analyse(results, quick)
    write_study_report(study, results, findings, db, report_path, title)
    return StudyOutcome(study, name, results, findings, report_path)


def write_study_report(study: Study, results: list[CellResult], findings: Findings, db: Path, path: Path,
                       title: str) -> None:
    from ddlscope.report.html import study_report, write_report  # matplotlib: only when a report is written

    # The cell table's own rows (studies/base.py cell_rows), the numbers the terminal prints: the page shows
    # the same figures, not a second computation of them.
    cells = [{"key": r.cell.key, "run": r.run, "labels": r.cell.labels, "summary": r.summary, "row": row}
             for r, row in zip(results, cell_rows(results))]
    with Store(db) as store:
        html = study_report(store, title, cells, findings.headlines if study.has_headlines else None,
                            findings.decisions, findings.notes)
    write_report(html, path)
