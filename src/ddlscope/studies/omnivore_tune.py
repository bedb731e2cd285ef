"""`ddlscope omnivore-tune`: Omnivore's optimizer (PAPERS.md item 15) as short probe runs.

One short `omnivore` run per (groups, momentum) candidate (analysis/omnivore_tuner.py picks the
candidates and the winner), all from the same seed, model and data order, resumable through the
study runner (a finished probe with the same experiment is reused). The probes' step rows give the
tuner its two measurements: mean step time and the training loss per step.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ddlscope.analysis.omnivore_tuner import Choice, Probe, candidates, choose
from ddlscope.store import Store
from ddlscope.studies.base import Cell, CellResult, build_cell, run_cells

STUDY_NAME = "omnivore-tune"


@dataclass(frozen=True)
class TuneSettings:
    workers: int = 2
    steps: int = 30
    workload: str = "mlp-digits"
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9  # the total (explicit + implicit) the candidates keep
    groups: tuple[int, ...] = ()  # empty: every divisor of the workers
    keep_momentum: bool = True  # also probe each k > 1 at the total momentum, unlowered
    seed: int = 0


def probe_cells(settings: TuneSettings) -> list[Cell]:
    """One omnivore experiment per candidate (validated like any user config: a bad `groups` is refused)."""
    cells = []
    for groups, momentum in candidates(settings.workers, settings.momentum, list(settings.groups) or None,
                                       settings.keep_momentum):
        raw = {"seed": settings.seed,
               "workload": {"name": settings.workload, "steps": settings.steps, "batch_size": settings.batch_size,
                            "lr": settings.lr, "momentum": momentum, "eval_batches": 1},
               "strategy": {"name": "omnivore", "groups": groups},
               "cluster": {"world_size": settings.workers}}
        cells.append(build_cell(f"w{settings.workers}/g{groups}/m{momentum:g}", {"groups": groups,
                                                                                 "momentum": momentum}, raw))
    return cells


def measured_probe(store: Store, result: CellResult) -> Probe:
    """A probe's setting and measurements from its run: its effective step time (the summary's steady steps)
    and the workers' mean training loss at each step."""
    by_step: dict[int, list[float]] = {}
    for row in store.steps(result.run.id):
        by_step.setdefault(int(row["step"]), []).append(float(row["loss"]))
    exp = result.cell.experiment
    # The project's step time for comparisons: CPU-derived when the ranks share cores (analysis/summary.py), so
    # another program's load on this machine moves the probes less.
    step_s = result.summary.effective_step_s
    if step_s is None:
        raise ValueError(f"probe {result.cell.key} recorded no steady steps")
    return Probe(groups=int(result.cell.labels["groups"]), momentum=float(result.cell.labels["momentum"]),
                 step_s=step_s, samples_per_step=exp.workload.batch_size,
                 losses=tuple(statistics.fmean(by_step[s]) for s in sorted(by_step)))


def tune(settings: TuneSettings, db: Path, fresh: bool = False, target_loss: float | None = None,
         on_cell: Callable[[int, Cell, str], None] | None = None) -> tuple[list[Probe], Choice]:
    """Run (or reuse) the probes, measure them, and choose."""
    results = run_cells(STUDY_NAME, probe_cells(settings), db, fresh, on_cell)
    with Store(db) as store:
        probes = [measured_probe(store, r) for r in results]
    return probes, choose(probes, target_loss)
