"""The summary of one stored run: throughput, speedup, breakdown, memory, metric.

Throughput counts steady-state steps only: step 0 pays one-off costs (DDP
bucket construction, lazy allocation), so it is left out when there are
others. A step lasts as long as its slowest rank.

MFU is per rank: the model FLOPs of one of the rank's steps (counted before
training, event `flops`) over the effective step time, over the peak FLOP/s
of the rank's own device (or cores). With data parallelism each rank's FLOPs
are those of its per-rank batch; with sharding (FSDP) each rank still
computes the whole model on its batch, so nothing is divided. HFU uses
hardware FLOPs (model FLOPs plus recomputation; equal here, since no
strategy recomputes activations).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from ddlscope.specs import STRATEGY_SPECS, WorkloadSpec, is_baseline, traits_of
from ddlscope.store import Run, Store

PHASES = ("data_s", "forward_s", "backward_s", "comm_wait_s", "optimizer_s")


@dataclass
class Summary:
    run: dict[str, Any]
    steps_recorded: int
    ranks_recorded: int
    warmup_steps_excluded: int
    mean_step_s: float | None
    throughput_samples_per_s: float | None
    baseline_run_id: int | None
    speedup_vs_single: float | None
    scaling_efficiency: float | None
    breakdown_mean_s: dict[str, float]
    breakdown_fraction: dict[str, float]
    comm: dict[str, float]
    memory_bytes_by_rank: dict[int, dict[str, int]]
    final_eval: dict[str, Any] | None
    final_loss: float | None
    train_wall_s: float | None  # first step start to the last rank's last step end
    oversubscribed: bool  # more ranks than cores on one machine
    cpu_derived_step_s: float | None  # step time with compute taken from thread CPU time
    cpu_derived_wall_s: float | None  # the slowest rank's total of those per-step times
    staleness: dict[str, float] = field(default_factory=dict)  # parameter servers: mean, max, updates
    server_busy_fraction: float | None = None  # parameter servers: apply CPU time / server wall time
    straggler_steps: dict[int, int] = field(default_factory=dict)  # rank -> steps it was the slowest to compute
    notes: list[str] = field(default_factory=list)
    model_flops_per_step: float | None = None  # per rank: forward + backward of its per-rank batch
    hardware_flops_per_step: float | None = None  # per rank: model FLOPs + recomputation (none here)
    achieved_flops_per_s: float | None = None  # per rank: model FLOPs / effective step time
    peak_flops_per_s: float | None = None  # per rank: what MFU divides by (see flops_basis)
    mfu: float | None = None  # achieved model FLOP/s / peak, mean over ranks
    hfu: float | None = None  # achieved hardware FLOP/s / peak, mean over ranks
    mfu_by_rank: dict[int, float] = field(default_factory=dict)
    flops_basis: str | None = None
    # Rank 0's evaluations in step order: step, wall_s (training time so far), samples_seen, metric_name, metric.
    eval_curve: list[dict[str, Any]] = field(default_factory=list)
    final_params_sha256: str | None = None  # hash of the final full parameters (runtime/checkpoint.params_sha256)
    restarts: int = 0  # times the worker group was restarted (elastic) or the run resumed
    # Each rank's mean phase times (and compute_cpu_s) over the steady steps (a pipeline's stages differ:
    # compute vs idle).
    breakdown_mean_s_by_rank: dict[int, dict[str, float]] = field(default_factory=dict)
    # Evaluations of named predictors on parts of the test set, from `block_eval` events (federated
    # per-block predictors): predictor, block, accuracy, loss, samples.
    block_evals: list[dict[str, Any]] = field(default_factory=list)
    # Run-level numbers a strategy reports after training (`strategy_metric` events), as it wrote them:
    # name, value, detail (one line saying what it is), rank where it is one rank's (e.g. gossip's privacy
    # epsilon, or the neighbour copies an asynchronous worker mixed in).
    strategy_metrics: list[dict[str, Any]] = field(default_factory=list)

    @property
    def timing_basis(self) -> str:
        return "thread CPU time of compute (ranks > cores)" if self.oversubscribed else "wall clock"

    @property
    def effective_wall_s(self) -> float | None:
        """Training time comparisons should use: CPU-derived when ranks share cores."""
        return self.cpu_derived_wall_s if self.oversubscribed else self.train_wall_s

    @property
    def effective_step_s(self) -> float | None:
        """The step time comparisons should use: CPU-derived when ranks share cores."""
        return self.cpu_derived_step_s if self.oversubscribed else self.mean_step_s

    def time_to_metric_s(self, target: float, lower_is_better: bool = False) -> float | None:
        """Training time until the first evaluation at (or past) `target`; on the effective clock when
        ranks share cores (wall times scaled by effective / wall training time). None if never reached."""
        scale = (self.effective_wall_s / self.train_wall_s
                 if self.oversubscribed and self.effective_wall_s and self.train_wall_s else 1.0)
        for point in self.eval_curve:
            metric = point["metric"]
            if metric is not None and (metric <= target if lower_is_better else metric >= target):
                return point["wall_s"] * scale
        return None

    def metric_at_s(self, seconds: float) -> float | None:
        """The metric of the last evaluation within `seconds` of training (effective clock); None before the first."""
        scale = (self.effective_wall_s / self.train_wall_s
                 if self.oversubscribed and self.effective_wall_s and self.train_wall_s else 1.0)
        reached = [p["metric"] for p in self.eval_curve if p["wall_s"] * scale <= seconds + 1e-9]
        return reached[-1] if reached else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["memory_bytes_by_rank"] = {str(k): v for k, v in self.memory_bytes_by_rank.items()}
        d["straggler_steps"] = {str(k): v for k, v in self.straggler_steps.items()}
        d["mfu_by_rank"] = {str(k): v for k, v in self.mfu_by_rank.items()}
        d["breakdown_mean_s_by_rank"] = {str(k): v for k, v in self.breakdown_mean_s_by_rank.items()}
        return d


@dataclass
class StepAggregates:
    """What the summary and the report need from a run's step rows, aggregated by the store in two
    passes over them (SQL, in key order), never loading the rows: at 1,024 ranks x 10,000 steps that is
    10 million rows in seconds and a few megabytes.

    `by_rank`: one row per rank (Store.step_sums_by_rank); `by_step`: one row per steady step
    (Store.step_extremes_by_step). Step 0, or the first step recorded, is left out of the steady ones
    when there are others (`warmup`)."""

    ranks: list[int]
    steps_recorded: int
    warmup: int
    last_step: int | None
    by_rank: list[Any]
    by_step: list[Any]

    @property
    def steady_rows(self) -> int:
        return sum(r["steady_rows"] for r in self.by_rank)

    def steady_mean(self, column: str) -> float:
        """Mean over every steady rank-step."""
        return sum(r[column] or 0 for r in self.by_rank) / self.steady_rows

    def rank_means(self, column: str) -> dict[int, float]:
        """Per rank, the mean of a column over its steady steps (a missing value counts 0 for phases)."""
        return {r["rank"]: (r[column] or 0) / r["steady_rows"] for r in self.by_rank if r["steady_rows"]}

    def slowest_step_s(self) -> list[float]:
        """Per steady step, in step order, the slowest rank's step time."""
        return [r["max_step_s"] for r in self.by_step if r["max_step_s"] is not None]


def _breakdown_by_rank(agg: StepAggregates) -> dict[int, dict[str, float]]:
    """Per rank, the mean of each phase and of the compute's CPU time over its steady steps."""
    means = {column: agg.rank_means(column) for column in (*PHASES, "compute_cpu_s")}
    return {rank: {column: means[column][rank] for column in means} for rank in sorted(means["data_s"])}


def aggregate_steps(store: Store, run: Run) -> StepAggregates:
    ranks = store.step_ranks(run.id)
    first, second, last = store.step_range(run.id, ranks)
    warmup = 1 if second is not None else 0
    steady_from = (second if warmup else first) or 0
    by_rank = store.step_sums_by_rank(run.id, steady_from, last if last is not None else -1) if ranks else []
    by_step = store.step_extremes_by_step(run.id, steady_from) if ranks else []
    return StepAggregates(ranks, len(by_step) + warmup, warmup, last, by_rank, by_step)


def summarize(store: Store, run: Run, steps: StepAggregates | None = None) -> Summary:
    agg = steps or aggregate_steps(store, run)
    steady = agg.steady_rows > 0

    # The slowest rank's mean step. Not the mean over steps of the longest rank-step: in synchronous
    # training the ranks' step windows are offset, and the rank that starts first waits longest, so
    # the longest window of each step overstates the step period (by ~18% at 4 ranks on 2 cores).
    mean_step_s = max((r["step_s"] / r["steady_step_s_rows"] for r in agg.by_rank if r["steady_step_s_rows"]),
                      default=None)
    # The mean over steady steps of the samples all ranks processed in it; where every rank takes the
    # whole batch (pipeline stages, tensor or node parallel ranks), the batch once, not once per rank.
    global_samples = sum(r["samples"] or 0 for r in agg.by_rank) / len(agg.by_step) if agg.by_step else None
    traits = traits_of(run.config.get("strategy", {}).get("name", ""))
    if global_samples is not None and traits is not None and not traits.splits_global_batch and agg.by_rank:
        global_samples /= len(agg.by_rank)
    throughput = global_samples / mean_step_s if mean_step_s and global_samples is not None else None

    breakdown = {p: agg.steady_mean(p) for p in PHASES} if steady else {}
    step_mean = agg.steady_mean("step_s") if steady else 0.0
    fractions = {p: v / step_mean for p, v in breakdown.items()} if step_mean else {}
    comm = _comm_stats(agg) if steady else {}

    baseline = find_single_baseline(store, run)
    speedup = efficiency = None
    if baseline is not None and throughput:
        base_throughput = summarize(store, baseline).throughput_samples_per_s
        if base_throughput:
            speedup = throughput / base_throughput
            efficiency = speedup / run.world_size

    memory: dict[int, dict[str, int]] = {}
    for m in store.memory(run.id):
        memory.setdefault(m["rank"], {})[m["category"]] = m["bytes"]

    evals = store.evals(run.id)
    final_eval = dict(evals[-1]) if evals else None
    curve = [{k: e[k] for k in ("step", "wall_s", "samples_seen", "metric_name", "metric")} for e in evals
             if e["rank"] == min(r["rank"] for r in evals)]
    if final_eval:
        final_eval.pop("run_id", None)
    # A diverged step stores its NaN loss as NULL: the mean is over the finite ones (None when there are none).
    last_losses = sum(r["last_losses"] for r in agg.by_rank)

    oversubscribed = _oversubscribed(run)
    cpu_steps = [r["max_cpu_derived_s"] for r in agg.by_step if r["max_cpu_derived_s"] is not None]
    cpu_step = sum(cpu_steps) / len(cpu_steps) if cpu_steps else None
    summary = Summary(
        run=_run_info(run), steps_recorded=agg.steps_recorded, ranks_recorded=len(agg.ranks),
        warmup_steps_excluded=agg.warmup, mean_step_s=mean_step_s, throughput_samples_per_s=throughput,
        baseline_run_id=baseline.id if baseline else None, speedup_vs_single=speedup,
        scaling_efficiency=efficiency, breakdown_mean_s=breakdown, breakdown_fraction=fractions, comm=comm,
        memory_bytes_by_rank=memory, final_eval=final_eval,
        final_loss=sum(r["last_loss_sum"] or 0.0 for r in agg.by_rank) / last_losses if last_losses else None,
        train_wall_s=max((r["end_s"] for r in agg.by_rank if r["end_s"] is not None), default=None),
        oversubscribed=oversubscribed, cpu_derived_step_s=cpu_step,
        cpu_derived_wall_s=max((r["cpu_derived_s"] for r in agg.by_rank if r["cpu_derived_s"] is not None),
                               default=None),
        staleness=_staleness(store, run), server_busy_fraction=_server_busy_fraction(store, run),
        straggler_steps=_straggler_steps(agg), notes=_notes(run), eval_curve=curve,
        breakdown_mean_s_by_rank=_breakdown_by_rank(agg),
    )
    _add_utilization(summary, store, run)
    _add_recovery(summary, store, run)
    summary.block_evals = [json.loads(e["message"]) for e in store.events(run.id) if e["kind"] == "block_eval"]
    metrics = [json.loads(e["message"]) for e in store.events(run.id) if e["kind"] == "strategy_metric"]
    summary.strategy_metrics = sorted(metrics, key=lambda m: (m.get("rank", -1), m["name"]))  # run-wide first
    return summary


def _add_recovery(summary: Summary, store: Store, run: Run) -> None:
    """The final parameters' hash, and how often the run was restarted or resumed (from its events)."""
    attempts = set()
    for event in store.events(run.id):
        if event["kind"] == "final_params":
            summary.final_params_sha256 = event["message"].partition("sha256=")[2] or None
        elif event["kind"] == "restart" and event["rank"] == 0:
            attempts.add(("restart", event["message"]))
        elif event["kind"] == "resumed":
            attempts.add(("resumed", event["seq"]))
    summary.restarts = len(attempts)


def _add_utilization(summary: Summary, store: Store, run: Run) -> None:
    """MFU and HFU from the ranks' `flops` events; nothing when the run recorded none (older runs)."""
    per_rank: dict[int, dict[str, str]] = {}
    for event in store.events(run.id):
        if event["kind"] == "flops":
            per_rank[event["rank"]] = dict(part.split("=", 1) for part in event["message"].split() if "=" in part)
    step_s = summary.effective_step_s
    if not per_rank or not step_s:
        return
    model, hardware, peak, mfu, hfu = [], [], [], {}, []
    for rank, fields in sorted(per_rank.items()):
        f_model, f_hw = float(fields["model_flops_per_step"]), float(fields["hardware_flops_per_step"])
        f_peak = float(fields["peak_flops_per_s"])
        model.append(f_model)
        hardware.append(f_hw)
        peak.append(f_peak)
        mfu[rank] = f_model / step_s / f_peak
        hfu.append(f_hw / step_s / f_peak)
    summary.model_flops_per_step = statistics.fmean(model)
    summary.hardware_flops_per_step = statistics.fmean(hardware)
    summary.achieved_flops_per_s = summary.model_flops_per_step / step_s
    summary.peak_flops_per_s = statistics.fmean(peak)
    summary.mfu_by_rank = mfu
    summary.mfu = statistics.fmean(mfu.values())
    summary.hfu = statistics.fmean(hfu)
    source = next(iter(per_rank.values())).get("peak_source", "").replace("_", " ")
    summary.flops_basis = (f"per rank: {summary.model_flops_per_step:.4g} model FLOPs per step over "
                           f"{summary.timing_basis} step time; peak {source}")


def find_single_baseline(store: Store, run: Run) -> Run | None:
    """The newest finished one-process run of the same workload spec, the speedup's denominator; its
    schedule (steps, evaluations) may differ, since a step is compared with a step."""
    baselines = [name for name in STRATEGY_SPECS.names() if is_baseline(name)]
    if run.strategy in baselines:
        return None
    mine = _step_defining(run.config.get("workload"))
    for strategy in baselines:
        for candidate in store.find_runs(workload=run.workload, strategy=strategy):
            if _step_defining(candidate.config.get("workload")) == mine:
                return candidate
    return None


def _step_defining(workload: Any) -> Any:
    """A stored workload section without the fields that only schedule the run."""
    if not isinstance(workload, dict):
        return workload
    return {k: v for k, v in workload.items() if k not in WorkloadSpec.SCHEDULE_FIELDS}


def _straggler_steps(agg: StepAggregates) -> dict[int, int]:
    """How often each rank was the one the others waited for: the most time outside communication."""
    counts: dict[int, int] = {}
    for row in agg.by_step:
        if row["ranks"] > 1:
            counts[row["straggler"]] = counts.get(row["straggler"], 0) + 1
    return dict(sorted(counts.items()))


def _oversubscribed(run: Run) -> bool:
    cores = run.environment.get("cores")
    ranks = run.world_size + run.environment.get("extra_ranks", 0)
    return bool(cores) and ranks > cores and run.config.get("cluster", {}).get("nnodes", 1) == 1


def _staleness(store: Store, run: Run) -> dict[str, float]:
    values = [u["staleness"] for u in store.updates(run.id)]
    if not values:
        return {}
    return {"mean": statistics.fmean(values), "max": float(max(values)), "updates": float(len(values))}


def _server_busy_fraction(store: Store, run: Run) -> float | None:
    """Share of the servers' wall time spent applying updates (1.0: the server is the bottleneck)."""
    wall = busy = 0.0
    for event in store.events(run.id):
        if event["kind"] == "server_end":
            fields = dict(part.split("=", 1) for part in event["message"].split())
            wall += float(fields["wall_s"])
            busy += float(fields["busy_cpu_s"])
    return busy / wall if wall > 0 else None


def _comm_stats(agg: StepAggregates) -> dict[str, float]:
    total = agg.steady_mean("comm_s")
    exposed = agg.steady_mean("comm_wait_s")
    hidden = max(0.0, total - exposed)
    return {
        "bytes_sent_per_step": agg.steady_mean("bytes_sent"),
        "comm_s": total,
        "exposed_s": exposed,
        "hidden_s": hidden,
        "overlap_fraction": hidden / total if total > 0 else 0.0,
    }


def _run_info(run: Run) -> dict[str, Any]:
    return {
        "id": run.id, "uuid": run.uuid, "name": run.name, "workload": run.workload, "strategy": run.strategy,
        "world_size": run.world_size, "status": run.shown_status, "error": run.error, "seed": run.seed,
        "code_version": run.code_version, "host": run.host,
        "duration_s": (run.finished_at - run.started_at) if run.finished_at and run.started_at else None,
        "per_rank_batch": _per_rank_batch(run.config),
    }


def _per_rank_batch(config: dict[str, Any]) -> int | None:
    try:
        batch, world = config["workload"]["batch_size"], config["cluster"]["world_size"]
    except KeyError:
        return None
    traits = traits_of(config["strategy"]["name"])
    return batch if traits is not None and not traits.splits_global_batch else batch // world


def _notes(run: Run) -> list[str]:
    notes = []
    if _oversubscribed(run):
        ranks = run.world_size + run.environment.get("extra_ranks", 0)
        notes.append(f"{ranks} ranks shared {run.environment.get('cores')} cores: wall times include "
                     "oversubscription; comparisons use compute time from per-rank thread CPU time")
    network = run.environment.get("network", {})
    if network.get("emulated"):
        scaled = f", scaled x1/{network['scale_factor']:.0f} to match {network.get('target_flops', 0):.3g} FLOP/s" \
            if network.get("scaled") else ""
        if network.get("mode") == "shaped":
            notes.append(f"network '{network['profile']}' shaped with tc in network namespaces: "
                         f"{network['shaped_bandwidth_bytes_per_s'] * 8 / 1e9:.4g} Gbit/s per rank{scaled}; "
                         f"latency {network['alpha_s'] * 1e6:.0f} us emulated in software (no netem)")
        else:
            notes.append(f"network '{network['profile']}' emulated: alpha {network['alpha_s'] * 1e6:.0f} us, "
                         f"{network['bandwidth_bytes_per_s'] * 8 / 1e9:.4g} Gbit/s per rank{scaled}")
    if run.shown_status != "finished":
        notes.append(f"run is {run.shown_status}: figures cover only the rows that were recorded")
    return notes


# Emulated bandwidths scaled to this machine's measured FLOP/s this far apart are flagged when compared.
SCALE_SPREAD = 0.10


def emulation_scale_notes(runs: list[Run]) -> list[str]:
    """A note per emulated network whose runs were scaled by factors more than SCALE_SPREAD apart.

    A `scaled` network divides its bandwidth by the target GPU's FLOP/s over this machine's, measured
    when each run starts, so the same profile emulates a slower or faster link as the machine's load
    changes; the communication of such runs differs by that much before any strategy does."""
    factors: dict[str, list[tuple[float, Run]]] = {}
    for run in runs:
        network = (getattr(run, "environment", None) or {}).get("network", {})
        if network.get("emulated") and network.get("scaled") and network.get("scale_factor"):
            factors.setdefault(str(network["profile"]), []).append((float(network["scale_factor"]), run))
    notes = []
    for profile, found in sorted(factors.items()):
        (low, low_run), (high, high_run) = min(found, key=lambda f: f[0]), max(found, key=lambda f: f[0])
        if high > low * (1 + SCALE_SPREAD):
            notes.append(f"network '{profile}' was emulated at different scales here: x1/{low:.0f} (run {low_run.id}) "
                         f"to x1/{high:.0f} (run {high_run.id}), as this machine's measured FLOP/s varied with its "
                         f"load; their communication times differ by up to {high / low:.2f}x before any strategy does")
    return notes
