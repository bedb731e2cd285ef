"""What a study is, and how its cells are run: resumable, one after another."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

from ddlscope.analysis.summary import Summary, summarize
from ddlscope.runtime.config import experiment_from_dict, experiment_to_dict
from ddlscope.specs import Experiment
from ddlscope.store import Run, Store


@dataclass
class Cell:
    key: str  # e.g. "ddp/slow/straggler/w4"
    labels: dict[str, Any]  # strategy, network, workers, world_size, part, ...
    experiment: Experiment


@dataclass
class CellResult:
    cell: Cell
    run: Run
    summary: Summary
    reused: bool


@dataclass
class Findings:
    headlines: list[dict[str, str]]  # headline, paper, measured, verdict
    decisions: list[str]
    notes: list[str]
    text: str  # the terminal summary
    extra: dict[str, Any] = field(default_factory=dict)


class Study(ABC):
    description: ClassVar[str]

    @abstractmethod
    def cells(self, quick: bool, repeats: int = 1) -> list[Cell]:
        """The experiments, in the order they run; `repeats` seeds for the cells whose outcome varies run to run."""

    @abstractmethod
    def analyse(self, results: list[CellResult], quick: bool) -> Findings:
        """Headlines, decisions and a text summary from the measured cells."""


def build_cell(key: str, labels: dict[str, Any], raw: dict[str, Any]) -> Cell:
    """A cell from a raw experiment dict, validated like any user config."""
    return Cell(key, labels, experiment_from_dict(raw))


def run_name(study: str, cell: Cell) -> str:
    return f"{study}:{cell.key}"


def find_reusable(store: Store, name: str, exp: Experiment) -> Run | None:
    """The newest finished run of this cell with exactly this experiment."""
    wanted = experiment_to_dict(exp)
    for run in store.runs_named(name):
        if run.status == "finished" and run.config == wanted:
            return run
    return None


def run_cells(study_name: str, cells: list[Cell], db: Path, fresh: bool,
              on_cell: Callable[[int, Cell, str], None] | None = None) -> list[CellResult]:
    """Run every cell not already in the store (all of them with fresh=True).

    A cell that fails stops the study: its run stays in the store as failed,
    and the next invocation reruns it while reusing the finished ones.
    """
    from ddlscope.runtime.launcher import launch

    results = []
    for index, cell in enumerate(cells):
        name = run_name(study_name, cell)
        cell.experiment = cell.experiment.model_copy(update={"name": name})
        with Store(db) as store:
            existing = None if fresh else find_reusable(store, name, cell.experiment)
        if on_cell:
            on_cell(index, cell, "reused" if existing else "running")
        if existing is None:
            outcome = launch(cell.experiment, db)
            if outcome.status != "finished":
                raise StudyCellFailed(f"cell {cell.key} {outcome.status}: {outcome.error} "
                                      f"(run {outcome.run_id}; worker logs in {outcome.run_dir / 'logs'})")
            run_id = outcome.run_id
        else:
            run_id = existing.id
        with Store(db) as store:
            run = store.get_run(run_id)
            results.append(CellResult(cell, run, summarize(store, run), reused=existing is not None))
    return results


class StudyCellFailed(RuntimeError):
    pass
