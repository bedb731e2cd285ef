"""Heartbeats and the hang watchdog.

Each rank keeps a small memory-mapped file, `heartbeat-RANK.bin` in the run's folder, and stamps it
whenever it enters a phase or starts a message: its pid, a beat counter, the step, the phase and the
communication it last started. A stamp is a few memory stores (no system call), so it costs nothing
next to a step. The launcher's `Watchdog` reads the files: a rank whose counter has not moved for
`hang_timeout_s` past the slowest step seen so far has hung (deadlocked, stopped, lost a peer), and
the watchdog ends the run with one message naming the stuck ranks, their step, phase and the
collective or server message they wait on, rather than letting it block until gloo's own timeout.

Why by hand: torch's elastic agent only notices ranks that exit, NCCL's flight recorder exists only
on CUDA and gloo has no equivalent; a stopped (SIGSTOP) rank is invisible to all of them.

Heartbeats belong to one attempt: the launcher gives each launch a fresh folder (a resumed run never
reads the beats of the launch before it), and each beat carries the elastic restart count, so a
restarted group starts again with the start-up allowance. A beat also carries its process's start
time, and the launcher signals a rank only through a pidfd, once the process is its own descendant
with that start time (`signal_own_process`): a pid written in a file is never trusted on its own.
"""

from __future__ import annotations

import mmap
import os
import signal
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# pid, beats, step, phase index, last communication's index: int64; the slowest step so far: float64;
# the process's start time (clock ticks after boot, /proc/PID/stat) and the elastic restart count: int64
_LAYOUT = struct.Struct("<qqqqqdqq")
PHASE_NAMES = ("start", "data", "forward", "backward", "synchronize", "optimizer", "evaluate", "checkpoint",
               "serve", "finish", "away")
COMM_NAMES = ("", "all_reduce", "all_gather", "reduce_scatter", "p2p", "broadcast")


def heartbeat_file(run_dir: Path, rank: int) -> Path:
    return run_dir / f"heartbeat-{rank}.bin"


class Heartbeat:
    """A rank's side: `beat(step=..., phase=...)`, `comm(kind)`."""

    def __init__(self, run_dir: Path, rank: int, attempt: int | None = None):
        path = heartbeat_file(run_dir, rank)
        with open(path, "wb") as f:
            f.write(b"\0" * _LAYOUT.size)
        self._file = open(path, "r+b")
        self._map = mmap.mmap(self._file.fileno(), _LAYOUT.size)
        self.pid, self.beats, self.step, self.phase, self.last_comm = os.getpid(), 0, -1, 0, 0
        self.started_ticks = process_start_ticks(self.pid) or 0
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) if attempt is None else attempt
        self.slowest_step_s, self._step_began = 0.0, 0.0
        self._write()

    def beat(self, step: int | None = None, phase: str | None = None) -> None:
        if step is not None:
            now = time.monotonic()
            if self.step >= 0 and step == self.step + 1:
                self.slowest_step_s = max(self.slowest_step_s, now - self._step_began)
            self.step, self._step_began = step, now
        if phase is not None:
            self.phase = PHASE_NAMES.index(phase)
        self.beats += 1
        self._write()

    def comm(self, kind: str) -> None:
        """A collective or message started (strategies' CommRecorder calls this)."""
        self.last_comm = COMM_NAMES.index(kind) if kind in COMM_NAMES else 0
        self.beat()

    def _write(self) -> None:
        _LAYOUT.pack_into(self._map, 0, self.pid, self.beats, self.step, self.phase, self.last_comm,
                          self.slowest_step_s, self.started_ticks, self.attempt)

    def close(self) -> None:
        self._map.close()
        self._file.close()


@dataclass(frozen=True)
class Beat:
    rank: int
    pid: int
    beats: int
    step: int
    phase: str
    last_comm: str
    slowest_step_s: float
    started_ticks: int = 0  # the process's start time: with pid, who the beat is from
    attempt: int = 0  # the elastic restart count


def read_beat(path: Path, rank: int) -> Beat | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) < _LAYOUT.size:
        return None
    pid, beats, step, phase, comm, slowest_s, started_ticks, attempt = _LAYOUT.unpack_from(data)
    if not pid:
        return None
    return Beat(rank, pid, beats, step, PHASE_NAMES[phase] if 0 <= phase < len(PHASE_NAMES) else "?",
                COMM_NAMES[comm] if 0 <= comm < len(COMM_NAMES) else "", slowest_s, started_ticks, attempt)


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (the 3rd field on), None when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_start_ticks(pid: int) -> int | None:
    """When the process started (clock ticks after boot): with the pid, it names one process for good."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None


def _is_descendant(pid: int, ancestor: int) -> bool:
    seen = 0
    while pid > 1 and seen < 64:
        fields = _stat_fields(pid)
        if fields is None:
            return False
        pid, seen = int(fields[1]), seen + 1
        if pid == ancestor:
            return True
    return False


def signal_own_process(pid: int, signum: int, started_ticks: int | None = None) -> bool:
    """Send `signum` to `pid` only if it is a descendant of this process (a rank this launcher started)
    and, when `started_ticks` is given, started then; True when it was sent.

    Through a pidfd taken before the checks, so that the process checked is the process signalled even
    if the pid is reused meanwhile. Without pidfds (not Linux) nothing is signalled: a pid from a file
    may name anyone by then.
    """
    if not hasattr(os, "pidfd_open") or not hasattr(signal, "pidfd_send_signal"):
        return False
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:  # gone (or not ours to see)
        return False
    try:
        if started_ticks is not None and process_start_ticks(pid) != started_ticks:
            return False
        if not _is_descendant(pid, os.getpid()):
            return False
        signal.pidfd_send_signal(pidfd, signum)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(pidfd)


def process_state(pid: int) -> str:
    """'stopped', 'zombie', 'gone' or 'running' (from /proc: Linux only; 'running' elsewhere)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"
    except OSError:
        return "running"
    return {"T": "stopped", "t": "stopped", "Z": "zombie", "X": "gone"}.get(state, "running")


class Watchdog(threading.Thread):
    """The launcher's side: watch every local rank's heartbeat; on a hang, call `on_hang(message, beats)` once,
    with the beats of the stuck attempt (signal their processes with `signal_own_process`).

    A rank hangs when its beat counter has not moved for `timeout_s` past the slowest step any rank
    has reported so far (each rank times its own steps). Before any rank has finished a step
    (start-up, rendezvous, model building), `startup_s` is allowed instead. Each elastic attempt is
    watched afresh: beats of an older attempt are ignored, and while every rank's process is gone
    (the agent restarting the group, or ending it) the clock starts over.
    """

    def __init__(self, run_dir: Path, ranks: list[int], timeout_s: float, on_hang: Callable[[str, list[Beat]], None],
                 startup_s: float = 300.0, poll_s: float = 0.5):
        super().__init__(name="ddlscope-watchdog", daemon=True)
        self.run_dir, self.ranks, self.timeout_s, self.on_hang = run_dir, ranks, timeout_s, on_hang
        self.startup_s, self.poll_s = startup_s, poll_s
        self.message: str | None = None
        self._stop_event = threading.Event()
        self._began = time.monotonic()
        self.attempt = 0
        self._moved_at: dict[int, float] = {}  # rank -> when its counter last moved (monotonic)
        self._last: dict[int, Beat] = {}
        self.slowest_step_s = 0.0

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        self._start_over(time.monotonic())
        while not self._stop_event.wait(self.poll_s):
            beats = self.check(time.monotonic())
            if beats is not None and not self._stop_event.is_set():
                self.on_hang(self.message or "", beats)
                return

    def check(self, now: float) -> list[Beat] | None:
        """One look at the heartbeats at time `now`: None, or (on a hang, with `message` set) the beats of
        the current attempt."""
        beats = {r: b for r in self.ranks if (b := read_beat(heartbeat_file(self.run_dir, r), r))}
        newest = max((b.attempt for b in beats.values()), default=self.attempt)
        if newest > self.attempt:
            self.attempt = newest
            self._start_over(now)
        beats = {r: b for r, b in beats.items() if b.attempt == self.attempt}
        if beats and all(process_state(b.pid) in ("gone", "zombie") for b in beats.values()):
            self._start_over(now)  # between attempts: the agent saw the exits and restarts or ends the group
            return None
        for rank, beat in beats.items():
            self._observe(rank, beat, now)
        stuck = [r for r in self.ranks if now - self._moved_at.get(r, self._began) > self._allowance_s()]
        if not stuck:
            return None
        self.message = self._describe(stuck, beats, now)
        return list(beats.values())

    def _start_over(self, now: float) -> None:
        self._began, self._moved_at, self._last, self.slowest_step_s = now, {}, {}, 0.0

    def _observe(self, rank: int, beat: Beat, now: float) -> None:
        previous = self._last.get(rank)
        if previous is None or beat.beats != previous.beats or beat.pid != previous.pid:
            self._moved_at[rank] = now
        self.slowest_step_s = max(self.slowest_step_s, beat.slowest_step_s)
        self._last[rank] = beat

    def _allowance_s(self) -> float:
        if self.slowest_step_s == 0.0:
            return self.startup_s + self.timeout_s
        return self.timeout_s + self.slowest_step_s

    def _describe(self, stuck: list[int], beats: dict[int, Beat], now: float) -> str:
        parts = []
        # The likely cause first: a stopped or vanished process, then the rank furthest behind.
        stuck = sorted(stuck, key=lambda r: (process_state(beats[r].pid) not in ("stopped", "gone"), beats[r].step)
                       if r in beats else (False, -1))
        for rank in stuck:
            beat = beats.get(rank)
            if beat is None:
                parts.append(f"rank {rank} never started")
                continue
            state = process_state(beat.pid)
            how = {"stopped": " (process stopped: SIGSTOP?)", "gone": " (process gone)"}.get(state, "")
            waits = f", waiting on {_describe_comm(beat.last_comm)}" if beat.phase in ("backward", "synchronize",
                                                                                      "forward", "serve") \
                and beat.last_comm else ""
            step = f"step {beat.step}" if beat.step >= 0 else "start-up"
            parts.append(f"rank {rank}{how} at {step} in {beat.phase}{waits}, "
                         f"no progress for {now - self._moved_at.get(rank, now):.0f} s")
        return (f"hang: {'; '.join(parts)} (watchdog: {self.timeout_s:.0f} s past the slowest step, "
                f"{self.slowest_step_s:.2f} s)")


def _describe_comm(kind: str) -> str:
    return "a point-to-point (server) message" if kind == "p2p" else f"a collective ({kind})"
