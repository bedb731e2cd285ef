"""Scaling tables: one workload and strategy over world sizes."""

from __future__ import annotations

from dataclasses import dataclass

from ddlscope.analysis.summary import PHASES, Summary, summarize
from ddlscope.store import Run, Store


@dataclass
class ScalingRow:
    world_size: int
    run_id: int
    throughput_samples_per_s: float | None
    speedup_vs_single: float | None
    scaling_efficiency: float | None
    breakdown_mean_s: dict[str, float]
    breakdown_growth: dict[str, float | None]  # each phase relative to the smallest world size


def latest_per_world_size(store: Store, workload: str, strategy: str) -> list[Run]:
    """The newest finished run of this workload and strategy at each world size."""
    newest: dict[int, Run] = {}
    for run in store.find_runs(workload=workload, strategy=strategy):
        newest.setdefault(run.world_size, run)
    return [newest[w] for w in sorted(newest)]


def scaling_table(store: Store, runs: list[Run]) -> list[ScalingRow]:
    summaries: list[Summary] = [summarize(store, run) for run in sorted(runs, key=lambda r: r.world_size)]
    base = summaries[0].breakdown_mean_s if summaries else {}
    rows = []
    for run, s in zip(sorted(runs, key=lambda r: r.world_size), summaries):
        growth = {p: (s.breakdown_mean_s.get(p, 0.0) / base[p] if base.get(p) else None) for p in PHASES}
        rows.append(ScalingRow(run.world_size, run.id, s.throughput_samples_per_s, s.speedup_vs_single,
                               s.scaling_efficiency, s.breakdown_mean_s, growth))
    return rows
