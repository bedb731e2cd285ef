"""Per-rank torch.profiler traces of a few training steps (`trace_steps`, off by default).

When on, each rank profiles steps 1..N (step 0 pays one-off costs and is
skipped), with our phases labelled by torch.profiler.record_function
(ddlscope.data, .forward, .backward, .synchronize, .optimizer), and writes a
chrome trace to `<store dir>/ddlscope-traces/<run uuid>/rank-N.json` beside a
sidecar `rank-N.meta.json`. The launcher deletes the run dir after a good
run, so traces live next to it, not in it.

Clock alignment: a profiler trace's timestamps count from the profiler's own
base, different in every process. Right after starting the profiler each
rank reads time.time() and opens a `ddlscope.trace_anchor` range; the merge
(analysis/trace_merge.py) maps each rank's trace onto wall-clock time through
that event, then shifts all ranks by the earliest anchor.

When tracing is off every phase label is one shared no-op context.
"""

from __future__ import annotations

import json
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch

from ddlscope.runtime.rows import RowWriter

PHASE_PREFIX = "ddlscope."
ANCHOR = "ddlscope.trace_anchor"
_OFF = nullcontext()


def traces_dir_for(run_dir: Path) -> Path:
    """run_dir = <store dir>/ddlscope-runs/<uuid>  ->  <store dir>/ddlscope-traces/<uuid>."""
    return run_dir.parent.parent / "ddlscope-traces" / run_dir.name


def trace_file(traces_dir: Path, rank: int) -> Path:
    return traces_dir / f"rank-{rank}.json"


def meta_file(trace_path: Path) -> Path:
    return trace_path.with_name(trace_path.stem + ".meta.json")


class StepTracer:
    """Profile steps first..last of one rank; phase labels only while profiling."""

    def __init__(self, trace_steps: int, total_steps: int, traces_dir: Path | None, rank: int,
                 device: torch.device, writer: RowWriter):
        self.first, self.last = 1, min(trace_steps, total_steps - 1)
        self.enabled = trace_steps > 0 and traces_dir is not None and self.last >= self.first
        self.traces_dir, self.rank, self.device, self.writer = traces_dir, rank, device, writer
        self._profiler: Any = None
        self._active = False
        self._anchor_wall_s = 0.0
        if trace_steps > 0 and not self.enabled:
            writer.event("trace", f"skipped: needs at least 2 steps (step 0 is not traced), run has {total_steps}")

    def phase(self, name: str) -> AbstractContextManager[Any]:
        if not self._active:
            return _OFF
        return torch.profiler.record_function(PHASE_PREFIX + name)

    def before_step(self, step: int) -> None:
        if not self.enabled or step != self.first:
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._profiler = profile(activities=activities, record_shapes=False, with_stack=False)
        self._profiler.start()
        self._anchor_wall_s = time.time()
        with torch.profiler.record_function(ANCHOR):
            pass
        self._active = True

    def after_step(self, step: int) -> None:
        if self._active and step == self.last:
            self._profiler.stop()
            self._active = False

    def finish(self) -> None:
        """Write the trace (after training, so exporting never delays the traced ranks' peers)."""
        if self._profiler is None:
            return
        if self._active:  # training ended early
            self._profiler.stop()
            self._active = False
        assert self.traces_dir is not None
        self.traces_dir.mkdir(parents=True, exist_ok=True)
        path = trace_file(self.traces_dir, self.rank)
        self._profiler.export_chrome_trace(str(path))
        meta = {"rank": self.rank, "anchor_event": ANCHOR, "anchor_wall_s": self._anchor_wall_s,
                "steps": [self.first, self.last], "device": str(self.device)}
        meta_file(path).write_text(json.dumps(meta))
        self._profiler = None
        self.writer.event("trace", f"steps={self.first}..{self.last} anchor_wall_s={self._anchor_wall_s:.6f} "
                                   f"path={path}")
