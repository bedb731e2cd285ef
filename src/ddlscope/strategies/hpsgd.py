"""`hpsgd`: each step launches its gradient's average and applies the one launched `staleness` steps ago.

The all-reduce runs on gloo's thread while the next steps' forward and
backward compute; the synchronize phase is only the wait for the average
that is due, which is what stays exposed.
"""

from __future__ import annotations

from collections import deque
from typing import Any


from ddlscope.specs.strategies.hpsgd import HPSGDSpec
from ddlscope.strategies import RUNTIMES
from ddlscope.strategies.averaging import (
    InFlightAverage, Landed, ReplicatedModel, flat_gradients, load_flat_gradients)
from ddlscope.strategies.base import Batch, StepTimer


@RUNTIMES.register(HPSGDSpec)
class HPSGD(ReplicatedModel):
    spec: HPSGDSpec

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.step = 0
        self.in_flight: deque[tuple[int, InFlightAverage | Landed]] = deque()

    def train_step(self, batch: Batch, timer: StepTimer) -> float:
        loss = self.forward_backward(batch, timer)
        assert self.model is not None and self.optimizer is not None
        with timer.phase("synchronize"):
            self.in_flight.append((self.step, InFlightAverage(flat_gradients(self.model), self.comm, self.group)))
            due = self.spec.applies_after(self.step, self.ctx.experiment.workload.steps - 1)
            averages = [self._pop(step).wait() for step in due]
        with timer.phase("optimizer"):
            for averaged in averages:
                load_flat_gradients(self.model, averaged)
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return loss.item()

    def _pop(self, step: int) -> InFlightAverage | Landed:
        launched, average = self.in_flight.popleft()
        assert launched == step, f"hpsgd applies step {step}'s average but the oldest in flight is step {launched}'s"
        return average

    def checkpoint_state(self) -> dict[str, Any]:
        # A checkpoint between steps keeps the averages still owed: they are plain tensors once waited for.
        return {"step": self.step, "owed": [(s, a.wait()) for s, a in self.in_flight]}

    def restore_checkpoint_state(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.in_flight = deque((int(s), Landed(t)) for s, t in state["owed"])  # type: ignore[misc]
