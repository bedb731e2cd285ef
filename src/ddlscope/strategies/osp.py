"""`osp`: the important tensors' average at once, the rest in the background with a local stand-in.

The synchronize phase waits for the previous step's second stage (it ran
behind this step's forward and backward), picks this step's first stage from
the averaged gradients every rank holds, all-reduces it and launches the
rest. The optimizer then steps on: the first stage's average, the local
gradient for the rest, and the correction (average - local) for the part of
the previous step that just landed. At the last step the rest is awaited,
so nothing stays in flight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ddlscope.specs.strategies.osp import OSPSpec
from ddlscope.strategies import RUNTIMES
from ddlscope.strategies.averaging import InFlightAverage, Landed, ReplicatedModel
from ddlscope.strategies.base import Batch, StepTimer


@dataclass
class _SecondStage:
    tensors: list[int]  # indices into the model's parameters
    average: InFlightAverage | Landed
    local: list[torch.Tensor]  # what this rank applied meanwhile


@RUNTIMES.register(OSPSpec)
class OSP(ReplicatedModel):
    spec: OSPSpec

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.step = 0
        self.importance: list[float] | None = None  # mean |averaged gradient| per tensor, the latest known
        self.second: _SecondStage | None = None

    def train_step(self, batch: Batch, timer: StepTimer) -> float:
        loss = self.forward_backward(batch, timer)
        assert self.model is not None and self.optimizer is not None
        params = list(self.model.parameters())
        with timer.phase("synchronize"):
            grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params]
            corrections = self._land()
            applied = self._exchange(grads, last=self.step == self.ctx.experiment.workload.steps - 1)
        with timer.phase("optimizer"):
            for i, p in enumerate(params):
                p.grad = applied[i] + corrections[i] if i in corrections else applied[i]
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return loss.item()

    def _land(self) -> dict[int, torch.Tensor]:
        """Wait for the previous second stage; its corrections (average - what was applied locally)."""
        if self.second is None:
            return {}
        second, self.second = self.second, None
        averaged = _split(second.average.wait(), second.local)
        self._learn(second.tensors, averaged)
        return {i: avg - local for i, avg, local in zip(second.tensors, averaged, second.local)}

    def _exchange(self, grads: list[torch.Tensor], last: bool) -> list[torch.Tensor]:
        """The gradients to apply now: first stage averaged, the rest local (averaged at the last step)."""
        everything = list(range(len(grads)))
        first = everything if self.importance is None else self.spec.first_stage(
            self.importance, [g.numel() * g.element_size() for g in grads])
        rest = [i for i in everything if i not in set(first)]
        applied = list(grads)
        if first:
            averaged = _split(InFlightAverage(_flat(grads, first), self.comm, self.group).wait(), [grads[i] for i in first])
            self._learn(first, averaged)
            for i, avg in zip(first, averaged):
                applied[i] = avg
        if rest:
            average = InFlightAverage(_flat(grads, rest), self.comm, self.group)
            if last:  # nothing may stay in flight past the run
                for i, avg in zip(rest, _split(average.wait(), [grads[i] for i in rest])):
                    applied[i] = avg
            else:
                self.second = _SecondStage(rest, average, [grads[i] for i in rest])
        return applied

    def _learn(self, tensors: list[int], averaged: list[torch.Tensor]) -> None:
        if self.importance is None:
            self.importance = [0.0] * len(list(self.model.parameters()))  # type: ignore[union-attr]
        for i, avg in zip(tensors, averaged):
            self.importance[i] = avg.abs().mean().item()

    def checkpoint_state(self) -> dict[str, Any]:
        second = self.second
        owed = None if second is None else {"tensors": second.tensors, "average": second.average.wait(),
                                            "local": second.local}
        return {"step": self.step, "importance": self.importance, "second": owed}

    def restore_checkpoint_state(self, state: dict[str, Any]) -> None:
        self.step, self.importance = int(state["step"]), state["importance"]
        owed = state.get("second")
        self.second = None if owed is None else _SecondStage(owed["tensors"], Landed(owed["average"]), owed["local"])


def _flat(grads: list[torch.Tensor], indices: list[int]) -> torch.Tensor:
    return torch.cat([grads[i].reshape(-1) for i in indices])


def _split(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, offset = [], 0
    for t in like:
        out.append(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    return out
