"""`ddlscope sweep GRID.toml`: a user-defined study, every combination of a grid of fields.

    name = "ddp-vs-fsdp"
    repeats = 1                      # seeds per cell: the base seed, then +1, +2, ...

    [base]                           # the experiment every cell starts from, as for `ddlscope run`
    workload = { name = "mlp-digits", steps = 50 }

    [grid]                           # dotted field -> values; the cells are the cartesian product
    "strategy.name" = ["single", "ddp", "fsdp"]
    "cluster.world_size" = [2, 4]

Two rules keep such grids free of impossible cells: a workload or strategy
knob applies only to the workloads or strategies that have it (`bucket_mb`
to ddp, not fsdp; the cells that differ only in a knob their strategy lacks
are one cell), and a one-process strategy runs on one rank whatever the
world size. Any other bad combination is refused before anything runs, in
one line naming the cell.

Cells are keyed by the grid values that apply to them (`ddp/world_size=2`)
and their runs named `NAME:KEY`, so a rerun reuses the finished ones.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import statistics
import re
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ddlscope.runtime.config import (PLUGIN_SECTIONS, experiment_from_dict, experiment_to_dict, plugin_spec_class,
                                     read_toml, set_dotted)
from ddlscope.specs import ConfigError, describe_validation_error, remember_spec_class
from ddlscope.studies.base import (MAX_REPEATS, Cell, CellResult, CellRow, Findings, Study, cell_rows, is_one_process,
                                   measurement_notes, median_or_none)

GRID_SECTIONS = ("workload", "strategy", "cluster")
# Cells (grid combinations x seeds) one sweep may hold: each is a real run of seconds to minutes, so 1,000 is
# more than a day on one machine; and every cell is expanded and validated before the first starts (a grid of
# 10**6 was silent for minutes doing only that).
MAX_SWEEP_CELLS = 1_000
SWEEP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
MAX_SWEEP_NAME = 128


class SweepSpec(BaseModel):
    """A sweep file. Strict: a value of the wrong type is refused, never converted."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(description="names the runs NAME:KEY and the report NAME-report.html")
    repeats: int = Field(1, ge=1, le=MAX_REPEATS, description="seeds per cell: the base seed, then +1, +2, ...")
    target_accuracy: float | None = Field(None, gt=0, le=1, description="an accuracy each cell races to: the table "
                                          "and the report give each cell's training time to reach it")
    base: dict[str, Any] = Field(default_factory=dict, description="the experiment every cell starts from")
    grid: dict[str, list[Any]] = Field(description="dotted field -> the values it takes")

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not SWEEP_NAME.fullmatch(name):
            raise ValueError(f"{name!r}: use letters, digits, '.', '_' and '-' (it names the runs and the report file)")
        if len(name) > MAX_SWEEP_NAME:  # NAME-report.html must fit a file name (255 bytes)
            raise ValueError(f"{len(name):,} characters, more than {MAX_SWEEP_NAME} (it names the runs and the "
                             "report file)")
        return name

    @field_validator("base")
    @classmethod
    def _base(cls, base: dict[str, Any]) -> dict[str, Any]:
        if "name" in base:
            raise ValueError("name: the sweep names each cell's run NAME:KEY; leave it out")
        return base

    @field_validator("grid")
    @classmethod
    def _grid(cls, grid: dict[str, list[Any]]) -> dict[str, list[Any]]:
        if not grid:
            raise ValueError('empty; give at least one field and its values, e.g. "strategy.name" = ["ddp", "fsdp"]')
        for path, values in grid.items():
            section, _, rest = path.partition(".")
            if path == "seed":
                raise ValueError("'seed': seeds come from repeats (the base seed, then +1, +2, ...)")
            if section not in GRID_SECTIONS or not rest:
                raise ValueError(f"{path!r}: not a field of {', '.join(GRID_SECTIONS)} (e.g. 'cluster.world_size')")
            if not values:
                raise ValueError(f"{path!r} has no values")
            rendered = [_show(v) for v in values]
            if len(set(rendered)) < len(rendered):
                raise ValueError(f"{path!r} = {values!r} lists a value twice")
            overlapping = [p for p in grid if p != path and p.startswith(path + ".")]
            if overlapping:
                raise ValueError(f"{path!r} and {overlapping[0]!r} set the same field")
        return grid


remember_spec_class(SweepSpec)  # an unknown top-level key is answered with the allowed ones


def load_sweep(path: str | Path, repeats: int | None = None) -> tuple[SweepStudy, list[Cell]]:
    """The sweep in a TOML file and its cells, every one validated; ConfigError (one line) otherwise.
    `repeats`: seeds per cell instead of the file's (`sweep --repeats`)."""
    raw = read_toml(path)
    if repeats is not None and isinstance(raw, dict):
        raw = {**raw, "repeats": repeats}
    try:
        spec = SweepSpec.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(f"{path}: {describe_validation_error(err)}") from None
    sizes = [len(values) for values in spec.grid.values()]
    total = math.prod(sizes) * spec.repeats
    if total > MAX_SWEEP_CELLS:
        seeds = f" x {spec.repeats} seeds" if spec.repeats > 1 else ""
        raise ConfigError(f"{path}: grid: {' x '.join(map(str, sizes))} values{seeds} = {total:,} cells, more than "
                          f"{MAX_SWEEP_CELLS:,} (each cell is a real run); split the grid into several sweeps")
    study = SweepStudy(spec)
    try:
        cells = study.cells()
        check_distinct(cells)
        return study, cells
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None


def check_distinct(cells: list[Cell]) -> None:
    """Refuse cells that would run the same experiment (grid values alike but for their type, 1 and 1.0),
    or write the same checkpoint folder or model file: the second cell found the first's checkpoints and
    failed, after the first had run."""
    seen: dict[str, str] = {}
    for cell in cells:
        if cell.labels.get("seed", 0):
            continue  # a further seed of a cell (_reseeded): the same experiment but for its seed
        text = json.dumps(experiment_to_dict(cell.experiment), sort_keys=True)
        if text in seen:
            raise ConfigError(f"cells {seen[text]} and {cell.key} are the same experiment (grid values that differ "
                              "only in how they are written, such as 1 and 1.0); list each value once")
        seen[text] = cell.key
    for field in ("checkpoint_dir", "save_model_path"):
        owners: dict[str, str] = {}
        for cell in cells:
            value = getattr(cell.experiment, field)
            if value is None:
                continue
            where = str(Path(value).resolve())
            if where in owners:
                raise ConfigError(f"{field} = {value}: cells {owners[where]} and {cell.key} would both write it; "
                                  "leave it out of [base] (each run keeps its checkpoints in its own folder) or "
                                  "give each cell its own in [grid]")
            owners[where] = cell.key


class SweepStudy(Study):
    description = "a user's grid of experiments (ddlscope sweep GRID.toml)"
    has_headlines = False  # a sweep checks no published claims
    # without headlines, throughput is what a grid is usually compared by
    cell_columns = ("step ms", "samples/s", "speedup", "accuracy", "wall s", "staleness")

    def __init__(self, spec: SweepSpec):
        self.spec = spec
        if spec.target_accuracy is not None:  # the race to the target is the question: its column beside accuracy
            self.cell_columns = ("step ms", "samples/s", "speedup", "accuracy", "to target s", "wall s", "staleness")

    @property
    def name(self) -> str:
        return self.spec.name

    def cells(self, quick: bool = False, repeats: int | None = None) -> list[Cell]:
        """Every distinct cell of the grid, one-process cells first (the others' summaries find them
        as their speedup baseline), then the same cells again for each further seed."""
        first = [_first_seed_cell(key, applied, raw, self.spec.target_accuracy)
                 for key, applied, raw in expand_grid(self.spec)]
        first.sort(key=lambda c: not c.experiment.strategy.traits.single_process)  # stable: grid order otherwise
        return first + [_reseeded(c, r) for r in range(1, repeats or self.spec.repeats) for c in first]

    def analyse(self, results: list[CellResult], quick: bool = False) -> Findings:
        decisions = _decisions(results, self.spec.target_accuracy)
        notes = measurement_notes(results) + load_notes(results)
        if self.spec.repeats > 1:
            notes.append(f"Each cell ran with {self.spec.repeats} seeds; the lines above read the medians of a "
                         "cell's seeds, and the cell table lists every seed.")
        return Findings(headlines=[], decisions=decisions, notes=notes, text="\n".join(f"- {d}" for d in decisions))


# ---------------------------------------------------------------------------- grid -> cells
def expand_grid(spec: SweepSpec) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(key, grid values that apply, raw experiment) of every distinct combination, in grid order."""
    knobs = _sweep_knobs(spec)
    names = _axis_names(list(spec.grid))
    seen: dict[str, dict[str, Any]] = {}
    out = []
    for combo in itertools.product(*spec.grid.values()):
        raw, applied = _combination(spec.base, dict(zip(spec.grid, combo)), knobs)
        key = "/".join(_key_part(names[path], value) for path, value in applied.items()) or "base"
        if key in seen:
            if seen[key] != applied:  # two values that print alike, such as 1 and "1"
                raise ConfigError(f"grid values {seen[key]} and {applied} give the same cell key {key!r}")
            continue  # an axis that does not apply to this cell made it a duplicate
        seen[key] = applied
        out.append((key, applied, raw))
    return out


def _combination(base: dict[str, Any], chosen: dict[str, Any],
                 knobs: dict[str, set[str]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The raw experiment of one combination, and the grid values that apply to it."""
    raw = copy.deepcopy(base)
    for path, value in chosen.items():
        set_dotted(raw, path, value)
    applied = dict(chosen)
    for section in PLUGIN_SECTIONS:
        table = raw.get(section)
        spec_class = plugin_spec_class(section, table.get("name")) if isinstance(table, dict) else None
        if spec_class is None:
            continue  # no such section, or an unknown name: validation names it
        for knob in [k for k in table if k not in spec_class.model_fields and k in knobs[section]]:
            del table[knob]
            applied = {p: v for p, v in applied.items() if not _within(p, f"{section}.{knob}")}
    strategy = plugin_spec_class("strategy", (raw.get("strategy") or {}).get("name"))
    if strategy is not None and strategy.traits.single_process:
        raw.setdefault("cluster", {})["world_size"] = 1
        applied.pop("cluster.world_size", None)
    return raw, applied


def _sweep_knobs(spec: SweepSpec) -> dict[str, set[str]]:
    """Per plugin section, the knobs of every workload or strategy the sweep uses.

    A knob that one of them has is dropped from the cells of the others; a
    knob that none has is left in, for validation to refuse (a typo).
    """
    out = {}
    for section in PLUGIN_SECTIONS:
        names = spec.grid.get(f"{section}.name") or [(spec.base.get(section) or {}).get("name")]
        classes = [plugin_spec_class(section, n if isinstance(n, str) else None) for n in names]
        out[section] = {f for c in classes if c is not None for f in c.model_fields}
    return out


def _within(path: str, field: str) -> bool:
    return path == field or path.startswith(field + ".")


def _axis_names(paths: list[str]) -> dict[str, str]:
    """How a key names each axis: not at all for a workload's or strategy's name (`ddp` says it), else
    its last part (`world_size=2`), or its whole path where two axes share a last part."""
    last = [p.rsplit(".", 1)[-1] for p in paths]
    plugin_names = {f"{section}.name" for section in PLUGIN_SECTIONS}
    return {p: "" if p in plugin_names else leaf if last.count(leaf) == 1 else p for p, leaf in zip(paths, last)}


def _key_part(axis: str, value: Any) -> str:
    return f"{axis}={_show(value)}" if axis else _show(value)


def _show(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"), sort_keys=True)  # true, 0.1, [1,2], {"profile":"slow"}


def _first_seed_cell(key: str, applied: dict[str, Any], raw: dict[str, Any], target: float | None = None) -> Cell:
    try:
        exp = experiment_from_dict(raw)
    except ConfigError as err:
        raise ConfigError(f"cell {key}: {err}") from None
    labels = {"strategy": exp.strategy.name, "world_size": exp.cluster.world_size,
              "network": exp.cluster.network.profile,
              "workers": "straggler" if any(f > 1 for f in exp.cluster.slowdown) else "homogeneous",
              "group": key, "seed": 0, "grid": applied}
    if target is not None:
        labels["target_metric"] = target
    return Cell(key, labels, exp)


def _reseeded(cell: Cell, repeat: int) -> Cell:
    """Repeat `repeat` of a cell: the next seed; the first repeat keeps the plain key, so that raising
    repeats reuses the cells already run."""
    seed = cell.experiment.seed + repeat
    return Cell(f"{cell.key}/seed{seed}", {**cell.labels, "seed": seed},
                cell.experiment.model_copy(update={"seed": seed}))


# ---------------------------------------------------------------------------- analysis
def _decisions(results: list[CellResult], target: float | None = None) -> list[str]:
    """Which cell went fastest (and reached the target first) and which trained best, by the medians of
    each cell's seeds; a lead within the seeds' spread is called noise, not a finding."""
    groups: dict[str, list[CellRow]] = {}
    for result, row in zip(results, cell_rows(results)):
        groups.setdefault(str(result.cell.labels.get("group", result.cell.key)), []).append(row)
    baselines = {str(r.cell.labels.get("group", r.cell.key)) for r in results if is_one_process(r)}

    def median(group: str, column: str) -> float | None:
        return median_or_none([getattr(row, column) for row in groups[group]])

    out = []
    fastest = _best(groups, lambda g: median(g, "throughput"))
    if fastest:
        speedup = median(fastest, "speedup")
        versus = f", {speedup:.2f}x the one-process cell" if speedup and fastest not in baselines else ""
        line = (f"Highest throughput: {fastest} ({median(fastest, 'throughput'):.0f} samples/s, "
                f"{(median(fastest, 'step_s') or 0) * 1e3:.1f} ms per step{versus}).")
        out.append(line + _against_the_runner_up(groups, fastest, "throughput", "samples/s", higher=True))
    if target is not None:
        first = _best(groups, lambda g: -t if (t := median(g, "time_to_target_s")) is not None else None)
        out.append(f"First to {target:.0%} accuracy: {first} ({median(first, 'time_to_target_s'):.1f} s of training)."
                   + _against_the_runner_up(groups, first, "time_to_target_s", "s", higher=False) if first else
                   f"No cell reached {target:.0%} accuracy.")
    most_accurate = _tied_best(groups, lambda g: median(g, "accuracy"))
    if most_accurate:
        # Synchronous strategies compute the same SGD: their accuracies tie, and saying so is the finding.
        who = (f"all {len(groups)} cells" if len(most_accurate) == len(groups) > 1 else ", ".join(most_accurate))
        out.append(f"Highest accuracy: {median(most_accurate[0], 'accuracy'):.1%}, {who}.")
    return out


def _against_the_runner_up(groups: dict[str, list[CellRow]], best: str, column: str, unit: str,
                           higher: bool) -> str:
    """Whether `best` leads the next cell by more than their seeds scatter: '' without a runner-up."""
    def values(group: str) -> list[float]:
        return [v for row in groups[group] if (v := getattr(row, column)) is not None]

    def rank(group: str) -> float:
        return statistics.median(values(group)) * (1 if higher else -1)

    rivals = sorted((g for g in groups if g != best and values(g)), key=rank, reverse=True)
    if not rivals:
        return ""
    runner, mine, theirs = rivals[0], values(best), values(rivals[0])
    if len(mine) < 2 or len(theirs) < 2:
        return (f" Next: {runner}. One seed per cell, so the spread is unknown: set repeats (or --repeats 3) to "
                "tell a lead from run-to-run noise.")
    clear = min(mine) > max(theirs) if higher else max(mine) < min(theirs)
    spans = f"{best} {min(mine):.4g}-{max(mine):.4g}, {runner} {min(theirs):.4g}-{max(theirs):.4g} {unit}"
    if clear:
        return f" Ahead of {runner} on every seed ({spans})."
    return f" Within noise of {runner}: their seeds overlap ({spans}); no winner."


# A load average above this share of the cores during a cell means other work ran beside it.
BUSY_LOAD_PER_CORE = 0.5


def load_notes(results: list[CellResult]) -> list[str]:
    """A warning when the machine was busy as cells started (load average recorded with each run)."""
    busy = [(r.cell.key, env["load_average_1m"], env.get("cores") or 1) for r in results
            if (env := getattr(r.run, "environment", None) or {}).get("load_average_1m") is not None
            and env["load_average_1m"] > BUSY_LOAD_PER_CORE * (env.get("cores") or 1)]
    if not busy:
        return []
    key, load, cores = max(busy, key=lambda b: b[1])
    return [f"The machine was busy: {len(busy)} of {len(results)} cells started at a load average above "
            f"{BUSY_LOAD_PER_CORE:g} per core (up to {load:.1f} on {cores} cores, at {key}); their times include "
            "other work, so compare them with care or rerun on an idle machine."]


def _best(groups: dict[str, Any], value: Callable[[str], float | None]) -> str | None:
    """The group with the highest value (the first of a tie), None when no group has one."""
    return next(iter(_tied_best(groups, value)), None)


def _tied_best(groups: dict[str, Any], value: Callable[[str], float | None]) -> list[str]:
    """The groups that share the highest value, in order; none when no group has a value."""
    scored = {g: v for g in groups if (v := value(g)) is not None}
    top = max(scored.values(), default=None)
    return [g for g, v in scored.items() if v == top]
