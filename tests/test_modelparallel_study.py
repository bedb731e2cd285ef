"""`study modelparallel`: its quick cells, and its analysis on summaries whose numbers are known.

The study's runs themselves are what tests/test_pipeline.py and tests/test_partition.py check (the
schedules, the bubble, the memory of both partitions); here the cells and the verdicts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ddlscope.predict.partition import bubble_fraction, plan_of_cuts
from ddlscope.studies.base import CellResult
from ddlscope.studies.modelparallel import (
    CAP_BYTES, MEMORY_MICRO_BATCHES, ModelParallelStudy, memory_plan, recompute_formulas)


@pytest.fixture(scope="module")
def cells():
    return ModelParallelStudy().cells(quick=True)


def test_quick_cells(cells):
    keys = [c.key for c in cells]
    assert keys == ["pp/gpipe/m4", "pp/1f1b/m4", "pp/1f1b/m8", "pp/interleaved/m4/v2", "pp/zero-bubble/m4/v2",
                    "pp/1f1b/m4/recompute", "tp/t2", "single", "recompute/selective", "recompute/full",
                    "memory/balanced", "memory/equal"]
    recomputing = {c.key: c.experiment for c in cells if c.labels["part"] == "recompute"}
    assert {k: (e.workload.recompute, e.strategy.name, e.cluster.world_size) for k, e in recomputing.items()} == \
        {"recompute/selective": ("selective", "single", 1), "recompute/full": ("full", "single", 1)}
    assert all(c.experiment.cluster.world_size == 2 and c.experiment.strategy.name == "pipeline"
               for c in cells if c.key.startswith(("pp/", "memory/")))
    assert [c.experiment.strategy.name for c in cells if c.labels["part"] in ("tp", "reference")] == ["tp", "single"]
    plan = memory_plan()
    assert plan.balanced_micro_batch > plan.equal_micro_batch > 0
    assert plan.recompute_micro_batch >= plan.balanced_micro_batch
    memory = {c.key: c for c in cells[-2:]}
    for cell in memory.values():
        assert cell.experiment.workload.batch_size == plan.balanced_micro_batch * MEMORY_MICRO_BATCHES
    assert memory["memory/balanced"].experiment.strategy.partition == plan.balanced_cuts
    assert memory["memory/equal"].experiment.strategy.partition == plan.equal_cuts != plan.balanced_cuts


def _summary(compute_s: float, idle_s: float, peak0: int, step_s: float, memory: dict | None = None):
    ranks = {rank: {"forward_s": compute_s / 3, "backward_s": 2 * compute_s / 3, "comm_wait_s": idle_s,
                    "compute_cpu_s": compute_s, "data_s": 0.0, "optimizer_s": 0.0} for rank in range(2)}
    mem = memory or {rank: {"activations_peak": peak0 // (rank + 1)} for rank in range(2)}
    return SimpleNamespace(breakdown_mean_s_by_rank=ranks, memory_bytes_by_rank=mem, mean_step_s=step_s, notes=[])


KEPT_PLAIN = 100 * 2**20  # the one-process cell's activations in these made-up summaries


def _results(cells, bubble_scale: float = 1.0, kept_scale: float = 1.0) -> list[CellResult]:
    plan = memory_plan()
    kept, cost = recompute_formulas(KEPT_PLAIN)
    kept, cost = {"none": KEPT_PLAIN, **kept}, {"none": 0.0, **cost}
    out = []
    for cell in cells:
        labels = cell.labels
        if labels["part"] == "schedule":
            fraction = bubble_fraction(2, labels["m"], labels["v"], labels["schedule"])
            peak = 100 * (labels["m"] if labels["schedule"] == "gpipe" else 2)
            compute = 1.3 if labels["recompute"] else 1.0
            summary = _summary(compute, compute * fraction * bubble_scale, peak, compute * (1 + fraction))
        elif labels["part"] in ("tp", "reference", "recompute"):
            mode = labels.get("recompute", "none")
            activations = kept[mode] * (kept_scale if mode == "full" else 1.0)
            summary = _summary(1.0 + cost[mode], 0.0, 0, 1.0, {rank: {"activations": activations} for rank in range(2)})
        else:
            cuts = plan.balanced_cuts if labels["partition"] == "balanced" else plan.equal_cuts
            stages = plan_of_cuts(plan.layers, cuts, MEMORY_MICRO_BATCHES, "1f1b", None, plan.state_factor).stages
            summary = _summary(1.0, 0.25, 0, 1.0, {rank: {"parameters": int(s.memory_bytes)}
                                                   for rank, s in enumerate(stages)})
        out.append(CellResult(cell, SimpleNamespace(id=0), summary, reused=False))
    return out


def test_verdicts_follow_the_measurements(cells):
    findings = ModelParallelStudy().analyse(_results(cells), quick=True)
    verdicts = {h["headline"]: h["verdict"] for h in findings.headlines}
    assert verdicts["Pipeline bubble"] == "within 25% (worst 0%)"
    assert verdicts["In-flight activations, stage 0"] == "matches"
    assert verdicts[f"Largest micro-batch under {CAP_BYTES // 2**20} MiB per stage"] == "balanced fits, equal does not"
    recompute = next(h for h in findings.headlines if h["headline"] == "Recompute, stage 0")
    assert recompute["measured"].startswith("compute +30%")
    workload_recompute = next(h for h in findings.headlines if h["headline"].startswith("Activation recompute"))
    assert workload_recompute["verdict"] == "kept activations within 0.0%"
    assert "full" in workload_recompute["measured"] and "compute +" in workload_recompute["predicted"]
    off = ModelParallelStudy().analyse(_results(cells, kept_scale=1.1), quick=True)
    assert next(h["verdict"] for h in off.headlines if h["headline"].startswith("Activation recompute")) == \
        "kept activations within 10.0%"
    # twice the idle time: outside the band, by 100%
    worse = ModelParallelStudy().analyse(_results(cells, bubble_scale=2.0), quick=True)
    assert next(h["verdict"] for h in worse.headlines if h["headline"] == "Pipeline bubble") == \
        "outside 25% (worst 100%)"
