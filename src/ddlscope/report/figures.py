"""Report figures: small functions from plain data to PNG data URIs.

Every function takes lists and dicts (never the store), draws one figure with
matplotlib's Agg backend, closes it, and returns `data:image/png;base64,...`,
or None when there is nothing to draw. The same data gives the same bytes: a
fixed style (no user matplotlibrc), fixed colours and no timestamp metadata.
"""

from __future__ import annotations

import base64
import functools
import io
import math
from collections.abc import Mapping, Sequence
from typing import Any, Callable, ParamSpec, TypeVar

import matplotlib

matplotlib.use("Agg")  # before pyplot: no display, no GUI toolkit

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import (FixedLocator, FuncFormatter, LogLocator, MaxNLocator, NullLocator,  # noqa: E402
                               PercentFormatter)

PHASES = ("data_s", "forward_s", "backward_s", "comm_wait_s", "optimizer_s")
PHASE_COLORS = {
    "data_s": "#9e9e9e", "forward_s": "#4c78a8", "backward_s": "#f58518",
    "comm_wait_s": "#e45756", "optimizer_s": "#54a24b",
}
MEMORY_CATEGORIES = ("parameters", "gradients", "optimizer", "activations")
MEMORY_COLORS = {"parameters": "#4c78a8", "gradients": "#f58518", "optimizer": "#54a24b", "activations": "#b279a2"}
PALETTE = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#eeca3b", "#9d755d",
           "#ff9da6", "#bab0ac")
DPI = 96
P = ParamSpec("P")
R = TypeVar("R")

_STYLE: dict[str, Any] = {
    # No offset on axes: a perplexity axis read "1e-6+2.758895e1", its ticks the differences from it.
    "axes.formatter.useoffset": False,
    "font.family": "DejaVu Sans",
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.labelsize": 9,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "axes.axisbelow": True,
    "grid.color": "#e3e3e3",
    "grid.linewidth": 0.8,
    "legend.fontsize": 8,
    "legend.frameon": False,
    "xtick.labelsize": 8,
    "ytick.labelsize": 8,
    "figure.facecolor": "white",
    "savefig.facecolor": "white",
    "path.simplify": False,
    "svg.hashsalt": "ddlscope",
}


def color(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def _render(fig: Any) -> str:
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None}, bbox_inches="tight", pad_inches=0.08)
    finally:
        plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _figure(width: float, height: float, ncols: int = 1, nrows: int = 1, **kwargs: Any) -> tuple[Any, Any]:
    return plt.subplots(nrows, ncols, figsize=(width, height), squeeze=False, **kwargs)


def _styled(fn: Callable[P, R]) -> Callable[P, R]:
    """Draw under the fixed style (artists read rcParams when they are created, so all of the body)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with matplotlib.rc_context():
            matplotlib.rcdefaults()  # ignore any user matplotlibrc: same data, same image
            matplotlib.rcParams.update(_STYLE)
            return fn(*args, **kwargs)

    return wrapper


def _num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else math.nan


def _category_ticks(ax: Any, labels: Sequence[str]) -> None:
    ax.set_xticks(range(len(labels)))
    long = len(labels) > 4 or max((len(s) for s in labels), default=0) > 14
    ax.set_xticklabels([_shorten(s, 36) for s in labels], rotation=30 if long else 0, ha="right" if long else "center")
    ax.grid(False, axis="x")


def _shorten(s: str, n: int = 28) -> str:
    """A label cut to n characters, with `$` escaped so user text never turns into mathtext."""
    s = str(s) if len(str(s)) <= n else str(s)[: n - 1] + "…"
    return s.replace("$", r"\$")


def _width(n: int, per: float = 0.55, lo: float = 5.0, hi: float = 12.0) -> float:
    return max(lo, min(hi, 1.6 + per * n))


def _fmt(v: float) -> str:
    if not math.isfinite(v):
        return ""
    if abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:.2f}" if abs(v) >= 1 else f"{v:.3g}"


def _bytes_axis(axis: Any, vmax: float) -> None:
    """Ticks at round numbers of the binary unit that fits the largest value (KiB, MiB, GiB)."""
    unit = 1.0
    while vmax / unit >= 1024 and unit < 1024**3:
        unit *= 1024
    ticks = MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]).tick_values(0, max(vmax, 1.0) / unit)
    axis.set_major_locator(FixedLocator([t * unit for t in ticks if t >= 0]))
    axis.set_major_formatter(_bytes_formatter())


def _bytes_formatter() -> FuncFormatter:
    def fmt(v: float, _pos: int) -> str:
        for unit in ("B", "KiB", "MiB", "GiB"):
            if abs(v) < 1024 or unit == "GiB":
                return f"{v:.0f} {unit}" if unit == "B" else f"{v:.4g} {unit}"
            v /= 1024
        return f"{v:.3g} GiB"

    return FuncFormatter(fmt)


# ---------------------------------------------------------------------------- throughput / speedup
@_styled
def throughput_speedup(labels: Sequence[str], throughput: Sequence[float | None],
                       speedup: Sequence[float | None], groups: Sequence[str] | None = None) -> str | None:
    """Two bar charts side by side: samples/s per run, and speedup vs single (1x line).

    Bars of the same group (e.g. strategy) share a colour; without groups every bar has its own.
    """
    tp = [_num(v) for v in throughput]
    sp = [_num(v) for v in speedup]
    if not labels or all(math.isnan(v) for v in tp):
        return None
    has_speedup = not all(math.isnan(v) for v in sp)
    fig, axes = _figure(_width(len(labels), 0.5, 6, 12) * (1.6 if has_speedup else 1), 3.2,
                        ncols=2 if has_speedup else 1)
    panels = [(axes[0][0], tp, "throughput (samples/s)", "throughput")]
    if has_speedup:
        panels.append((axes[0][1], sp, "speedup vs single (x)", "speedup vs single"))
    keys = list(groups) if groups is not None else list(range(len(labels)))
    order = {k: i for i, k in enumerate(dict.fromkeys(keys))}
    colors = [color(order[k]) for k in keys]
    for ax, values, ylabel, title in panels:
        bars = ax.bar(range(len(labels)), [0 if math.isnan(v) else v for v in values], color=colors, width=0.7)
        for bar, v in zip(bars, values):
            if math.isnan(v):  # a figure that does not apply to this cell: no bar, no label
                continue
            ax.annotate(_fmt(v) + ("x" if title.startswith("speedup") else ""),
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=7, xytext=(0, 2), textcoords="offset points")
        if title.startswith("speedup"):
            ax.axhline(1.0, color="#555", lw=0.9, ls="--")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.margins(y=0.15)
        _category_ticks(ax, labels)
    return _render(fig)


@_styled
def scaling_efficiency(series: Mapping[str, Sequence[tuple[int, float]]]) -> str | None:
    """Scaling efficiency (speedup / world size) vs world size, one line per series; 1.0 is ideal."""
    series = {k: sorted((int(w), _num(e)) for w, e in pts if not math.isnan(_num(e))) for k, pts in series.items()}
    series = {k: v for k, v in series.items() if v}
    if not series:
        return None
    fig, axes = _figure(6.4, 3.4)
    ax = axes[0][0]
    sizes: set[int] = set()
    for i, (name, pts) in enumerate(sorted(series.items())):
        xs, ys = zip(*pts)
        sizes.update(xs)
        ax.plot(xs, ys, marker="o", color=color(i), label=_shorten(name, 40))
    ax.axhline(1.0, color="#555", lw=0.9, ls="--", label="ideal")
    ax.set_xticks(sorted(sizes))
    ax.set_xlabel("world size (ranks)")
    ax.set_ylabel("scaling efficiency")
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_ylim(bottom=0)
    ax.set_title("scaling efficiency vs world size")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _render(fig)


# ---------------------------------------------------------------------------- time breakdown
@_styled
def breakdown_bars(labels: Sequence[str], breakdowns: Sequence[Mapping[str, float]],
                   title: str = "time breakdown (mean per rank-step)") -> str | None:
    """Stacked bars of mean time per step in each phase (ms): one bar per label (a run, or a rank)."""
    if not labels or not any(breakdowns):
        return None
    fig, axes = _figure(_width(len(labels), 0.5, 5.5, 12), 3.3)
    ax = axes[0][0]
    bottom = [0.0] * len(labels)
    for phase in PHASES:
        values = [_num(b.get(phase)) * 1e3 if b else 0.0 for b in breakdowns]
        values = [0.0 if math.isnan(v) else v for v in values]
        ax.bar(range(len(labels)), values, bottom=bottom, color=PHASE_COLORS[phase], width=0.65,
               label=phase.removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, values)]
    for i, total in enumerate(bottom):
        ax.annotate(f"{total:.3g} ms", (i, total), ha="center", va="bottom", fontsize=7, xytext=(0, 2),
                    textcoords="offset points")
    ax.set_ylabel("ms per step")
    ax.set_title(_shorten(title, 90))
    ax.margins(y=0.12)
    _category_ticks(ax, labels)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _render(fig)


@_styled
def step_time_distribution(step_times_s: Mapping[str, Sequence[float]]) -> str | None:
    """Box plot of step times (ms) per run; whiskers 5-95th percentile, outliers as dots."""
    data = {k: [v * 1e3 for v in vals if not math.isnan(_num(v))] for k, vals in step_times_s.items()}
    data = {k: v for k, v in data.items() if v}
    if not data:
        return None
    labels = list(data)
    fig, axes = _figure(_width(len(labels), 0.6, 5.5, 12), 3.3)
    ax = axes[0][0]
    _boxes(ax, [data[k] for k in labels], [color(i) for i in range(len(labels))], 0.55, (5, 95), 0.75,
           flierprops={"marker": ".", "markersize": 3, "alpha": 0.6})
    values = [v for vs in data.values() for v in vs]
    if min(values) > 0 and max(values) / min(values) > 50:
        ax.set_yscale("log")
    ax.set_ylabel("step time (ms, slowest rank)")
    ax.set_title("step-time distribution (steady-state steps)")
    _category_ticks(ax, labels)
    return _render(fig)


def _boxes(ax: Any, values: Sequence[Sequence[float]], colours: Sequence[str], width: float,
           whis: tuple[float, float], alpha: float, **kwargs: Any) -> None:
    """Box plots at 0, 1, ... with a black median, filled with the given colours."""
    box = ax.boxplot(values, positions=range(len(values)), widths=width, whis=whis, patch_artist=True,
                     medianprops={"color": "black"}, **kwargs)
    for patch, colour in zip(box["boxes"], colours):
        patch.set_facecolor(colour)
        patch.set_alpha(alpha)


# ---------------------------------------------------------------------------- memory
@_styled
def memory_bars(labels: Sequence[str], memory: Sequence[Mapping[str, int]],
                title: str = "memory by category per rank") -> str | None:
    """Stacked bars of tensor bytes by category per (run, rank); peak RSS as a marker on a right axis."""
    if not labels or not any(memory):
        return None
    fig, axes = _figure(_width(len(labels), 0.45, 6, 13), 3.5)
    ax = axes[0][0]
    bottom = [0.0] * len(labels)
    for cat in MEMORY_CATEGORIES:
        values = [float(m.get(cat, 0) or 0) for m in memory]
        if not any(values):
            continue
        ax.bar(range(len(labels)), values, bottom=bottom, color=MEMORY_COLORS[cat], width=0.65, label=cat)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylim(0, max(bottom) * 1.08 or 1.0)
    _bytes_axis(ax.yaxis, max(bottom) * 1.08)
    ax.set_ylabel("tensor bytes")
    ax.set_title(_shorten(title, 90))
    _category_ticks(ax, labels)
    handles, names = ax.get_legend_handles_labels()
    rss = [_num(m.get("peak_rss")) for m in memory]
    if not all(math.isnan(v) for v in rss):
        ax2 = ax.twinx()
        ax2.grid(False)
        ax2.spines["right"].set_visible(True)
        (line,) = ax2.plot(range(len(labels)), rss, linestyle="none", marker="D", color="black", markersize=5,
                           label="peak RSS (right axis)")
        top = max(v for v in rss if not math.isnan(v)) * 1.15 or 1.0
        ax2.set_ylim(0, top)
        _bytes_axis(ax2.yaxis, top)
        ax2.set_ylabel("peak RSS (process)")
        handles.append(line)
        names.append(line.get_label())
    fig.tight_layout()
    fig.legend(handles, names, loc="upper left", bbox_to_anchor=(1.0, 0.95))
    return _render(fig)


# ---------------------------------------------------------------------------- metric curves
@_styled
def metric_curves(curves: Mapping[str, Sequence[Mapping[str, Any]]], metric_name: str = "metric",
                  title: str | None = None, target: float | None = None,
                  groups: Mapping[str, str] | None = None) -> str | None:
    """The eval metric vs wall time (s) and vs samples seen, one line per run.

    Each curve is a list of points with keys `wall_s`, `samples_seen`, `metric`.
    `groups` maps a curve to its group (e.g. one cell's seeds): a group's lines
    share a colour and one legend entry, "NAME (N runs)", the first in bold.
    """
    curves = {k: [p for p in pts if not math.isnan(_num(p.get("metric")))] for k, pts in curves.items()}
    curves = {k: v for k, v in curves.items() if v}
    if not curves:
        return None
    group_of = {name: (groups or {}).get(name, name) for name in curves}
    members = {g: [n for n in curves if group_of[n] == g] for g in dict.fromkeys(group_of.values())}
    colour = {g: color(i) for i, g in enumerate(members)}
    fig, axes = _figure(10, 3.4, ncols=2, sharey=True)
    for ax, key, xlabel in ((axes[0][0], "wall_s", "training wall time (s)"),
                            (axes[0][1], "samples_seen", "samples seen")):
        for name, pts in curves.items():
            group = members[group_of[name]]
            first = name == group[0]
            label = (group_of[name] if len(group) == 1 else f"{group_of[name]} ({len(group)} runs)") if first \
                else None
            xs = [_num(p.get(key)) for p in pts]
            ax.plot(xs, [_num(p["metric"]) for p in pts], marker="o", markersize=3 if first else 2,
                    lw=1.5 if first else 0.8, alpha=1.0 if first else 0.55, color=colour[group_of[name]],
                    label=_shorten(label, 40) if label else None)
        if target is not None:
            ax.axhline(target, color="#555", lw=0.9, ls="--", label=f"target {target:g}")
        ax.set_xlabel(xlabel)
        ax.xaxis.set_major_locator(MaxNLocator(6))
    name = _shorten(metric_name, 40)
    axes[0][0].set_ylabel(name)
    axes[0][0].set_title(f"{name} vs wall time")
    axes[0][1].set_title(f"{name} vs samples seen")
    axes[0][1].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if title:
        fig.suptitle(_shorten(title, 90), fontsize=10)
    return _render(fig)


# ---------------------------------------------------------------------------- parameter servers
@_styled
def staleness_histograms(staleness: Mapping[str, Sequence[int]]) -> str | None:
    """One histogram per PS run: the share of applied updates by staleness (versions behind)."""
    data = {k: [int(v) for v in vals if v is not None] for k, vals in staleness.items()}
    data = {k: v for k, v in data.items() if v}
    if not data:
        return None
    n = len(data)
    ncols = min(n, 3)
    nrows = math.ceil(n / ncols)
    fig, axes = _figure(3.4 * ncols, 2.7 * nrows, ncols=ncols, nrows=nrows)
    for idx in range(nrows * ncols):
        ax = axes[idx // ncols][idx % ncols]
        if idx >= n:
            ax.set_visible(False)
            continue
        name, vals = list(data.items())[idx]
        top = max(vals)
        counts = [0] * (top + 1)
        for v in vals:
            counts[v] += 1
        ax.bar(range(top + 1), [c / len(vals) for c in counts], color=color(idx), width=0.8)
        ax.set_xlim(-0.6, max(top, 3) + 0.6)
        ax.set_ylim(0, 1.0)
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("staleness (versions behind)")
        if idx % ncols == 0:
            ax.set_ylabel("share of updates")
        ax.set_title(f"{_shorten(name, 32)}\nmean {sum(vals) / len(vals):.2f}, max {top}, n={len(vals)}",
                     fontsize=8.5)
        ax.grid(False, axis="x")
    fig.tight_layout()
    return _render(fig)


@_styled
def server_update_times(labels: Sequence[str], queue_s: Sequence[float | None], apply_s: Sequence[float | None],
                        busy_share: Sequence[float | None]) -> str | None:
    """Horizontal stacked bars, one per server: the mean milliseconds an update waited in the server's
    queue and then took to apply, each label with the share of the server's wall time spent applying.

    In milliseconds rather than as a share of wall time: on a CPU cluster a server applies in ~1% of its
    time, and a chart of shares read "1%" on every bar; the queue beside the apply says whether the
    workers wait on the server (a queue much longer than an apply) or not."""
    queued, applying = [_num(v) * 1e3 for v in queue_s], [_num(v) * 1e3 for v in apply_s]
    if not labels or all(math.isnan(v) for v in applying):
        return None
    fig, axes = _figure(7.5, max(1.6, 0.45 * len(labels) + 0.9))
    ax = axes[0][0]
    ys = list(range(len(labels)))
    left = [0.0 if math.isnan(v) else v for v in queued]
    ax.barh(ys, left, height=0.6, color=PALETTE[1], label="queued before applying")
    bars = ax.barh(ys, [0.0 if math.isnan(v) else v for v in applying], left=left, height=0.6, color=PALETTE[0],
                   label="applying")
    for bar, q, a in zip(bars, queued, applying):
        if not math.isnan(a):
            ax.annotate(f"{(0 if math.isnan(q) else q) + a:.3g} ms", (bar.get_x() + bar.get_width(),
                        bar.get_y() + bar.get_height() / 2), va="center", ha="left", fontsize=7, xytext=(3, 0),
                        textcoords="offset points")
    shares = [_num(v) for v in busy_share]
    ax.set_yticks(ys)
    ax.set_yticklabels([_shorten(s, 40) + ("" if math.isnan(b) else f" (busy {b * 100:.2g}%)")
                        for s, b in zip(labels, shares)])
    ax.invert_yaxis()
    ax.set_xlim(0, max(q + a for q, a in zip(left, [0.0 if math.isnan(v) else v for v in applying])) * 1.2 or 1.0)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("ms per update (mean)")
    ax.set_title("parameter servers: time per update")
    ax.grid(False, axis="y")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _render(fig)


@_styled
def rank_timeline(steps: Mapping[int, Sequence[tuple[float, float]]],
                  away: Sequence[tuple[int, float, float]], title: str = "") -> str | None:
    """Each rank's steps over wall time (one bar per step), and the spans a worker was away
    (preempted): the survivors' bars go on through them."""
    ranks = sorted(steps)
    if not ranks:
        return None
    fig, axes = _figure(9.0, 0.5 + 0.45 * len(ranks))
    ax = axes[0][0]
    for row, rank in enumerate(ranks):
        ax.broken_barh(list(steps[rank]), (row - 0.35, 0.7), facecolors=color(0), linewidth=0)
    for rank, begin_s, end_s in away:
        if rank in steps:
            row = ranks.index(rank)
            ax.broken_barh([(begin_s, end_s - begin_s)], (row - 0.45, 0.9), facecolors="none",
                           edgecolors=color(3), hatch="///", linewidth=1.0)
            ax.annotate(f"preempted {end_s - begin_s:.1f} s", (begin_s, row + 0.42), fontsize=7.5, color=color(3))
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.set_ylim(-0.6, len(ranks) - 0.4)
    ax.invert_yaxis()
    ax.set_xlabel("wall time since the first rank started training (s)")
    if title:
        ax.set_title(_shorten(title, 80), fontsize=9)
    fig.tight_layout()
    return _render(fig)


# ---------------------------------------------------------------------------- many ranks
@_styled
def rank_distribution(per_rank: Mapping[str, Mapping[int, float]], title: str, ylabel: str,
                      scale: float = 1.0, colors: Mapping[str, str] | None = None, bytes_axis: bool = False) -> str | None:
    """One box per series (a phase, a memory category) over the ranks' values: the quartiles, whiskers
    from the smallest to the largest rank, each rank a faint dot; the largest rank is named. What a
    run of hundreds of ranks shows instead of a bar per rank."""
    series = {k: {r: _num(v) * scale for r, v in vals.items() if not math.isnan(_num(v))} for k, vals in per_rank.items()}
    series = {k: v for k, v in series.items() if v}
    if not series:
        return None
    names = list(series)
    fig, axes = _figure(_width(len(names), 1.0, 5.5, 10), 3.4)
    ax = axes[0][0]
    values = [list(series[k].values()) for k in names]
    _boxes(ax, values, [(colors or {}).get(name, color(i)) for i, name in enumerate(names)], 0.5, (0, 100), 0.55,
           showfliers=False)
    for i, name in enumerate(names):
        ranks = sorted(series[name])
        # Dots spread across the box's width in rank order: the same rank is at the same place in every box.
        xs = [i - 0.22 + 0.44 * j / max(len(ranks) - 1, 1) for j in range(len(ranks))]
        ax.scatter(xs, [series[name][r] for r in ranks], s=2, color="black", alpha=0.25, linewidths=0)
        worst = max(ranks, key=lambda r: series[name][r])
        ax.annotate(f"max: rank {worst}", (i, series[name][worst]), ha="center", va="bottom", fontsize=7,
                    xytext=(0, 3), textcoords="offset points")
    tops = [max(v) for v in values if max(v) > 0]
    if tops and max(tops) / min(tops) > 50:  # peak RSS beside parameter bytes: a log axis shows both
        ax.set_yscale("log")
        if bytes_axis:  # ticks at 1, 4, 16, 64, 256 of each binary unit
            ax.yaxis.set_major_locator(LogLocator(base=1024, subs=(1.0, 4.0, 16.0, 64.0, 256.0)))
            ax.yaxis.set_minor_locator(NullLocator())
            ax.yaxis.set_major_formatter(_bytes_formatter())
    elif bytes_axis:
        top = max(max(v) for v in values) * 1.12
        ax.set_ylim(0, top or 1.0)
        _bytes_axis(ax.yaxis, top or 1.0)
    ax.set_ylabel(ylabel)
    ax.set_title(_shorten(title, 90))
    ax.margins(y=0.12)
    _category_ticks(ax, [n.removesuffix("_s") for n in names])
    return _render(fig)
