"""`ddlscope study modelparallel`: pipeline schedules x micro-batches, partitions under a memory cap,
recompute, each measured here and checked against REFERENCE.md's formulas and the predictor.

Per cell the analysis compares:
- bubble: the busiest stage's idle / compute (the stage that sets the pace) against (p - 1) / m,
  (p - 1) / (m v) interleaved, and against torch's own action order played out with the stages'
  profiled forward and backward times (predict/schedule_sim.py);
- step: the measured mean step against that timeline (plus the optimizer, not modelled: small);
- memory per stage: parameters + gradients + optimizer state + peak in-flight activations,
  measured, against predict/partition.py's stage model;
- partitions: the largest micro-batch under one memory cap with the exact search's partition and
  with equal blocks per stage, and both run at the balanced one's largest micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from ddlscope.predict.partition import Layer, bubble_fraction, partition, plan_of_cuts
from ddlscope.predict.schedule_sim import Action, simulate, single_stage_orders
from ddlscope.runtime.config import load_experiment
from ddlscope.specs import Experiment
from ddlscope.specs.strategies.pipeline import PipelineSpec, stage_ranges
from ddlscope.studies import STUDIES
from ddlscope.studies.base import Cell, CellResult, Findings, Study, build_cell, measurement_notes
from ddlscope.studies.partition import layer_costs, largest_micro_batch, scaled, state_bytes_per_param_byte

WORLD = 2  # stages: one rank per core here
# Large enough that compute dominates the sends and waits (~0.5 s of forward and backward a micro-batch
# at m 4 on an idle core): at hidden 192 and seq 64 the waits alone put interleaved 2x over its bubble
# formula (docs/modelparallel.md).
TIMED = {"name": "gpt-synthetic", "layers": 4, "hidden": 512, "heads": 4, "seq_len": 128, "batch_size": 32,
         "steps": 4, "optimizer": "sgd", "lr": 0.05, "eval_batches": 1}
# The memory pair: a deeper, narrower GPT whose blocks dominate memory, and a cap between its partitions.
MEMORY = {**TIMED, "layers": 6, "hidden": 128, "seq_len": 64, "batch_size": 16, "steps": 3}
CAP_BYTES = 32 * 2**20
MEMORY_MICRO_BATCHES = 4
STATE_PARTS = ("parameters", "gradients", "optimizer", "activations_peak")


def _raw(workload: dict[str, Any], strategy: dict[str, Any]) -> dict[str, Any]:
    return {"seed": 0, "workload": dict(workload), "cluster": {"world_size": WORLD},
            "strategy": {"name": "pipeline", **strategy}}


def schedule_cell(schedule: str, micro_batches: int, chunks: int = 1, recompute: list[int] | None = None) -> Cell:
    key = f"pp/{schedule}/m{micro_batches}" + (f"/v{chunks}" if chunks > 1 else "") + ("/recompute" if recompute else "")
    strategy = {"schedule": schedule, "micro_batches": micro_batches, "chunks": chunks, "recompute": recompute or []}
    return build_cell(key, {"part": "schedule", "schedule": schedule, "m": micro_batches, "v": chunks,
                            "recompute": bool(recompute)}, _raw(TIMED, strategy))


def tp_cells() -> list[Cell]:
    """Tensor parallel on the schedules' GPT, and one process on it (the activations' reference)."""
    tp = _raw(TIMED, {})
    tp["strategy"] = {"name": "tp"}
    single = {**_raw(TIMED, {}), "strategy": {"name": "single"}, "cluster": {"world_size": 1}}
    return [build_cell("tp/t2", {"part": "tp"}, tp), build_cell("single", {"part": "reference"}, single)]


def recompute_cells() -> list[Cell]:
    """The `single` cell's GPT in one process under selective and full recompute (workload.recompute):
    what each keeps and costs against that cell, which recomputes nothing."""
    return [build_cell(f"recompute/{mode}", {"part": "recompute", "recompute": mode},
                       {**_raw({**TIMED, "recompute": mode}, {}), "strategy": {"name": "single"},
                        "cluster": {"world_size": 1}})
            for mode in ("selective", "full")]


def memory_cells() -> list[Cell]:
    """The balanced and the equal-layer partition, both at the balanced one's largest micro-batch."""
    plan = memory_plan()
    cells = []
    for label, cuts in (("balanced", plan.balanced_cuts), ("equal", plan.equal_cuts)):
        workload = {**MEMORY, "batch_size": plan.balanced_micro_batch * MEMORY_MICRO_BATCHES}
        cells.append(build_cell(f"memory/{label}", {"part": "memory", "partition": label},
                                _raw(workload, {"schedule": "1f1b", "micro_batches": MEMORY_MICRO_BATCHES,
                                                "partition": cuts})))
    return cells


@dataclass(frozen=True)
class MemoryPlan:
    layers: list[Layer]  # at the balanced partition's largest micro-batch
    balanced_micro_batch: int
    equal_micro_batch: int
    recompute_micro_batch: int
    balanced_cuts: list[int]
    equal_cuts: list[int]
    state_factor: float


@lru_cache(maxsize=1)
def memory_plan() -> MemoryPlan:
    """The memory pair's partitions from a profile of its model (once per process)."""
    exp = _one_process(MEMORY)
    profiled_at = MEMORY["batch_size"] // MEMORY_MICRO_BATCHES
    layers = layer_costs(exp, profiled_at)
    factor = state_bytes_per_param_byte(exp)
    spec = PipelineSpec(micro_batches=MEMORY_MICRO_BATCHES)
    equal = spec.cuts(MEMORY["layers"], WORLD)
    args = (layers, profiled_at, WORLD, MEMORY_MICRO_BATCHES, CAP_BYTES, "1f1b", factor)
    best = largest_micro_batch(*args)
    at_best = scaled(layers, best / profiled_at)
    plan = partition(at_best, WORLD, MEMORY_MICRO_BATCHES, CAP_BYTES, "1f1b", False, factor)
    if plan is None:
        raise RuntimeError("no partition of the memory study's model fits its cap")
    return MemoryPlan(at_best, best, largest_micro_batch(*args, cuts=equal),
                      largest_micro_batch(*args, allow_recompute=True), plan.cuts, equal, factor)


@STUDIES.register("modelparallel")
class ModelParallelStudy(Study):
    description = ("pipeline schedules x micro-batches, a memory-balanced partition vs equal layers under one cap, "
                   "recompute: bubble, per-stage memory, step time against the formulas and the predictor")
    cell_columns = ("step ms", "wall s")

    def cells(self, quick: bool, repeats: int = 1) -> list[Cell]:
        if quick:
            cells = [schedule_cell("gpipe", 4), schedule_cell("1f1b", 4), schedule_cell("1f1b", 8),
                     schedule_cell("interleaved", 4, 2), schedule_cell("zero-bubble", 4, 2),
                     schedule_cell("1f1b", 4, recompute=[0])]
        else:
            cells = [schedule_cell(s, m) for s in ("gpipe", "1f1b") for m in (2, 4, 8, 16)]
            cells += [schedule_cell(s, m, 2) for s in ("interleaved", "zero-bubble") for m in (4, 8)]
            cells += [schedule_cell("1f1b", 4, recompute=[0]), schedule_cell("1f1b", 4, recompute=[0, 1])]
        return cells + tp_cells() + recompute_cells() + memory_cells()

    def analyse(self, results: list[CellResult], quick: bool) -> Findings:
        return _Analysis(results).findings()


class _Analysis:
    def __init__(self, results: list[CellResult]):
        self.results = results
        self.schedule_rows = [self._schedule_row(r) for r in results if r.cell.labels["part"] == "schedule"]

    # ------------------------------------------------------------------ per cell
    def _schedule_row(self, r: CellResult) -> dict[str, Any]:
        labels, exp = r.cell.labels, r.cell.experiment
        spec: PipelineSpec = exp.strategy  # type: ignore[assignment]
        p, m, v = WORLD, labels["m"], labels["v"]
        by_rank = r.summary.breakdown_mean_s_by_rank
        compute = {rank: b["forward_s"] + b["backward_s"] for rank, b in by_rank.items()}
        busiest = max(compute, key=lambda k: compute[k])
        measured_bubble = by_rank[busiest]["comm_wait_s"] / compute[busiest]
        layers = _profile(exp.workload.batch_size // m)
        ranges = stage_ranges(spec.cuts(TIMED["layers"], p), len(layers))
        recompute = set(spec.recompute)
        stage_f = [sum(l.forward_s for l in layers[a:b]) for a, b in ranges]
        stage_b = [sum(l.backward_s for l in layers[a:b]) + (stage_f[s] if s in recompute else 0.0)
                   for s, (a, b) in enumerate(ranges)]
        timeline = simulate(_orders(spec.schedule, p, m, v), _durations(stage_f, stage_b), len(ranges))
        memory = r.summary.memory_bytes_by_rank
        # each rank's compute per step as profiled: its stages' forward + backward, m micro-batches
        owned = {rank: [s for s in range(len(ranges)) if s % p == rank] for rank in range(p)}
        predicted_compute = {rank: m * sum(stage_f[s] + stage_b[s] for s in stages) for rank, stages in owned.items()}
        return {"key": r.cell.key, "schedule": spec.schedule, "m": m, "v": v, "recompute": sorted(recompute),
                "measured_bubble": measured_bubble, "formula_bubble": bubble_fraction(p, m, v, spec.schedule),
                "simulated_bubble": timeline.bubble_fraction(), "measured_step_s": r.summary.mean_step_s,
                "predicted_step_s": timeline.makespan_s,
                "activations_peak": {rank: mem.get("activations_peak", 0) for rank, mem in memory.items()},
                "compute_s": compute, "idle_s": {k: b["comm_wait_s"] for k, b in by_rank.items()},
                "compute_cpu_s": {k: b["compute_cpu_s"] for k, b in by_rank.items()},
                "predicted_compute_s": predicted_compute}

    # ------------------------------------------------------------------ findings
    def findings(self) -> Findings:
        headlines = [h for h in (self._bubble(), self._step(), self._in_flight(), self._recompute(),
                                 self._tp_activations(), self._workload_recompute(), self._memory()) if h]
        decisions = self._decisions()
        notes = measurement_notes(self.results) + [
            "The bubble is measured as the busiest stage's idle time (waits for its sends and receives, which "
            "include the transfers and the wake-up of a waiting rank) over its compute time.",
            "Predicted stage times come from one process profiling each layer alone on one thread; the ranks "
            "share this machine's cores with each other (and with whatever else runs), which stretches them."]
        table = ["schedule cells: measured / formula / simulated bubble, measured / predicted step"]
        for row in self.schedule_rows:
            table.append(f"  {row['key']}: bubble {row['measured_bubble']:.3f} / {row['formula_bubble']:.3f} / "
                         f"{row['simulated_bubble']:.3f}; step {row['measured_step_s'] * 1e3:.0f} / "
                         f"{row['predicted_step_s'] * 1e3:.0f} ms")
        text = "\n".join([f"- {h['headline']}: reference: {h['paper']} | measured: {h['measured']} | predicted: "
                          f"{h['predicted']} | {h['verdict']}" for h in headlines] + table
                         + ["", "Decisions:"] + [f"- {d}" for d in decisions])
        return Findings(headlines, decisions, notes, text, extra={"schedules": self.schedule_rows})

    def _rows(self, **match: Any) -> list[dict[str, Any]]:
        return [r for r in self.schedule_rows if all(r[k] == v for k, v in match.items())]

    def _bubble(self) -> dict[str, str] | None:
        plain = [r for r in self.schedule_rows if not r["recompute"] and r["schedule"] != "zero-bubble"]
        if not plain:
            return None
        errors = [abs(r["measured_bubble"] / r["formula_bubble"] - 1) for r in plain]
        worst = max(errors)
        return {"headline": "Pipeline bubble", "paper": "(p - 1) / m; (p - 1) / (m v) interleaved (REFERENCE.md)",
                "measured": ", ".join(f"{r['key']} {r['measured_bubble']:.3f}" for r in plain),
                "predicted": ", ".join(f"{r['formula_bubble']:.3f}" for r in plain),
                "verdict": f"{'within' if worst <= 0.25 else 'outside'} 25% (worst {worst:.0%})"}

    def _step(self) -> dict[str, str] | None:
        rows = [r for r in self.schedule_rows if r["measured_step_s"]]
        if not rows:
            return None
        errors = [r["predicted_step_s"] / r["measured_step_s"] - 1 for r in rows]
        # the stages' compute against their thread CPU time: the profile's error without the time the
        # ranks lost waiting for a core
        cpu_errors = [r["predicted_compute_s"][k] / r["compute_cpu_s"][k] - 1 for r in rows for k in r["compute_cpu_s"]]
        return {"headline": "Pipeline step time", "paper": "torch's action order played out with profiled stage times",
                "measured": ", ".join(f"{r['key']} {r['measured_step_s'] * 1e3:.0f} ms" for r in rows),
                "predicted": ", ".join(f"{r['predicted_step_s'] * 1e3:.0f} ms" for r in rows),
                "verdict": (f"step error {_mean_abs(errors):.0%} (from {min(errors):+.0%} to {max(errors):+.0%}); "
                            f"stage compute against its CPU time {_mean_abs(cpu_errors):.0%} "
                            f"({min(cpu_errors):+.0%} to {max(cpu_errors):+.0%}); the ranks' compute took "
                            f"{_stretch(rows):.2g}x its CPU time (cores shared)")}

    def _in_flight(self) -> dict[str, str] | None:
        gpipe, one = self._rows(schedule="gpipe", m=4, recompute=[]), self._rows(schedule="1f1b", m=4, recompute=[])
        if not gpipe or not one:
            return None
        ratio = gpipe[0]["activations_peak"][0] / one[0]["activations_peak"][0]
        return {"headline": "In-flight activations, stage 0", "paper": "GPipe holds m micro-batches, 1F1B p",
                "measured": f"GPipe / 1F1B = {ratio:.2f}", "predicted": f"{4 / WORLD:.2f}",
                "verdict": "matches" if abs(ratio / (4 / WORLD) - 1) < 0.05 else "differs"}

    def _recompute(self) -> dict[str, str] | None:
        base, rec = self._rows(schedule="1f1b", m=4, recompute=[]), self._rows(schedule="1f1b", m=4, recompute=[0])
        if not base or not rec:
            return None
        base, rec = base[0], rec[0]
        compute_cost = rec["compute_cpu_s"][0] / base["compute_cpu_s"][0] - 1  # CPU time: not the machine's load
        predicted = 1.0 / 3.0  # one more forward, a third of forward + backward (backward = 2 x forward)
        return {"headline": "Recompute, stage 0", "paper": "one more forward in backward: about +1/3 compute",
                "measured": f"compute {compute_cost:+.0%}; step {rec['measured_step_s'] / base['measured_step_s'] - 1:+.0%}",
                "predicted": f"compute {predicted:+.0%}; step {rec['predicted_step_s'] / base['predicted_step_s'] - 1:+.0%}",
                "verdict": (f"stage 0 keeps {rec['activations_peak'][0] / 2**10:,.0f} KiB of activations at its peak "
                            f"against {base['activations_peak'][0] / 2**20:,.1f} MiB without: its inputs only (the "
                            "micro-batches' token ids)")}

    def _tp_activations(self) -> dict[str, str] | None:
        cells = {r.cell.labels["part"]: r for r in self.results if r.cell.labels["part"] in ("tp", "reference")}
        if set(cells) != {"tp", "reference"}:
            return None
        t = cells["tp"].cell.experiment.cluster.world_size
        layers = _profile(TIMED["batch_size"])
        blocks = sum(layer.activation_bytes for layer in layers[1:-1])
        single = cells["reference"].summary.memory_bytes_by_rank[0]["activations"]
        # the one-process run's blocks scaled by Korthikanti's (10 + 24/t) / 34; embedding and head replicated
        predicted = single - blocks + blocks * (10 + 24 / t) / 34
        measured = [mem["activations"] for _, mem in sorted(cells["tp"].summary.memory_bytes_by_rank.items())]
        error = max(abs(m / predicted - 1) for m in measured)
        return {"headline": f"Tensor-parallel activations per rank (t = {t})",
                "paper": "s b h (10 + 24/t) per layer against 34 s b h (REFERENCE.md, Korthikanti et al. 2022)",
                "measured": f"{_mibs(measured)} MiB (one process {single / 2**20:.1f})",
                "predicted": f"{predicted / 2**20:.1f} MiB", "verdict": f"within {error:.1%}"}

    def _workload_recompute(self) -> dict[str, str] | None:
        cells = {r.cell.labels.get("recompute", "none"): r for r in self.results
                 if r.cell.labels["part"] in ("recompute", "reference")}
        if set(cells) != {"none", "selective", "full"}:
            return None
        kept = {mode: r.summary.memory_bytes_by_rank[0]["activations"] for mode, r in cells.items()}
        cpu = {mode: r.summary.breakdown_mean_s_by_rank[0]["compute_cpu_s"] for mode, r in cells.items()}
        predicted_kept, predicted_cost = recompute_formulas(kept["none"])
        error = max(abs(kept[mode] / predicted_kept[mode] - 1) for mode in ("selective", "full"))
        return {"headline": "Activation recompute (workload.recompute, one process)",
                "paper": "full keeps each block's input, 2 s b h bytes in 16-bit (Korthikanti et al. 2022), "
                         "for one more forward",
                "measured": ", ".join(f"{mode} {kept[mode] / 2**20:.1f} MiB, compute {cpu[mode] / cpu['none'] - 1:+.0%}"
                                      for mode in ("none", "selective", "full")),
                "predicted": ", ".join(f"{mode} {predicted_kept[mode] / 2**20:.1f} MiB, compute "
                                       f"{predicted_cost[mode]:+.0%}" for mode in ("selective", "full")),
                "verdict": f"kept activations within {error:.1%}"}

    def _memory(self) -> dict[str, str] | None:
        cells = {r.cell.labels["partition"]: r for r in self.results if r.cell.labels["part"] == "memory"}
        if set(cells) != {"balanced", "equal"}:
            return None
        plan = memory_plan()
        measured = {label: [sum(mem.get(k, 0) for k in STATE_PARTS)
                            for _, mem in sorted(r.summary.memory_bytes_by_rank.items())]
                    for label, r in cells.items()}
        predicted = {label: [s.memory_bytes for s in plan_of_cuts(plan.layers, cuts, MEMORY_MICRO_BATCHES, "1f1b",
                                                                  None, plan.state_factor).stages]
                     for label, cuts in (("balanced", plan.balanced_cuts), ("equal", plan.equal_cuts))}
        mib = 2**20
        fits = max(measured["balanced"]) <= CAP_BYTES < max(measured["equal"])
        return {"headline": f"Largest micro-batch under {CAP_BYTES / mib:.0f} MiB per stage",
                "paper": "a memory-balanced partition fits more (DawnPiper, BaPipe)",
                "measured": (f"at {plan.balanced_micro_batch} samples: balanced {_mibs(measured['balanced'])} MiB, "
                             f"equal layers {_mibs(measured['equal'])} MiB"),
                "predicted": (f"largest: balanced {plan.balanced_micro_batch}, equal {plan.equal_micro_batch}, "
                              f"balanced + recompute {plan.recompute_micro_batch}; stages "
                              f"{_mibs(predicted['balanced'])} / {_mibs(predicted['equal'])} MiB"),
                "verdict": "balanced fits, equal does not" if fits else "not shown here"}

    def _decisions(self) -> list[str]:
        out = []
        m4 = {r["schedule"]: r for r in self.schedule_rows if r["m"] == 4 and not r["recompute"]}
        if "1f1b" in m4 and "gpipe" in m4:
            out.append("1F1B costs GPipe's bubble but holds p micro-batches instead of m: prefer it whenever "
                       "activations matter.")
        if "interleaved" in m4 and "1f1b" in m4:
            out.append(f"Interleaving (v = 2) measured a bubble of {m4['interleaved']['measured_bubble']:.3f} "
                       f"against 1F1B's {m4['1f1b']['measured_bubble']:.3f}, for twice the sends.")
        return out


def recompute_formulas(kept_plain_bytes: float) -> tuple[dict[str, float], dict[str, float]]:
    """What the study's GPT keeps and computes more under selective and full recompute, from what it keeps
    without: per block (fp32, no dropout, fused attention; exact in tests/test_recompute.py) 16 s b h
    floats, the attention's log-sum-exp (b a s floats) and two norms' mean and 1/std (4 b s floats);
    selective drops the log-sum-exp, full all of it but the block's input (s b h floats). Compute: the
    hardware FLOPs the profiler counts as the step runs them, over the model FLOPs."""
    s, b, h, a, layers = TIMED["seq_len"], TIMED["batch_size"], TIMED["hidden"], TIMED["heads"], TIMED["layers"]
    float_bytes = 4
    log_sum_exp = b * a * s * float_bytes
    block = 16 * s * b * h * float_bytes + log_sum_exp + 4 * b * s * float_bytes
    kept = {"selective": kept_plain_bytes - layers * log_sum_exp,
            "full": kept_plain_bytes - layers * (block - s * b * h * float_bytes)}
    return kept, _recompute_flop_cost()


@lru_cache(maxsize=1)
def _recompute_flop_cost() -> dict[str, float]:
    """Hardware over model FLOPs - 1 of the study's GPT under selective and full recompute (once per process:
    it depends on TIMED only)."""
    from ddlscope.runtime.profiler import profile_step
    from ddlscope.workloads import WORKLOADS

    cost = {}
    for mode in ("selective", "full"):
        exp = _one_process({**TIMED, "recompute": mode})
        task = WORKLOADS.get(exp.workload.name).build(exp.workload, 0)
        x, y = task.train.get(torch.arange(exp.workload.batch_size))
        profile = profile_step(task.model, task.loss_fn, x, y)
        cost[mode] = profile.hardware_flops / profile.flops - 1
    return cost


def _stretch(rows: list[dict[str, Any]]) -> float:
    """Wall-clock compute over thread CPU compute, all cells and ranks: 1 on cores of their own."""
    return sum(sum(r["compute_s"].values()) for r in rows) / sum(sum(r["compute_cpu_s"].values()) for r in rows)


def _mean_abs(values: list[float]) -> float:
    return sum(abs(v) for v in values) / len(values)


def _mibs(values: list[float]) -> str:
    return "/".join(f"{v / 2**20:.1f}" for v in values)


@lru_cache(maxsize=8)
def _profile(micro_batch: int) -> list[Layer]:
    return layer_costs(_one_process(TIMED), micro_batch)


def _one_process(workload: dict[str, Any]) -> Experiment:
    """The experiment of `workload` (a dict of workload knobs) on one rank."""
    return load_experiment(None, {**{f"workload.{k}": v for k, v in workload.items()}, "cluster.world_size": 1})


def _orders(schedule: str, ranks: int, micro_batches: int, chunks: int) -> list[list[Action]]:
    """Each rank's actions in torch's order: GPipe and 1F1B as predict/schedule_sim.py writes them, the
    multi-stage schedules from torch's own schedule classes."""
    if chunks == 1:
        return single_stage_orders(schedule, ranks, micro_batches)
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    name = {"interleaved": "Interleaved1F1B", "zero-bubble": "InterleavedZeroBubble"}[schedule]
    ops = get_schedule_ops(name, ranks, micro_batches, chunks)
    return [[(a.computation_type.value, a.stage_index, a.microbatch_index) for a in row
             if a is not None and a.computation_type.value in ("F", "B", "I", "W")] for row in ops]


def _durations(forward_s: list[float], backward_s: list[float]):  # type: ignore[no-untyped-def]
    """An action's time from its stage's: zero-bubble's input and weight halves each half a backward."""
    def duration(action: Action) -> float:
        kind, stage, _ = action
        if kind == "F":
            return forward_s[stage]
        return backward_s[stage] if kind == "B" else backward_s[stage] / 2

    return duration
