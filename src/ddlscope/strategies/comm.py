"""Communication accounting and network emulation, shared by every strategy.

Every strategy reports its messages here: `launched(payload_bytes, kind)`
when a collective or message starts and `completed(pending)` when it ends.
That gives bytes sent and when communication was in flight, so the loop can
split it into the part hidden behind compute and the part the step waited for.

The same two calls are where network emulation happens, once for all
strategies: with an emulated link, a message cannot complete before
`alpha + wire_bytes / bandwidth` after the link is free (messages on one link
are serialised), so strategies on a fast local machine see the cluster's
network. The real transfer still happens; emulation only ever adds waiting.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from ddlscope.specs.wire import wire_bytes

@dataclass(frozen=True)
class LinkModel:
    """One rank's emulated link: latency and bandwidth (after `scaled` division)."""

    alpha_s: float
    bandwidth_bytes_per_s: float

    def transfer_s(self, kind: str, payload_bytes: int, ranks: int) -> float:
        return self.alpha_s + wire_bytes(kind, payload_bytes, ranks) / self.bandwidth_bytes_per_s


@dataclass
class CommStats:
    bytes_sent: int = 0  # payload this rank contributed to collectives / sent point-to-point
    total_s: float = 0.0  # wall time with at least one collective in flight
    exposed_in_backward_s: float = 0.0  # tail of backward spent only waiting for communication
    exposed_in_forward_s: float = 0.0  # forward time blocked on communication (e.g. FSDP's all-gathers)


@dataclass
class Pending:
    """A message in flight: when it started and the earliest it may complete."""

    launch_s: float
    ready_s: float


class CommRecorder:
    """Collects (launch, completion) intervals and payload bytes for one step.

    Completion callbacks may run on a backend thread; appends are atomic under
    the GIL and the link clock is guarded by a lock.
    """

    def __init__(self, link: LinkModel | None = None, ranks: int = 1) -> None:
        self.link = link
        self.ranks = ranks
        self._intervals: list[tuple[float, float]] = []
        self._bytes = 0
        self._last_launch_s: float | None = None
        self._link_free_s = 0.0
        self._lock = threading.Lock()
        self._callbacks_held = 0  # completion callbacks a backend thread still holds (see `settle`)
        # The runtime's heartbeat (runtime/heartbeat.py) learns here what a rank last waited on.
        self.on_launch: Callable[[str], None] | None = None

    def launched(self, payload_bytes: int, kind: str = "all_reduce", ranks: int | None = None) -> Pending:
        now = time.perf_counter()
        if self.on_launch is not None:
            self.on_launch(kind)
        self._bytes += payload_bytes
        self._last_launch_s = now
        ready = now
        if self.link is not None:
            with self._lock:
                start = max(now, self._link_free_s)
                ready = start + self.link.transfer_s(kind, payload_bytes, ranks or self.ranks)
                self._link_free_s = ready
        return Pending(now, ready)

    def completed(self, pending: Pending) -> None:
        """The message is done: wait out what the emulated link still owes, then record it."""
        remaining = pending.ready_s - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        self._intervals.append((pending.launch_s, time.perf_counter()))

    def complete_future(self, future: torch.futures.Future[Any], pending: Pending) -> torch.futures.Future[Any]:
        """A future that resolves like `future`, but not before the emulated link allows.

        The delay runs on a timer thread, never on the backend's own thread, so
        other messages keep flowing meanwhile.
        """
        if self.link is None:
            # Only note the completion time: no chained future, so the hot path stays cheap.
            future.add_done_callback(self._held(
                lambda _: self._intervals.append((pending.launch_s, time.perf_counter()))))
            return future

        delayed: torch.futures.Future[Any] = torch.futures.Future()

        def finish(fut: torch.futures.Future[Any]) -> None:
            try:
                value = fut.value()
            except Exception as exc:  # surface the backend's error where the caller waits
                delayed.set_exception(exc)
                return
            self._intervals.append((pending.launch_s, max(time.perf_counter(), pending.ready_s)))
            delayed.set_result(value)

        def on_done(fut: torch.futures.Future[Any]) -> None:
            remaining = pending.ready_s - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)
            finish(fut)

        future.add_done_callback(self._held(on_done))
        return delayed

    def _held(self, callback: Callable[[Any], None]) -> Callable[[Any], None]:
        """`callback`, counted until the backend thread that runs it lets it go."""
        with self._lock:
            self._callbacks_held += 1
        weakref.finalize(callback, self._let_go)
        return callback

    def _let_go(self) -> None:
        with self._lock:
            self._callbacks_held -= 1

    def settle(self, timeout_s: float = 2.0, grace_s: float = 0.02) -> bool:
        """Wait (without the GIL) until no backend thread holds a completion callback; False on timeout.

        Why: gloo's worker thread runs a future's Python callbacks, then drops them, taking the GIL each
        time. If the interpreter has begun to finalize by then, CPython ends that thread inside a C++
        destructor and the process aborts ("terminate called without an active exception", exit -6):
        on a loaded machine a rank can reach its exit before that thread gets a core. Called before
        exit, this lets those threads finish; `grace_s` covers the hook's own `then` callback, which the
        thread drops just after ours.
        """
        deadline_s = time.perf_counter() + timeout_s
        while self._callbacks_held > 0 and time.perf_counter() < deadline_s:
            time.sleep(0.001)
        if self._callbacks_held > 0:
            return False
        time.sleep(grace_s)
        return True

    def complete_work(self, work: dist.Work, pending: Pending,
                      on_waited: Callable[[float], None] | None = None) -> dist.Work:
        """A Work whose wait() also waits out the emulated link and records completion.

        `on_waited(waited_from_s)` runs once, after completion, with the time the
        caller started waiting (to measure how long it was blocked).
        """
        return _RecordedWork(work, pending, self, on_waited)

    def pop(self, backward_end_s: float) -> CommStats:
        """Stats since the last pop.

        Gradient buckets are launched as soon as their gradients are ready, so
        the last launch marks the end of backward compute; whatever backward
        spent after it was waiting for communication.
        """
        exposed = 0.0
        if self._last_launch_s is not None:
            exposed = max(0.0, backward_end_s - self._last_launch_s)
        stats = CommStats(self._bytes, _union_length_s(self._intervals), exposed)
        self._intervals, self._bytes, self._last_launch_s = [], 0, None
        return stats


class _RecordedWork(dist.Work):
    def __init__(self, inner: dist.Work, pending: Pending, recorder: CommRecorder,
                 on_waited: Callable[[float], None] | None = None):
        super().__init__()
        self._inner, self._pending, self._recorder, self._on_waited = inner, pending, recorder, on_waited
        self._done = False

    def wait(self, timeout: Any = None) -> bool:
        waited_from_s = time.perf_counter()
        ok = self._inner.wait() if timeout is None else self._inner.wait(timeout)
        if not self._done:
            self._done = True
            self._recorder.completed(self._pending)
            if self._on_waited is not None:
                self._on_waited(waited_from_s)
        return ok

    def is_completed(self) -> bool:
        return self._done or (self._inner.is_completed() and time.perf_counter() >= self._pending.ready_s)

    def get_future(self) -> torch.futures.Future[Any]:
        return self._recorder.complete_future(self._inner.get_future(), self._pending)


def _union_length_s(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total
