"""The phase timer: one step's wall time split into phases that add up to the step.

The training loop hands it to `Strategy.train_step`, so a strategy that owns
its step (micro-batches, local updates, a pipeline schedule) is timed by the
same code as the default forward/backward/synchronize/optimizer step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

import torch

from ddlscope.runtime.instrument import device_sync

if TYPE_CHECKING:
    from ddlscope.strategies.comm import CommStats

clock = time.perf_counter
PHASES = ("data", "forward", "backward", "synchronize", "optimizer")
COMPUTE_PHASES = ("forward", "backward")


class PhaseTimer:
    """Phases are contiguous: the time from the end of one phase to the start of the next belongs to
    the next, so every moment of a step is in exactly one phase. A phase entered several times in a
    step (one per micro-batch) adds up. Each phase ends with a device synchronisation, so host clocks
    measure device work on GPUs too.

    `after_forward(forward_s)` runs after each forward phase, its time counted in that phase (the
    straggler emulation sleeps there); `after_backward()` after each backward phase (memory is
    measured there, before the optimizer frees the gradients), its time counted in the next phase.
    """

    def __init__(self, device: torch.device, label: Callable[[str], AbstractContextManager[Any]],
                 after_forward: Callable[[float], None] = lambda _s: None,
                 after_backward: Callable[[], None] = lambda: None):
        self.device, self._label = device, label
        self._after_forward, self._after_backward = after_forward, after_backward
        self.start(clock())

    def start(self, now_s: float) -> None:
        """A new step begins at `now_s`."""
        self.step_start_s = self._mark_s = now_s
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.entries = dict.fromkeys(PHASES, 0)
        self.compute_cpu_s = 0.0  # thread CPU time inside forward and backward
        self.backward_end_s = now_s

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in self.seconds:
            raise ValueError(f"unknown phase {name!r}; phases: {', '.join(PHASES)}")
        cpu_start_s = time.thread_time()
        with self._label(name):
            yield
            device_sync(self.device)
        if name in COMPUTE_PHASES:
            self.compute_cpu_s += time.thread_time() - cpu_start_s
        if name == "forward":
            self._after_forward(clock() - self._mark_s)
        self._close(name)
        if name == "backward":
            self.backward_end_s = self._mark_s
            self._after_backward()

    def close_phase(self, name: str, cpu_start_s: float | None = None) -> None:
        """End phase `name` now, for a caller that sees phase boundaries as hooks rather than blocks
        (runtime/attach.py): the same device synchronisation and accounting as `phase`.
        `cpu_start_s`: the thread CPU clock when the phase began (compute phases)."""
        if name not in self.seconds:
            raise ValueError(f"unknown phase {name!r}; phases: {', '.join(PHASES)}")
        device_sync(self.device)
        if name in COMPUTE_PHASES and cpu_start_s is not None:
            self.compute_cpu_s += time.thread_time() - cpu_start_s
        self._close(name)
        if name == "backward":
            self.backward_end_s = self._mark_s
            self._after_backward()

    def _close(self, name: str) -> None:
        now = clock()
        self.seconds[name] += now - self._mark_s
        self.entries[name] += 1
        self._mark_s = now

    @property
    def end_s(self) -> float:
        """When the last phase so far ended."""
        return self._mark_s


def step_phases(timer: PhaseTimer, comm: CommStats) -> dict[str, float]:
    """The step row's breakdown of the step `timer` just timed, in seconds: data_s, forward_s,
    backward_s, comm_wait_s, optimizer_s and step_s, the five parts adding up to step_s.

    Communication the step was blocked on inside forward or backward (FSDP's all-gathers, halo
    exchanges, the wait after DDP's last bucket: `comm`'s exposed seconds) is taken out of that
    phase and counted as waiting, with the synchronize phase; forward_s and backward_s are compute.
    The loop and an attached job (runtime/attach.py) write their rows from this one split.
    """
    seconds = timer.seconds
    return {
        "data_s": seconds["data"],
        "forward_s": seconds["forward"] - comm.exposed_in_forward_s,
        "backward_s": seconds["backward"] - comm.exposed_in_backward_s,
        "comm_wait_s": comm.exposed_in_forward_s + comm.exposed_in_backward_s + seconds["synchronize"],
        "optimizer_s": seconds["optimizer"],
        "step_s": timer.end_s - timer.step_start_s,
    }
