"""torch.profiler (Kineto chrome-trace JSON) traces of any job -> per rank and step: compute,
communication, memory copies, idle time and compute-communication overlap (`ddlscope import-trace`,
docs/import-trace.md).

Pure Python and numpy (no torch): a trace of a job on another machine is read here as it was written.

Steps are the trace's `ProfilerStep#N` annotations. Two timelines:

- a trace with device activity (events of category kernel, gpu_memcpy or gpu_memset) is read on the
  device, as Holistic Trace Analysis (HTA) reads it: a kernel belongs to the step whose
  ProfilerStep#N held its launch (the runtime call with the same `correlation`); the step's window
  runs from its first kernel's start to the next step's first kernel's start (the last step: to the
  end of the last kernel). Kernels are classified by name with HTA's rules: communication
  `^nccl.*Kernel`, memory `^Memcpy|^Memset|^dma` (and what HTA counts as neither compute nor
  communication: other names holding Memcpy or Memset, or ending in Sync), compute the rest.
- a trace without (a CPU job) is read on the host: the window is ProfilerStep#N itself; communication
  is time inside a collective (an event named `c10d::...`, `gloo:...`, `nccl:...` or
  `record_param_comms`) on any thread; memory copies are time in `aten::copy_`; compute is time in any
  other `cpu_op` on any thread (a parent op's time inside a collective or a copy is not compute).

On either, each instant of a step is one of: compute (something computes), exposed communication
(communication and no compute), exposed memory copy (a copy and neither), idle (nothing).
Compute-communication overlap is the time communication and compute run together; its fraction of
the communication time is HTA's comm-comp overlap. Compute is split by where it was issued: inside
`autograd::engine::evaluate_function` (backward), an `Optimizer.step#` / `Optimizer.zero_grad#`
annotation (optimizer), an `enumerate(DataLoader)` annotation (data), else forward.

Interval sets are (starts, ends) numpy arrays, sorted and disjoint; a boolean combination of sets is
taken over the elementary segments between all their boundaries (`combine`).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from ddlscope.analysis.trace_merge import iter_trace_events

__all__ = ["RankTrace", "StepBreakdown", "TraceImportError", "combine", "length", "load_rank_traces",
           "merged", "read_trace", "trace_files"]

# HTA's kernel classes (hta/utils/utils.py), so that both read a GPU trace alike.
COMM_KERNEL = re.compile(r"^nccl.*Kernel")
MEMORY_KERNEL = re.compile(r"(^Memcpy)|(^Memset)|(^dma)")
NOT_COMPUTE_KERNEL = re.compile(r"(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)")
DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
# The host's collectives: c10d's ops, the backends' own ranges (gloo:all_reduce on gloo's thread), and
# the profiler's record of a collective's parameters.
HOST_COMM = re.compile(r"^(c10d::|gloo:|nccl:|record_param_comms$)")
HOST_COPY = frozenset({"aten::copy_"})
PROFILER_STEP = re.compile(r"^ProfilerStep#(\d+)$")
BACKWARD = "autograd::engine::evaluate_function"
OPTIMIZER = ("Optimizer.step#", "Optimizer.zero_grad#")
DATA = "enumerate(DataLoader)"
LABELS = ("backward", "forward", "optimizer", "data")  # compute's parts, in the order an instant is given one
RANK_IN_NAME = re.compile(r"rank[-_.]?(\d+)", re.IGNORECASE)
TRACE_SUFFIXES = (".json", ".json.gz")

Intervals = tuple[np.ndarray, np.ndarray]
EMPTY: Intervals = (np.empty(0), np.empty(0))


class TraceImportError(ValueError):
    """A trace folder that cannot be imported: one line saying which file and why."""


# ---------------------------------------------------------------------------- interval sets
def merged(starts: Iterable[float], ends: Iterable[float]) -> Intervals:
    """The union of intervals [start, end) as a sorted, disjoint set (empty intervals dropped)."""
    s, e = np.asarray(starts, dtype=float), np.asarray(ends, dtype=float)
    keep = e > s
    s, e = s[keep], e[keep]
    if not len(s):
        return EMPTY
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    reach = np.maximum.accumulate(e)
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > reach[:-1]
    return s[new], np.maximum.reduceat(e, np.flatnonzero(new))


def _covered(points: np.ndarray, iv: Intervals) -> np.ndarray:
    """Which points lie inside the set."""
    if not len(iv[0]):
        return np.zeros(len(points), dtype=bool)
    idx = np.searchsorted(iv[0], points, side="right") - 1
    inside = idx >= 0
    out = np.zeros(len(points), dtype=bool)
    out[inside] = points[inside] < iv[1][idx[inside]]
    return out


def combine(rule: Callable[..., np.ndarray], *sets: Intervals, window: tuple[float, float] | None = None) -> Intervals:
    """The set where `rule(*memberships)` holds (numpy booleans, one per set), within `window` if given."""
    edges = np.unique(np.concatenate([np.concatenate(s) for s in sets] + ([np.asarray(window, float)] if window else [])))
    if window:
        edges = edges[(edges >= window[0]) & (edges <= window[1])]
    if len(edges) < 2:
        return EMPTY
    mids = (edges[:-1] + edges[1:]) / 2
    keep = rule(*(_covered(mids, s) for s in sets))
    return merged(edges[:-1][keep], edges[1:][keep])


def length(iv: Intervals) -> float:
    return float((iv[1] - iv[0]).sum())


def _union(sets: Iterable[Intervals]) -> Intervals:
    sets = list(sets)
    if not sets:
        return EMPTY
    return merged(np.concatenate([s[0] for s in sets]), np.concatenate([s[1] for s in sets]))


def _minus(a: Intervals, *others: Intervals) -> Intervals:
    if not others:
        return a
    return combine(lambda x, *o: x & ~np.logical_or.reduce(o), a, *others)


def _clip(iv: Intervals, lo: float, hi: float) -> Intervals:
    return merged(np.clip(iv[0], lo, hi), np.clip(iv[1], lo, hi))


# ---------------------------------------------------------------------------- one rank's trace
@dataclass(frozen=True)
class StepBreakdown:
    """One rank-step, in seconds. compute + exposed_comm + exposed_memory + idle = step; compute is
    forward + backward + optimizer + data_compute; overlap = communication while compute ran."""

    step: int
    start_s: float  # the window's start on the trace's clock
    step_s: float
    compute_s: float
    comm_s: float
    memory_s: float
    overlap_s: float
    exposed_comm_s: float
    exposed_memory_s: float
    idle_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    data_compute_s: float

    def record(self, rank: int, t0_s: float) -> dict[str, Any]:
        """The store's step row (docs/import-trace.md has the mapping)."""
        return {"kind": "step", "rank": rank, "step": self.step, "t_s": self.start_s - t0_s,
                "data_s": self.data_compute_s + self.exposed_memory_s + self.idle_s,
                "forward_s": self.forward_s, "backward_s": self.backward_s, "comm_wait_s": self.exposed_comm_s,
                "optimizer_s": self.optimizer_s, "step_s": self.step_s, "comm_s": self.comm_s,
                "compute_cpu_s": None, "samples": None, "loss": None, "bytes_sent": None}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RankTrace:
    """One rank's file, read: who it is and its steps."""

    path: Path
    rank: int
    world_size: int
    rank_from: str  # distributedInfo, the file name, or "the only file"
    device: str  # "cuda" (device kernels) or "cpu"
    backend: str
    host: str
    steps: list[StepBreakdown] = field(default_factory=list)

    def totals(self) -> dict[str, float]:
        """Sums over the steps (seconds), and HTA's shares: idle, compute and non-compute of the time
        covered, and overlap of the communication time."""
        keys = ("step_s", "compute_s", "comm_s", "memory_s", "overlap_s", "exposed_comm_s", "exposed_memory_s",
                "idle_s")
        sums = {k: sum(getattr(s, k) for s in self.steps) for k in keys}
        span = sums["step_s"]
        sums["idle_share"] = sums["idle_s"] / span if span else 0.0
        sums["compute_share"] = sums["compute_s"] / span if span else 0.0
        sums["non_compute_share"] = (sums["exposed_comm_s"] + sums["exposed_memory_s"]) / span if span else 0.0
        sums["overlap_fraction"] = sums["overlap_s"] / sums["comm_s"] if sums["comm_s"] else 0.0
        return sums


@dataclass
class _Raw:
    """What the analysis needs from a file's events (times in microseconds, as the trace has them)."""

    header: dict[str, Any] = field(default_factory=dict)
    steps: dict[int, tuple[float, float]] = field(default_factory=dict)
    ops: dict[Any, list[tuple[float, float, str]]] = field(default_factory=lambda: defaultdict(list))
    annotations: dict[Any, list[tuple[float, float, str]]] = field(default_factory=lambda: defaultdict(list))
    launches: dict[Any, tuple[Any, float]] = field(default_factory=dict)  # correlation -> (tid, ts)
    kernels: list[tuple[float, float, str, str, Any]] = field(default_factory=list)  # ts, end, name, cat, corr
    is_trace: bool = False


def read_trace(path: Path) -> _Raw:
    """A trace file's events, kept only as far as the analysis needs them."""
    raw = _Raw()
    try:
        for event in iter_trace_events(path, raw.header):
            raw.is_trace = True
            if not isinstance(event, dict) or event.get("ph") != "X":
                continue
            try:
                ts, dur = float(event["ts"]), float(event.get("dur", 0))
            except (KeyError, TypeError, ValueError):
                continue
            cat, name, tid = event.get("cat", ""), str(event.get("name", "")), event.get("tid")
            args = event.get("args") if isinstance(event.get("args"), dict) else {}
            if cat in DEVICE_CATEGORIES:
                raw.kernels.append((ts, ts + dur, name, cat, args.get("correlation")))
            elif cat in LAUNCH_CATEGORIES:
                if "correlation" in args:
                    raw.launches[args["correlation"]] = (tid, ts)
            elif cat in ("cpu_op", "user_annotation"):
                match = PROFILER_STEP.match(name)
                if match:
                    raw.steps.setdefault(int(match.group(1)), (ts, ts + dur))
                elif cat == "cpu_op":
                    raw.ops[tid].append((ts, ts + dur, name))
                else:
                    raw.annotations[tid].append((ts, ts + dur, name))
    except (ValueError, UnicodeDecodeError, EOFError, OSError) as exc:  # JSONDecodeError is a ValueError
        raise TraceImportError(f"trace file {path} is not JSON ({_first_line(exc)}): not a torch.profiler "
                               "trace") from None
    if not raw.is_trace:
        raise TraceImportError(f"trace file {path} holds no trace events: not a torch.profiler trace")
    if not raw.steps:
        raise TraceImportError(f"trace file {path} has no ProfilerStep#N annotations: profile with a schedule "
                               "(torch.profiler.schedule) and call prof.step() once per step")
    return raw


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]


def _set(items: Iterable[tuple[float, float, str]], pick: Callable[[str], bool]) -> Intervals:
    chosen = [(a, b) for a, b, name in items if pick(name)]
    return merged([a for a, _ in chosen], [b for _, b in chosen]) if chosen else EMPTY


def _contexts(raw: _Raw, tid: Any) -> dict[str, Intervals]:
    """Where a thread was in backward, the optimizer, or data loading (compute's labels)."""
    ops, notes = raw.ops.get(tid, []), raw.annotations.get(tid, [])
    return {"backward": _set(ops, lambda n: n.startswith(BACKWARD)),
            "optimizer": _set(notes, lambda n: n.startswith(OPTIMIZER)),
            "data": _set(notes, lambda n: n.startswith(DATA))}


def _label_of(contexts: dict[str, Intervals], ts: np.ndarray) -> np.ndarray:
    """The label of each instant on a thread: optimizer over backward over data; forward otherwise."""
    labels = np.full(len(ts), "forward", dtype=object)
    for label in ("data", "backward", "optimizer"):
        labels[_covered(ts, contexts[label])] = label
    return labels


def _partition(window: tuple[float, float], compute: dict[str, Intervals], comm: Intervals,
               memory: Intervals, step: int) -> StepBreakdown:
    """Each instant of the window given one class (see the module's docstring); microseconds in, seconds out."""
    lo, hi = window
    parts = {label: _clip(compute.get(label, EMPTY), lo, hi) for label in LABELS}
    comm, memory = _clip(comm, lo, hi), _clip(memory, lo, hi)
    all_compute = _union(parts.values())
    exclusive, before = {}, []
    for label in LABELS:
        exclusive[label] = length(_minus(parts[label], *before))
        before.append(parts[label])
    overlap = length(combine(lambda c, m: c & m, all_compute, comm))
    busy = length(_union([all_compute, comm, memory]))
    us = 1e-6
    return StepBreakdown(
        step=step, start_s=lo * us, step_s=(hi - lo) * us, compute_s=length(all_compute) * us,
        comm_s=length(comm) * us, memory_s=length(memory) * us, overlap_s=overlap * us,
        exposed_comm_s=length(_minus(comm, all_compute)) * us,
        exposed_memory_s=length(_minus(memory, all_compute, comm)) * us,
        idle_s=((hi - lo) - busy) * us,
        forward_s=exclusive["forward"] * us, backward_s=exclusive["backward"] * us,
        optimizer_s=exclusive["optimizer"] * us, data_compute_s=exclusive["data"] * us)


def host_steps(raw: _Raw) -> list[StepBreakdown]:
    """A CPU job's steps: the ProfilerStep#N windows on the host's threads."""
    compute: dict[str, list[Intervals]] = defaultdict(list)
    comm_sets, copy_sets = [], []
    for tid in set(raw.ops) | set(raw.annotations):
        ops, notes = raw.ops.get(tid, []), raw.annotations.get(tid, [])
        comm = _union([_set(ops, lambda n: bool(HOST_COMM.match(n))), _set(notes, lambda n: bool(HOST_COMM.match(n)))])
        copies = _minus(_set(ops, lambda n: n in HOST_COPY), comm)
        busy = _minus(_set(ops, lambda n: True), comm, copies)
        contexts = _contexts(raw, tid)
        taken: list[Intervals] = []
        for label in ("optimizer", "backward", "data"):
            part = combine(lambda b, c: b & c, busy, contexts[label])
            compute[label].append(_minus(part, *taken))
            taken.append(part)
        compute["forward"].append(_minus(busy, *taken))
        comm_sets.append(comm)
        copy_sets.append(copies)
    labelled = {label: _union(sets) for label, sets in compute.items()}
    comm_all, copy_all = _union(comm_sets), _union(copy_sets)
    return [_partition(window, labelled, comm_all, copy_all, n) for n, window in sorted(raw.steps.items())]


def device_steps(raw: _Raw) -> list[StepBreakdown]:
    """A GPU job's steps: kernels by the step their launch fell in, on the device's timeline."""
    starts = sorted((lo, hi, n) for n, (lo, hi) in raw.steps.items())
    step_lo = np.array([lo for lo, _, _ in starts])
    step_hi = np.array([hi for _, hi, _ in starts])
    ids = [n for _, _, n in starts]
    by_tid: dict[Any, list[int]] = defaultdict(list)
    kernels = [k for k in raw.kernels if k[4] in raw.launches]
    for i, k in enumerate(kernels):
        by_tid[raw.launches[k[4]][0]].append(i)
    step_of = np.full(len(kernels), -1)
    label = np.full(len(kernels), "forward", dtype=object)
    for tid, members in by_tid.items():
        ts = np.array([raw.launches[kernels[i][4]][1] for i in members])
        pos = np.searchsorted(step_lo, ts, side="right") - 1
        ok = (pos >= 0) & (ts < step_hi[np.clip(pos, 0, None)])
        step_of[members] = np.where(ok, pos, -1)
        label[members] = _label_of(_contexts(raw, tid), ts)
    chosen = step_of >= 0
    if not chosen.any():
        return []
    k_lo = np.array([k[0] for k in kernels])[chosen]
    k_hi = np.array([k[1] for k in kernels])[chosen]
    names = [k[2] for k, c in zip(kernels, chosen) if c]
    cats = [k[3] for k, c in zip(kernels, chosen) if c]
    step_of, label = step_of[chosen], label[chosen]
    is_comm = np.array([bool(COMM_KERNEL.match(n)) for n in names])
    is_compute = np.array([c == "kernel" and not NOT_COMPUTE_KERNEL.match(n) for n, c in zip(names, cats)])
    is_memory = ~is_comm & ~is_compute
    compute = {lab: merged(k_lo[is_compute & (label == lab)], k_hi[is_compute & (label == lab)]) for lab in LABELS}
    comm = merged(k_lo[is_comm], k_hi[is_comm])
    memory = merged(k_lo[is_memory], k_hi[is_memory])
    present = sorted(set(step_of.tolist()))
    firsts = [float(k_lo[step_of == p].min()) for p in present]
    end = float(k_hi.max())
    out, hi = [], -np.inf
    for j, p in enumerate(present):
        lo = max(firsts[j], hi)  # windows follow each other even if a step's first kernel ran early
        hi = max(firsts[j + 1] if j + 1 < len(present) else end, lo)
        out.append(_partition((lo, hi), compute, comm, memory, ids[p]))
    return out


# ---------------------------------------------------------------------------- a folder of ranks
def trace_files(folder: Path) -> list[Path]:
    """The trace files in a folder (not its sub-folders): *.json and *.json.gz, by name."""
    if not folder.exists():
        raise TraceImportError(f"trace folder {folder} does not exist")
    if not folder.is_dir():
        raise TraceImportError(f"{folder} is a file: give the folder holding one trace file per rank")
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(TRACE_SUFFIXES))
    if not files:
        raise TraceImportError(f"no trace files in {folder}: expected torch.profiler traces (*.json or *.json.gz), "
                               "one per rank")
    return files


def load_rank_traces(folder: Path) -> list[RankTrace]:
    """Every rank's trace in the folder, read and checked: one file per rank of one world size, ranks
    0..world_size-1 all present. The rank is the trace's distributedInfo.rank; without it, a number after
    `rank` in the file name (rank-3.json, trace_rank3.json); a lone file without either is rank 0 of 1."""
    files = trace_files(folder)
    raws = [(path, read_trace(path)) for path in files]
    ranked: list[tuple[Path, _Raw, int, int | None, str]] = []
    for path, raw in raws:
        info = raw.header.get("distributedInfo")
        info = info if isinstance(info, dict) else {}
        rank, world = info.get("rank"), info.get("world_size")
        if isinstance(rank, int) and not isinstance(rank, bool):
            ranked.append((path, raw, rank, world if isinstance(world, int) else None, "distributedInfo"))
            continue
        match = RANK_IN_NAME.search(path.name)
        if match:
            ranked.append((path, raw, int(match.group(1)), None, "the file name"))
        elif len(raws) == 1:
            ranked.append((path, raw, 0, 1, "the only file"))
        else:
            raise TraceImportError(f"trace file {path.name}: no distributedInfo.rank in it and no rank in its name "
                                   f"(e.g. rank-3.json), so its rank is ambiguous among {len(raws)} files")
    worlds = {w: p for p, _, _, w, _ in ranked if w is not None}
    if len(worlds) > 1:
        (w1, p1), (w2, p2) = sorted(worlds.items())[:2]
        raise TraceImportError(f"world sizes disagree: {p1.name} says {w1}, {p2.name} says {w2}")
    world = next(iter(worlds), None) or max(r for _, _, r, _, _ in ranked) + 1
    seen: dict[int, Path] = {}
    for path, _, rank, _, _ in ranked:
        if rank in seen:
            raise TraceImportError(f"rank {rank} is claimed by two trace files: {seen[rank].name} and {path.name}")
        if not 0 <= rank < world:
            raise TraceImportError(f"trace file {path.name} is rank {rank}, outside the world size {world}")
        seen[rank] = path
    missing = sorted(set(range(world)) - set(seen))
    if missing:
        raise TraceImportError(f"no trace for rank {', '.join(map(str, missing))} of world size {world} in {folder} "
                               f"(found rank {', '.join(map(str, sorted(seen)))})")
    out = []
    for path, raw, rank, _, source in sorted(ranked, key=lambda r: r[2]):
        device = "cuda" if raw.kernels else "cpu"
        steps = device_steps(raw) if raw.kernels else host_steps(raw)
        if not steps:
            raise TraceImportError(f"trace file {path.name}: no device kernel was launched inside a ProfilerStep#N")
        info = raw.header.get("distributedInfo") if isinstance(raw.header.get("distributedInfo"), dict) else {}
        out.append(RankTrace(path=path, rank=rank, world_size=world, rank_from=source, device=device,
                             backend=str(info.get("backend", "")), host=str(raw.header.get("host_name", "")),
                             steps=steps))
    return out


def describe(trace: RankTrace) -> str:
    """The `trace_import` event's message: where the rank's rows came from."""
    return json.dumps({"file": str(trace.path), "rank_from": trace.rank_from, "device": trace.device,
                       "backend": trace.backend, "host": trace.host, "steps": [s.step for s in trace.steps],
                       "totals": trace.totals()}, sort_keys=True)
