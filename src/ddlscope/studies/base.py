"""What a study is, and how its cells are run: resumable, one after another."""

from __future__ import annotations

import statistics
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

from ddlscope.analysis.summary import Summary, emulation_scale_notes, summarize
from ddlscope.runtime.config import experiment_from_dict, experiment_to_dict
from ddlscope.specs import Experiment, is_baseline
from ddlscope.store import Run, Store


MAX_REPEATS = 10  # seeds per cell, at most


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
    # False for a study that checks no published claims (a user's sweep): its report and terminal
    # summary leave the headline table out instead of showing an empty one.
    has_headlines: ClassVar[bool] = True
    # The cell table's figures (cli/study.py), in order; a column no cell has a value for is left out.
    cell_columns: ClassVar[tuple[str, ...]] = ("step ms", "speedup", "accuracy", "to target s", "wall s", "staleness")
    # The workloads its accuracy cells can train (`study NAME --workload W`), the default first; empty:
    # the study has one fixed set of workloads.
    workload_choices: ClassVar[tuple[str, ...]] = ()

    def __init__(self, workload: str | None = None):
        if workload is not None and workload not in self.workload_choices:
            allowed = ", ".join(self.workload_choices) if self.workload_choices else "none (its workloads are fixed)"
            raise ValueError(f"--workload {workload}: this study's choices are {allowed}")
        self.workload = workload or (self.workload_choices[0] if self.workload_choices else None)

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
              on_cell: Callable[[int, Cell, str], None] | None = None,
              on_row: Callable[[dict[str, Any]], None] | None = None) -> list[CellResult]:
    """Run every cell not already in the store (all of them with fresh=True).

    A cell that fails stops the study: its run stays in the store as failed,
    and the next invocation reruns it while reusing the finished ones; it first recovers the runs whose
    launcher died (a killed study's), as every command that opens the store does. `on_row`: what a running
    cell's launcher reports (its steps and phases, runtime/launcher.py), for a progress display.
    """
    from ddlscope.runtime.launcher import launch
    from ddlscope.runtime.recovery import recover_orphaned_runs

    if db.exists():  # a killed earlier invocation's run would otherwise stay `running` until the next `runs`
        with Store(db) as store:
            recover_orphaned_runs(store, db)
    results = []
    for index, cell in enumerate(cells):
        name = run_name(study_name, cell)
        cell.experiment = cell.experiment.model_copy(update={"name": name})
        with Store(db) as store:
            existing = None if fresh else find_reusable(store, name, cell.experiment)
        if on_cell:
            on_cell(index, cell, "reused" if existing else "running")
        if existing is None:
            outcome = launch(cell.experiment, db, on_progress=on_row)
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


# ---------------------------------------------------------------------------- the cell table
@dataclass
class CellRow:
    """One line of a study's cell table: the numbers comparisons should use."""

    key: str
    step_s: float | None  # effective: CPU-derived when ranks share cores
    throughput: float | None  # samples/s at that step time
    speedup: float | None  # vs the study's one-process cell, None without one
    accuracy: float | None
    wall_s: float | None
    staleness: float | None  # parameter servers: mean versions behind
    time_to_target_s: float | None = None  # training time to the cell's target accuracy (effective clock)


def cell_rows(results: list[CellResult]) -> list[CellRow]:
    """The cell table every study prints; memory cells get no speedup (they time nothing comparable),
    timing cells no accuracy (they stop after a few steps)."""
    baselines = [r for r in results if is_one_process(r)]
    rows = []
    for r in results:
        s = r.summary
        base = _baseline_for(r, baselines)
        mine, theirs = effective_throughput(s), effective_throughput(base.summary) if base else None
        part = r.cell.labels.get("part", "accuracy")
        speedup = mine / theirs if mine and theirs and part in ("accuracy", "timing") else None
        # A timing cell's one evaluation (a single batch, after a few steps) is no accuracy to compare.
        accuracy = (s.final_eval["metric"] if s.final_eval and s.final_eval["metric_name"] == "accuracy"
                    and part != "timing" else None)
        target = r.cell.labels.get("target_metric")
        to_target = s.time_to_metric_s(float(target)) if target is not None and accuracy is not None else None
        rows.append(CellRow(r.cell.key, s.effective_step_s, mine, speedup, accuracy, s.effective_wall_s,
                            s.staleness["mean"] if s.staleness else None, to_target))
    return rows


def effective_throughput(summary: Summary) -> float | None:
    """Samples per second at the effective step time (the stored throughput uses the wall-clock step)."""
    s = summary
    if not (s.throughput_samples_per_s and s.mean_step_s and s.effective_step_s):
        return None
    return s.throughput_samples_per_s * s.mean_step_s / s.effective_step_s


def is_one_process(result: CellResult) -> bool:
    """Whether the cell's strategy trains on one process: a speedup's denominator."""
    return is_baseline((result.run.config.get("strategy") or {}).get("name", ""))


def _baseline_for(result: CellResult, baselines: list[CellResult]) -> CellResult | None:
    """The one-process cell training the same workload, else the first one-process cell.

    Throughputs compare across batch sizes; the fallback keeps cells that only
    change a hyperparameter (the paper's momentum-compensated cell) against
    the study's one baseline.
    """
    workload = result.run.config.get("workload")
    same = [b for b in baselines if b.run.config.get("workload") == workload]
    return (same or baselines or [None])[0]


def measurement_notes(results: list[CellResult]) -> list[str]:
    """The run notes a study should repeat: shared cores and emulated networks, once each, and whether one
    emulated network was scaled differently across the cells (then their communication is not comparable)."""
    return (emulation_scale_notes([r.run for r in results])
            + sorted({n for r in results for n in r.summary.notes if "shared" in n or "emulated" in n}))


def median_or_none(values: list[float | None]) -> float | None:
    """The median of the values present; None when there are none."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None
