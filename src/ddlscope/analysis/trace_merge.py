"""Merge the ranks' chrome traces of one run into one chrome-trace / Perfetto JSON.

Pure Python (no torch): one process track per rank (pid = rank, with
process_name "rank N"), clocks aligned on wall time. Each rank's trace counts
time from its own profiler base; its sidecar (`rank-N.meta.json`) holds the
wall-clock time read right before the `ddlscope.trace_anchor` range opened,
so `wall = anchor_wall + (ts - anchor_ts)`. The merged timeline starts at the
earliest rank's anchor. Ranks are read one at a time and events are written
as they are shifted, so memory holds one rank's trace at most.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, TextIO

ANCHOR = "ddlscope.trace_anchor"
_PROCESS_META = {"process_name", "process_labels", "process_sort_index"}
_DEVICE_TID_BASE = 1_000_000  # device tracks (another pid in the rank's trace) become threads of the rank
_FLOW_ID_BASE = 10**12  # keeps flow ids of different ranks apart


class TraceMergeError(ValueError):
    """A rank's trace or sidecar is missing or unreadable."""


@dataclass
class RankTrace:
    rank: int
    path: Path

    @property
    def meta_path(self) -> Path:
        return self.path.with_name(self.path.stem + ".meta.json")


@dataclass
class MergeResult:
    output: Path
    ranks: list[int]
    events: int
    offsets_us: dict[int, float] = field(default_factory=dict)  # each rank's anchor after the earliest


def merge_traces(traces: Iterable[RankTrace], output: Path) -> MergeResult:
    traces = sorted(traces, key=lambda t: t.rank)
    if not traces:
        raise TraceMergeError("no rank traces to merge")
    anchors = {t.rank: _anchor_wall_us(t) for t in traces}
    earliest = min(anchors.values())
    result = MergeResult(output, [t.rank for t in traces], 0)
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output, "w", encoding="utf-8") as out:
        out.write('{"displayTimeUnit": "ms", "traceEvents": [\n')
        first = True
        for t in traces:
            result.offsets_us[t.rank] = anchors[t.rank] - earliest
            for event in _rank_events(t, anchors[t.rank] - earliest):
                if not first:
                    out.write(",\n")
                out.write(json.dumps(event, separators=(",", ":")))
                first = False
                result.events += 1
        out.write('\n],\n"otherData": ')
        _write_other(out, result)
        out.write("}\n")
    return result


def _anchor_wall_us(trace: RankTrace) -> float:
    try:
        meta = json.loads(trace.meta_path.read_text())
        return float(meta["anchor_wall_s"]) * 1e6
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TraceMergeError(f"rank {trace.rank}: cannot read {trace.meta_path}: {exc}") from None


def _rank_events(trace: RankTrace, anchor_offset_us: float) -> Iterable[dict[str, Any]]:
    try:
        with open(trace.path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise TraceMergeError(f"rank {trace.rank}: cannot read {trace.path}: {exc}") from None
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    anchor = next((e for e in events if e.get("name") == ANCHOR and e.get("ph") == "X"), None)
    if anchor is None:
        raise TraceMergeError(f"rank {trace.rank}: {trace.path} has no {ANCHOR} event")
    host_pid = anchor.get("pid")
    shift = anchor_offset_us - float(anchor["ts"])  # rank ts -> merged ts
    rank = trace.rank
    yield {"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}}
    yield {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}}
    for e in events:
        if not isinstance(e, dict):
            continue
        if e.get("ph") == "M" and e.get("name") in _PROCESS_META:
            continue
        e = dict(e)
        pid = e.get("pid")
        if pid != host_pid and "tid" in e:
            e["tid"] = _device_tid(pid, e["tid"])
        e["pid"] = rank
        if "ts" in e and e.get("ph") != "M":
            try:
                e["ts"] = round(float(e["ts"]) + shift, 3)
            except (TypeError, ValueError):
                pass
        elif e.get("ph") == "M":
            e.pop("ts", None)
        if "id" in e and e.get("ph") in ("s", "t", "f") and isinstance(e["id"], int):
            e["id"] = rank * _FLOW_ID_BASE + e["id"]
        yield e
    del data, events


def _device_tid(pid: Any, tid: Any) -> Any:
    try:
        return (int(pid) + 1) * _DEVICE_TID_BASE + int(tid)
    except (TypeError, ValueError):
        return f"{pid}/{tid}"


def _write_other(out: TextIO, result: MergeResult) -> None:
    json.dump({"merged_by": "ddlscope trace", "ranks": result.ranks,
               "anchor_offsets_us": {str(k): v for k, v in result.offsets_us.items()},
               "clock": "wall clock, zero at the earliest rank's profiler start"}, out)
