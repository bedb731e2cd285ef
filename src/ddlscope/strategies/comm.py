"""Communication accounting shared by every strategy: bytes sent, and when
each collective ran, so the loop can split communication into the part hidden
behind backward compute and the part the step waited for."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class CommStats:
    bytes_sent: int = 0  # payload this rank contributed to collectives / sent point-to-point
    total_s: float = 0.0  # wall time with at least one collective in flight
    exposed_in_backward_s: float = 0.0  # tail of backward spent only waiting for communication


class CommRecorder:
    """Collects (launch, completion) intervals and payload bytes for one step.

    Completion callbacks may run on a backend thread; list.append is atomic
    under the GIL, so no lock is needed.
    """

    def __init__(self) -> None:
        self._intervals: list[tuple[float, float]] = []
        self._bytes = 0
        self._last_launch_s: float | None = None

    def launched(self, payload_bytes: int) -> float:
        now = time.perf_counter()
        self._bytes += payload_bytes
        self._last_launch_s = now
        return now

    def completed(self, launch_s: float) -> None:
        self._intervals.append((launch_s, time.perf_counter()))

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


def _union_length_s(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total
