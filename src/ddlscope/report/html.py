"""Self-contained HTML reports of stored runs and of studies.

One page, no external reference of any kind: CSS inline, figures as PNG data
URIs, no JavaScript. Jinja2 autoescapes everything (run names, errors, config
values are user strings). This module reads the store and the analysis layer
only; it never imports torch.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import jinja2

from ddlscope import __version__
from ddlscope.analysis.summary import PHASES, Summary, aggregate_steps, emulation_scale_notes, summarize
from ddlscope.report import figures
from ddlscope.store import Run, Store, atomic_output

LOWER_IS_BETTER = ("loss", "perplexity")
KEY_FIELDS = (
    "workload.name", "workload.batch_size", "workload.steps", "workload.lr", "workload.optimizer",
    "workload.momentum", "workload.eval_every", "cluster.world_size", "cluster.nnodes", "cluster.device",
    "cluster.backend", "cluster.network.mode", "cluster.network.profile", "cluster.slowdown", "cluster.jitter",
    "seed",
)
MEMORY_BARS_PER_FIGURE = 24
# Past this many ranks a run's per-rank figures show distributions over the ranks, not a bar per rank.
RANK_BARS = 32


# ---------------------------------------------------------------------------- data from the store
@dataclass
class RunData:
    """Everything the pages show about one run, gathered once."""

    run: Run
    label: str
    summary: Summary
    step_times_s: list[float]
    rank_breakdown: dict[int, dict[str, float]]
    curve: list[dict[str, Any]]
    metric_name: str | None
    train_wall_s: float | None
    staleness: list[int] = field(default_factory=list)
    servers: list[dict[str, Any]] = field(default_factory=list)
    timeline: str | None = None  # each rank's steps over time, drawn when a worker was preempted

    @property
    def is_ps(self) -> bool:
        return bool(self.staleness or self.servers)

    @property
    def final_metric(self) -> float | None:
        fe = self.summary.final_eval
        return fe["metric"] if fe else None

    @property
    def mean_staleness(self) -> float | None:
        return statistics.fmean(self.staleness) if self.staleness else None

    def time_to_target(self, target: float) -> float | None:
        """Training wall time of the first eval that reached the target, None if none did."""
        lower = (self.metric_name or "") in LOWER_IS_BETTER
        for p in self.curve:
            m = p.get("metric")
            if m is not None and (m <= target if lower else m >= target):
                return p.get("wall_s")
        return None


def run_label(run: Run) -> str:
    return f"#{run.id} {run.name}" if run.name else f"#{run.id} {run.strategy} x{run.world_size}"


def collect(store: Store, run: Run, label: str | None = None, summary: Summary | None = None) -> RunData:
    """A run's page data from the store's aggregates of its step rows (never the rows themselves: a
    1,024-rank run has millions of them)."""
    steps = aggregate_steps(store, run)
    means = {p: steps.rank_means(f"{p}_or_zero") for p in PHASES}  # a missing phase counts 0
    rank_breakdown = {r["rank"]: {p: means[p][r["rank"]] for p in PHASES} for r in steps.by_rank if r["steady_rows"]}

    curve: dict[int, dict[str, Any]] = {}
    metric_name = None
    for e in store.evals(run.id):  # ordered by step, rank: the lowest rank's eval stands for the step
        if e["step"] not in curve:
            curve[e["step"]] = {"step": e["step"], "wall_s": e["wall_s"], "samples_seen": e["samples_seen"],
                                "metric": e["metric"], "loss": e["loss"]}
            metric_name = metric_name or e["metric_name"]

    updates = store.updates(run.id)
    events = store.events(run.id)
    servers = _servers(updates, events)
    ends = [r["end_s"] for r in steps.by_rank if r["end_s"] is not None]
    return RunData(
        run=run, label=label or run_label(run), summary=summary or summarize(store, run, steps),
        step_times_s=steps.slowest_step_s(), rank_breakdown=rank_breakdown,
        curve=[curve[s] for s in sorted(curve)], metric_name=metric_name,
        train_wall_s=max(ends) if ends else None,
        staleness=[u["staleness"] for u in updates if u["staleness"] is not None], servers=servers,
        timeline=_fig_timeline(store, run, events, label or run_label(run)),
    )


def _fig_timeline(store: Store, run: Run, events: Sequence[Any], label: str) -> str | None:
    """Steps per rank over wall time, with the spans workers were preempted; None without preemptions.

    Step rows time from each rank's own training start (t_s); events carry wall-clock time, so each
    rank's `train_start` event puts both on one axis, zero at the first rank's start."""
    if not any(e["kind"] == "preempted" for e in events):
        return None
    started = {e["rank"]: e["t"] for e in events if e["kind"] == "train_start"}
    if not started:
        return None
    zero = min(started.values())
    bars: dict[int, list[tuple[float, float]]] = {}
    for r in store.steps(run.id):
        if r["rank"] in started and r["t_s"] is not None and r["step_s"] is not None:
            bars.setdefault(r["rank"], []).append((started[r["rank"]] - zero + r["t_s"], r["step_s"]))
    left = {e["rank"]: e["t"] for e in events if e["kind"] == "preempted"}
    away = [(e["rank"], left[e["rank"]] - zero, e["t"] - zero) for e in events
            if e["kind"] == "rejoined" and e["rank"] in left]
    return figures.rank_timeline(bars, away, title=f"{label}: steps per rank; hatched: preempted")


_KV = re.compile(r"(\w+)=([-+0-9.eE]+)")


def _servers(updates: Sequence[Any], events: Sequence[Any]) -> list[dict[str, Any]]:
    """Per server rank: updates applied, time spent applying them, and its wall time (server_end event)."""
    by_rank: dict[int, list[Any]] = {}
    for u in updates:
        by_rank.setdefault(u["rank"], []).append(u)
    ends: dict[int, dict[str, float]] = {}
    for e in events:
        if e["kind"] == "server_end":
            ends[e["rank"]] = {k: float(v) for k, v in _KV.findall(e["message"] or "")}
    out = []
    for rank in sorted(set(by_rank) | set(ends)):
        rows = by_rank.get(rank, [])
        end = ends.get(rank, {})
        apply_s = sum(u["apply_s"] or 0.0 for u in rows)
        wall = end.get("wall_s")
        cpu = end.get("busy_cpu_s")
        out.append({
            "rank": rank, "updates": len(rows), "apply_s": apply_s, "wall_s": wall, "busy_cpu_s": cpu,
            "apply_share": apply_s / wall if wall else None, "cpu_share": cpu / wall if wall and cpu is not None else None,
            "mean_staleness": statistics.fmean(u["staleness"] for u in rows) if rows else None,
            "max_staleness": max(u["staleness"] for u in rows) if rows else None,
            "mean_queue_s": statistics.fmean(u["queue_s"] or 0.0 for u in rows) if rows else None,
            "mean_apply_s": apply_s / len(rows) if rows else None,
        })
    return out


# ---------------------------------------------------------------------------- figures from run data
def _fig_throughput(data: Sequence[RunData]) -> str | None:
    return figures.throughput_speedup([d.label for d in data], [d.summary.throughput_samples_per_s for d in data],
                                      [d.summary.speedup_vs_single for d in data],
                                      groups=[d.run.strategy for d in data])


def _fig_scaling(series: dict[str, dict[int, float]]) -> str | None:
    return figures.scaling_efficiency({k: sorted(v.items()) for k, v in series.items()})


def _fig_breakdown(data: Sequence[RunData]) -> str | None:
    return figures.breakdown_bars([d.label for d in data], [d.summary.breakdown_mean_s for d in data])


def _fig_rank_breakdown(d: RunData) -> str | None:
    """A bar per rank up to RANK_BARS ranks; past that, each phase's distribution over the ranks."""
    ranks = sorted(d.rank_breakdown)
    if len(ranks) > RANK_BARS:
        return figures.rank_distribution({p: {r: d.rank_breakdown[r][p] for r in ranks} for p in PHASES},
                                         f"{d.label}: mean per step of each of {len(ranks)} ranks",
                                         "ms per step (rank mean)", scale=1e3, colors=figures.PHASE_COLORS)
    return figures.breakdown_bars([f"rank {r}" for r in ranks], [d.rank_breakdown[r] for r in ranks],
                                  title=f"{d.label}: mean per step, by rank")


def _fig_memory(data: Sequence[RunData], title: str) -> list[str]:
    """Stacked memory bars per (run, rank); split into several figures when there are many bars."""
    bars = [(f"{d.label} r{rank}", cats) for d in data for rank, cats in sorted(d.summary.memory_bytes_by_rank.items())]
    if len(bars) <= MEMORY_BARS_PER_FIGURE:
        uri = figures.memory_bars([b[0] for b in bars], [b[1] for b in bars], title=title)
        return [uri] if uri else []
    out = []
    for d in data:
        mem = d.summary.memory_bytes_by_rank
        if len(mem) > RANK_BARS:
            categories = _memory_categories(mem)
            uri = figures.rank_distribution({c: {r: m[c] for r, m in mem.items() if c in m} for c in categories},
                                            f"{title}: {d.label}, over {len(mem)} ranks", "bytes",
                                            colors=figures.MEMORY_COLORS, bytes_axis=True)
            if uri:
                out.append(uri)
            continue
        uri = figures.memory_bars([f"rank {r}" for r in sorted(mem)], [mem[r] for r in sorted(mem)],
                                  title=f"{title}: {d.label}")
        if uri:
            out.append(uri)
    return out


def _fig_curves(data: Sequence[RunData], title: str | None = None, target: float | None = None,
                labels: Sequence[str] | None = None, groups: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """One metric figure per metric name (runs of different workloads can differ)."""
    by_metric: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for i, d in enumerate(data):
        if d.curve:
            by_metric.setdefault(d.metric_name or "metric", {})[labels[i] if labels else d.label] = d.curve
    out = []
    for metric, curves in by_metric.items():
        uri = figures.metric_curves(curves, metric, title=title, target=target, groups=groups)
        if uri:
            out.append({"uri": uri, "metric": metric})
    return out


def _fig_ps(data: Sequence[RunData]) -> tuple[str | None, str | None]:
    ps = [d for d in data if d.is_ps]
    stale = figures.staleness_histograms({d.label: d.staleness for d in ps})
    rows = [(f"{d.label} · server r{s['rank']}", s) for d in ps for s in d.servers]
    share = figures.server_update_times([r[0] for r in rows], [r[1]["mean_queue_s"] for r in rows],
                                        [r[1]["mean_apply_s"] for r in rows], [r[1]["apply_share"] for r in rows])
    return stale, share


# ---------------------------------------------------------------------------- formatting
def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def _show(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, (list, dict, bool)):
        return json.dumps(v)
    return str(v)


def _config_rows(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """Key config fields, every strategy knob, and any other field on which the runs differ."""
    flat = [_flatten(r.config) for r in runs]
    keys = set().union(*flat) if flat else set()
    strategy_keys = sorted(k for k in keys if k.startswith("strategy."))
    chosen = ["strategy.name", *(k for k in KEY_FIELDS if k in keys and k != "seed")]
    chosen += [k for k in strategy_keys if k not in chosen]
    if len(runs) > 1:
        chosen += sorted(k for k in keys if k not in chosen and k != "name"
                         and len({json.dumps(f.get(k), sort_keys=True, default=str) for f in flat}) > 1)
    chosen.append("seed")
    rows = []
    for key in chosen:
        values = [_show(f.get(key)) for f in flat]
        rows.append({"key": key, "cells": values, "differs": len(set(values)) > 1, "env": False})
    env_rows = [("host", [r.host for r in runs]), ("code version", [r.code_version for r in runs]),
                ("cores", [_show(r.environment.get("cores")) for r in runs]),
                ("torch", [_show(r.environment.get("torch")) for r in runs]),
                ("network emulated", [_show((r.environment.get("network") or {}).get("emulated")) for r in runs])]
    for key, values in env_rows:
        rows.append({"key": key, "cells": values, "differs": len(set(values)) > 1, "env": True})
    return rows


def fmt_num(v: Any, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    v = float(v)
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.{digits}g}"


def fmt_ms(v: Any) -> str:
    return "—" if v is None else f"{v * 1e3:.3g} ms" if v * 1e3 < 100 else f"{v * 1e3:,.0f} ms"


def fmt_s(v: Any) -> str:
    return "—" if v is None else f"{v:.3g} s" if v < 100 else f"{v:,.0f} s"


def fmt_pct(v: Any) -> str:
    return "—" if v is None else f"{v:.0%}"


def fmt_x(v: Any) -> str:
    return "—" if v is None else f"{v:.2f}x"


def fmt_bytes(n: Any) -> str:
    if n is None:
        return "—"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def _memory_categories(memory: dict[int, dict[str, int]]) -> list[str]:
    found = {c for cats in memory.values() for c in cats}
    known = [c for c in (*figures.MEMORY_CATEGORIES, "peak_rss") if c in found]
    return known + sorted(found - set(known))


def _when(ts: float | None) -> str:
    import datetime as dt

    return "—" if ts is None else dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _merge_notes(pairs: Iterable[tuple[str, str]]) -> list[str]:
    """Same note on several runs: said once, with the runs it applies to."""
    order: dict[str, list[str]] = {}
    for label, note in pairs:
        who = order.setdefault(note, [])
        if label not in who:
            who.append(label)
    return [f"{note} ({', '.join(who)})" if who and who != [""] else note for note, who in order.items()]


_ENV: jinja2.Environment | None = None


def _env() -> jinja2.Environment:
    global _ENV
    if _ENV is None:
        env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(Path(__file__).with_name("templates")),
            autoescape=jinja2.select_autoescape(enabled_extensions=("html", "htm", "xml"), default=True),
            undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
        )
        env.filters.update(num=fmt_num, ms=fmt_ms, secs=fmt_s, pct=fmt_pct, x=fmt_x, bytes=fmt_bytes, when=_when,
                           verdict_parts=verdict_parts)
        _ENV = env
    return _ENV


def verdict_parts(verdict: str) -> tuple[str, str]:
    """A verdict's word (agrees, differs, partly, ...) and the details after it, so that a page shows the
    one and puts the other below it rather than a paragraph in bold."""
    cut = min((i for i in (verdict.find(":"), verdict.find(";")) if i >= 0), default=-1)
    if cut < 0:
        return verdict, ""
    return verdict[:cut].strip(), verdict[cut + 1:].strip()


def _summary_row(d: RunData) -> dict[str, Any]:
    s = d.summary
    fe = s.final_eval
    return {
        "label": d.label, "run_ref": run_label(d.run), "id": d.run.id, "name": d.run.name, "uuid": d.run.uuid, "strategy": d.run.strategy,
        "workload": d.run.workload, "world_size": d.run.world_size, "status": d.run.shown_status,
        "error": d.run.error, "steps": s.steps_recorded, "ranks": s.ranks_recorded, "step_s": s.mean_step_s,
        "throughput": s.throughput_samples_per_s, "speedup": s.speedup_vs_single, "efficiency": s.scaling_efficiency,
        "baseline": s.baseline_run_id, "overlap": (s.comm or {}).get("overlap_fraction"),
        "comm_s": (s.comm or {}).get("comm_s"), "exposed_s": (s.comm or {}).get("exposed_s"),
        "bytes_per_step": (s.comm or {}).get("bytes_sent_per_step"),
        "metric_name": fe["metric_name"] if fe else None, "metric": fe["metric"] if fe else None,
        "final_loss": s.final_loss, "train_wall_s": d.train_wall_s, "duration_s": s.run.get("duration_s"),
        "created": d.run.created_at, "mean_staleness": d.mean_staleness,
    }


# ---------------------------------------------------------------------------- pages
def runs_report(store: Store, runs: list[Run], title: str) -> str:
    """One page comparing runs: configs, summary table, breakdowns, memory, metric curves, PS views, notes."""
    data = [collect(store, r) for r in runs]
    rows = [_summary_row(d) for d in data]

    series: dict[str, dict[int, float]] = {}
    for d in data:
        if d.summary.scaling_efficiency is not None:
            series.setdefault(d.run.strategy, {}).setdefault(d.run.world_size, d.summary.scaling_efficiency)

    ps = [d for d in data if d.is_ps]
    stale_uri, share_uri = _fig_ps(ps) if ps else (None, None)
    context = {
        "title": title, "version": __version__, "store": str(store.path),
        "runs": [{"label": d.label, "run": d.run, "row": row,
                  "config_json": json.dumps(d.run.config, indent=2, sort_keys=True),
                  "environment_json": json.dumps(d.run.environment, indent=2, sort_keys=True)}
                 for d, row in zip(data, rows)],
        "config_rows": _config_rows(runs),
        "rows": rows,
        "phases": [p.removesuffix("_s") for p in PHASES],
        "breakdowns": [{"label": d.label, "ms": [d.summary.breakdown_mean_s.get(p) for p in PHASES],
                        "fractions": [d.summary.breakdown_fraction.get(p) for p in PHASES]} for d in data],
        "notes": emulation_scale_notes(runs) + _merge_notes((d.label, n) for d in data for n in d.summary.notes),
        "fig_throughput": _fig_throughput(data),
        "fig_scaling": _fig_scaling(series),
        "fig_breakdown": _fig_breakdown(data),
        "fig_rank_breakdowns": [{"label": d.label, "uri": _fig_rank_breakdown(d)} for d in data if d.rank_breakdown],
        "fig_timelines": [{"label": d.label, "uri": d.timeline} for d in data if d.timeline],
        "fig_steps": figures.step_time_distribution({d.label: d.step_times_s for d in data}),
        "fig_memory": _fig_memory(data, "memory by category per rank"),
        "memory": [{"label": d.label, "ranks": sorted(d.summary.memory_bytes_by_rank.items()),
                    "categories": _memory_categories(d.summary.memory_bytes_by_rank)}
                   for d in data if d.summary.memory_bytes_by_rank],
        "fig_curves": _fig_curves(data),
        "ps": [{"label": d.label, "servers": d.servers, "mean_staleness": d.mean_staleness,
                "updates": len(d.staleness)} for d in ps],
        "fig_staleness": stale_uri, "fig_server_share": share_uri,
    }
    return _env().get_template("runs.html").render(**context)


def study_report(store: Store, title: str, cells: list[dict], headlines: list[dict] | None, decisions: list[str],
                 notes: list[str]) -> str:
    """The study page: headline comparison with the main study, all cells, figures, decisions.

    A cell is a dict with its key, run, labels and (as the study runner passes
    it) the summary it already computed; a cell without one is summarised
    here. `headlines=None`: a study that checks no published claims (a sweep),
    whose page has no headline section.
    """
    data = [collect(store, cell["run"], label=str(cell["key"]), summary=cell.get("summary")) for cell in cells]

    has_target = any(c.get("labels", {}).get("target_metric") is not None for c in cells)
    metric_names = {d.metric_name for d in data if d.metric_name}
    table = []
    for cell, d in zip(cells, data):
        labels = cell.get("labels", {})
        target = labels.get("target_metric")
        row = _summary_row(d)
        row.update(key=str(cell["key"]), network=labels.get("network"), workers=labels.get("workers"),
                   part=labels.get("part"), cell_world_size=labels.get("world_size", d.run.world_size),
                   strategy=labels.get("strategy", d.run.strategy), target=target,
                   time_to_target=d.time_to_target(float(target)) if target is not None else None)
        if cell.get("row") is not None:
            row.update(_cell_row_figures(cell["row"], int(row["cell_world_size"])))
        if labels.get("part") == "timing":  # a step-time cell stops after a few steps: no accuracy shown
            row.update(metric=None, time_to_target=None)
        table.append(row)

    accuracy = [(c, d) for c, d in zip(cells, data) if c.get("labels", {}).get("part", "accuracy") == "accuracy"]
    memory = [d for c, d in zip(cells, data) if c.get("labels", {}).get("part") == "memory"]

    series = _study_scaling_series(cells, data)

    groups: dict[tuple[str, str], list[tuple[dict, RunData]]] = {}
    for c, d in accuracy:
        lab = c.get("labels", {})
        groups.setdefault((str(lab.get("network", "")), str(lab.get("workers", ""))), []).append((c, d))
    curve_figs = []
    for (network, workers), members in groups.items():
        sizes_per_strategy: dict[str, set[int]] = {}
        for c, d in members:
            lab = c.get("labels", {})
            sizes_per_strategy.setdefault(str(lab.get("strategy", d.run.strategy)), set()).add(
                int(lab.get("world_size", d.run.world_size)))
        names = []
        for c, d in members:
            lab = c.get("labels", {})
            strategy = str(lab.get("strategy", d.run.strategy))
            ws = int(lab.get("world_size", d.run.world_size))
            names.append(strategy if len(sizes_per_strategy[strategy]) == 1 else f"{strategy} w{ws}")
        line_labels, line_groups = [], {}
        for (c, d), label in zip(members, _distinct_line_names(members, names)):
            lab = c.get("labels", {})
            line_labels.append(f"{label} seed {lab['seed']}" if lab.get("seed") else label)
            line_groups[line_labels[-1]] = label  # a cell's seeds: one colour, one legend entry
        targets = {c.get("labels", {}).get("target_metric") for c, _ in members} - {None}
        group_title = " · ".join(x for x in (f"network {network}" if network else "",
                                             f"{workers} workers" if workers else "") if x)
        for fig in _fig_curves([d for _, d in members], title=group_title or None,
                               target=float(next(iter(targets))) if len(targets) == 1 else None, labels=line_labels,
                               groups=line_groups):
            curve_figs.append({**fig, "group": group_title})

    ps = [d for d in data if d.is_ps]
    # Seed 0 of each cell: the other seeds' staleness and server load look the same (the cell table has them)
    ps_figures = [d for c, d in zip(cells, data) if d.is_ps and not c.get("labels", {}).get("seed")]
    stale_uri, share_uri = _fig_ps(ps_figures) if ps_figures else (None, None)
    all_notes = list(notes) + [n for n in _merge_notes(("", n) for d in data for n in d.summary.notes)
                               if n not in notes]
    context = {
        "title": title, "version": __version__, "store": str(store.path),
        "notes": all_notes, "headlines": headlines, "decisions": decisions, "cells": table,
        "has_target": has_target, "any_ps": bool(ps),
        "metric_header": f"final {next(iter(metric_names))}" if len(metric_names) == 1 else "final metric",
        # Memory cells time nothing comparable (the cell table gives them no speedup): not in the chart.
        "fig_throughput": figures.throughput_speedup(*zip(*[(r["key"], r["throughput"], r["speedup"], r["strategy"])
                                                            for r in table if r["part"] != "memory"]))
        if any(r["part"] != "memory" for r in table) else None,
        "fig_scaling": _fig_scaling(series),
        "fig_memory": _fig_memory(memory, "memory by category per rank (memory cells)") if memory else [],
        "fig_curves": curve_figs,
        "fig_staleness": stale_uri, "fig_server_share": share_uri,
        # memory cells time nothing comparable: their seconds-long GPT steps made the others slivers
        "fig_breakdown": _fig_breakdown([d for c, d in zip(cells, data)
                                         if c.get("labels", {}).get("part") != "memory"]),
    }
    return _env().get_template("study.html").render(**context)


def _cell_row_figures(row: Any, world_size: int) -> dict[str, Any]:
    """A study's cell-table row (studies/base.py CellRow) as the page's columns: the effective step and
    throughput, the speedup over the study's one-process cell, wall time and time to target, exactly as
    the terminal's table prints them."""
    return {"step_s": row.step_s, "throughput": row.throughput, "speedup": row.speedup,
            "efficiency": row.speedup / world_size if row.speedup is not None else None,
            "train_wall_s": row.wall_s, "time_to_target": row.time_to_target_s, "mean_staleness": row.staleness}


def _study_scaling_series(cells: list[dict], data: list[RunData]) -> dict[str, dict[int, float]]:
    """Scaling efficiency per strategy · network · workers, by world size, on the effective clock.

    Where the study has a one-process cell of the same workload (and global batch), a cell's efficiency
    is that cell's effective step over its own, over its world size, and the one-process cell is each
    series' first point (1.0 by definition); the summary's wall-clock figure would charge the sharing of
    cores to the strategy once ranks outnumber them. Otherwise the summary's figure is used.
    """
    def workload_of(d: RunData) -> tuple[Any, Any]:
        workload = d.run.config.get("workload", {})
        return workload.get("name"), workload.get("batch_size")

    ones = {workload_of(d): d for d in data if d.run.world_size == 1 and d.summary.effective_step_s}
    series: dict[str, dict[int, float]] = {}
    for c, d in sorted(zip(cells, data), key=lambda cd: cd[0].get("labels", {}).get("part") != "accuracy"):
        lab = c.get("labels", {})
        world = int(lab.get("world_size", d.run.world_size))
        if world == 1:
            continue
        name = " · ".join(str(lab[k]) for k in ("strategy", "network", "workers") if lab.get(k) is not None)
        one = ones.get(workload_of(d))
        if one is not None and d.summary.effective_step_s:
            points = series.setdefault(name or d.run.strategy, {1: 1.0})
            points.setdefault(world, one.summary.effective_step_s / d.summary.effective_step_s / world)
        elif d.summary.scaling_efficiency is not None:
            series.setdefault(name or d.run.strategy, {}).setdefault(world, d.summary.scaling_efficiency)
    return series


def _distinct_line_names(members: list[tuple[dict, RunData]], names: list[str]) -> list[str]:
    """Cells that the strategy name (and world size) cannot tell apart, such as a sweep's cells that
    differ in a knob, are named by their group (the cell key without the seed), so that no line
    hides another."""
    groups_per_name: dict[str, set[str]] = {}
    for (c, _), name in zip(members, names):
        groups_per_name.setdefault(name, set()).add(str(c.get("labels", {}).get("group", c["key"])))
    return [name if len(groups_per_name[name]) == 1 else str(c.get("labels", {}).get("group", c["key"]))
            for (c, _), name in zip(members, names)]


def write_report(html: str, path: Path, what: str = "--output") -> None:
    """Write the page whole or not at all (store.atomic_output); OutputError names `what` and the path."""
    with atomic_output(path, what=what) as f:
        f.write(html)
