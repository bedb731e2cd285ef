"""Merge the ranks' chrome traces of one run into one chrome-trace / Perfetto JSON.

Pure Python (no torch): one process track per rank (pid = rank, with
process_name "rank N"), clocks aligned on wall time. Each rank's trace counts
time from its own profiler base; its sidecar (`rank-N.meta.json`) holds the
wall-clock time read right before the `ddlscope.trace_anchor` range opened,
so `wall = anchor_wall + (ts - anchor_ts)`. The merged timeline starts at the
earliest rank's anchor. Ranks are read one at a time and events are written
as they are shifted; a rank's trace is itself read a block and an event at a time
(`iter_trace_events`), so memory stays flat whatever the size of the traces.
"""

from __future__ import annotations

import gzip
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, TextIO

from ddlscope.store import atomic_output

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
    with atomic_output(output, what="--output") as out:  # whole or not at all: a full disk leaves no half trace
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
        anchor = _find_anchor(trace.path)
        events = iter_trace_events(trace.path)
        first = next(events, None)  # opens and checks the file before the rank's process track is named
    except (OSError, ValueError) as exc:
        raise TraceMergeError(f"rank {trace.rank}: cannot read {trace.path}: {exc}") from None
    if anchor is None:
        raise TraceMergeError(f"rank {trace.rank}: {trace.path} has no {ANCHOR} event")
    host_pid = anchor.get("pid")
    shift = anchor_offset_us - float(anchor["ts"])  # rank ts -> merged ts
    rank = trace.rank
    yield {"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}}
    yield {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}}
    try:
        for e in itertools.chain([first] if first is not None else [], events):
            if not isinstance(e, dict):
                continue
            if e.get("ph") == "M" and e.get("name") in _PROCESS_META:
                continue
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
    except (OSError, ValueError) as exc:
        raise TraceMergeError(f"rank {trace.rank}: cannot read {trace.path}: {exc}") from None


# A trace is read this many characters at a time: memory holds one block and one event, whatever the
# size of the trace (HTA's users report 950 GB of RAM for 200 GB of traces; this merge streams).
BLOCK_CHARS = 1 << 20
_DECODER = json.JSONDecoder()
_SPACE = " \t\n\r"


class _Reader:
    """A text file read block by block, with the JSON values at its cursor decoded one at a time."""

    def __init__(self, f: TextIO):
        self.f, self.buf, self.pos, self.eof = f, "", 0, False

    def _more(self) -> bool:
        if self.eof:
            return False
        block = self.f.read(BLOCK_CHARS)
        if not block:
            self.eof = True
            return False
        self.buf = self.buf[self.pos:] + block
        self.pos = 0
        return True

    def peek(self) -> str:
        """The next character that is not white space ("" at the end)."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in _SPACE:
                self.pos += 1
            if self.pos < len(self.buf) or not self._more():
                return self.buf[self.pos:self.pos + 1]

    def expect(self, char: str) -> None:
        if self.peek() != char:
            raise ValueError(f"expected {char!r} at character {self.pos} of a block, found {self.peek()!r}")
        self.pos += 1

    def value(self) -> Any:
        """The JSON value at the cursor (reading further blocks until it is whole)."""
        self.peek()
        while True:
            try:
                value, end = _DECODER.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError:
                if self._more():
                    continue
                raise
            # A number at the very end of a block may go on in the next one.
            if end == len(self.buf) and not self.eof and self._more():
                continue
            self.pos = end
            return value


def iter_trace_events(path: Path, header: dict[str, Any] | None = None) -> Iterator[Any]:
    """The events of a chrome trace - `{"traceEvents": [...], ...}` or a bare list - one at a time; a
    `.gz` file is read through gzip. `header`, when given, receives the trace's other top-level keys
    (distributedInfo, deviceProperties, ...) as they are read."""
    with (gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")) as f:
        reader = _Reader(f)
        if reader.peek() == "[":
            yield from _array(reader)
            return
        reader.expect("{")
        while reader.peek() not in ("}", ""):
            key = reader.value()
            reader.expect(":")
            if key == "traceEvents" and reader.peek() == "[":
                yield from _array(reader)
            elif header is not None:
                header[key] = reader.value()
            else:
                reader.value()  # another key's value (schemaVersion, deviceProperties, ...): skipped
            if reader.peek() == ",":
                reader.pos += 1
        reader.expect("}")


def _array(reader: _Reader) -> Iterator[Any]:
    reader.expect("[")
    if reader.peek() == "]":
        reader.pos += 1
        return
    while True:
        yield reader.value()
        if reader.peek() == ",":
            reader.pos += 1
            continue
        reader.expect("]")
        return


def _find_anchor(path: Path) -> dict[str, Any] | None:
    """The anchor event: found by its name in the text and decoded from the brace that opens it, which
    costs a scan of the text rather than decoding every event; when that fails (an unusual layout),
    by decoding the events in turn until it comes."""
    needle = json.dumps(ANCHOR)
    with open(path, encoding="utf-8") as f:
        text = ""
        while block := f.read(BLOCK_CHARS):
            text = text[-_ANCHOR_CONTEXT:] + block
            at = text.find(needle)
            while at >= 0:
                if len(text) - at < _ANCHOR_CONTEXT:  # the event may go on past this block
                    text += f.read(_ANCHOR_CONTEXT)
                event = _anchor_at(text, at)
                if event is not None:
                    return event
                at = text.find(needle, at + 1)
    return next((e for e in iter_trace_events(path)
                 if isinstance(e, dict) and e.get("name") == ANCHOR and e.get("ph") == "X"), None)


_ANCHOR_CONTEXT = 1 << 16  # characters kept around a found name: an anchor event is far shorter


def _anchor_at(text: str, at: int) -> dict[str, Any] | None:
    """The anchor event whose name is at `at`: the nearest opening brace before it that decodes into one."""
    brace = text.rfind("{", max(0, at - _ANCHOR_CONTEXT), at)
    while brace >= 0:
        try:
            event, _ = _DECODER.raw_decode(text, brace)
        except json.JSONDecodeError:
            event = None
        if isinstance(event, dict) and event.get("name") == ANCHOR and event.get("ph") == "X":
            return event
        brace = text.rfind("{", max(0, at - _ANCHOR_CONTEXT), brace)
    return None


def _device_tid(pid: Any, tid: Any) -> Any:
    try:
        return (int(pid) + 1) * _DEVICE_TID_BASE + int(tid)
    except (TypeError, ValueError):
        return f"{pid}/{tid}"


def _write_other(out: TextIO, result: MergeResult) -> None:
    json.dump({"merged_by": "ddlscope trace", "ranks": result.ranks,
               "anchor_offsets_us": {str(k): v for k, v in result.offsets_us.items()},
               "clock": "wall clock, zero at the earliest rank's profiler start"}, out)
