"""What every strategy's runtime class provides, and the context it runs in.

The runtime owns the training loop and its timers (runtime/loop.py). A
strategy says how the model is distributed (`wrap`), what explicit
communication follows the backward pass (`synchronize`) and what it sent
(`comm_stats`); a strategy that owns its whole step (micro-batches, local
updates, pipeline schedules) overrides `train_step`, and marks its phases on
the timer the runtime hands it, so timing and accounting stay in one place.
Its knobs and traits are its torch-free spec (ddlscope.specs.strategies).
"""

from __future__ import annotations

from abc import ABC
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
from torch import nn

from ddlscope.specs import Experiment, StrategySpec
from ddlscope.strategies.comm import CommRecorder, CommStats, LinkModel
from ddlscope.workloads.base import Task

# The step's communication of an attached job, given the ends of its backward and forward (seconds).
AttachedCommStats = Callable[[float, float], CommStats]


@dataclass
class RunContext:
    """Where this process sits in the run."""

    rank: int
    world_size: int
    local_rank: int
    node_rank: int
    device: torch.device
    backend: str
    experiment: Experiment
    link: LinkModel | None = None  # the emulated network, None for the real one
    workers: int = 0  # training ranks (world_size minus servers); 0 means all
    worker_group: Any = None  # process group of the training ranks (None: the whole world)

    def __post_init__(self) -> None:
        self.workers = self.workers or self.world_size


class StepTimer(Protocol):
    """The runtime's phase timer (runtime/timer.py): `with timer.phase("forward"): ...`.

    Phases are data, forward, backward, synchronize and optimizer; a phase may
    be entered several times a step (micro-batches) and its times add up.
    """

    def phase(self, name: str) -> AbstractContextManager[Any]: ...


Batch = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Strategy(ABC):
    def __init__(self, spec: StrategySpec, ctx: RunContext):
        self.spec = spec
        self.ctx = ctx
        self.comm = CommRecorder(ctx.link, ctx.workers)
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.loss_fn: LossFn | None = None

    @classmethod
    def check_model(cls, spec: StrategySpec, model: nn.Module) -> None:
        """Refuse, with a ConfigError of one line, a model this strategy cannot hold (given on the meta
        device, before any process starts). Most strategies hold any model."""

    def wrap(self, model: nn.Module) -> nn.Module:
        """Return the module to train (e.g. wrapped in DDP). The model is already on the device."""
        return model

    # --- a model the user wrapped (ddlscope.attach, runtime/attach.py) ---------------------------------

    @classmethod
    def wraps(cls, model: nn.Module) -> bool:
        """Whether `model` is wrapped the way this strategy wraps it (torch's DDP, FSDP2), so that an
        attached job is stored as this strategy. Asked only of the class that defines it: a subclass
        that trains differently inside the same wrapper does not claim the user's model."""
        return False

    @classmethod
    def time_attached(cls, model: nn.Module, recorder: CommRecorder) -> tuple[AttachedCommStats, str]:
        """Time the communication of a model the user wrapped as this strategy does: the step's
        communication (given when backward and forward ended), and a note when it cannot be timed."""
        return (lambda backward_end_s, _forward_end_s: recorder.pop(backward_end_s)), ""

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn) -> None:
        """What `train_step` trains: the wrapped model, its optimizer and the workload's loss."""
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn

    def use_task(self, task: Task) -> None:
        """The built workload, handed over after `attach`: for a strategy that picks its own samples (a
        federated client reads its own partition) or evaluates more than the model (per-block predictors)."""

    def picks_samples(self) -> bool:
        """Whether this rank reads other samples than its equal slice of the global batch
        (`batch_indices` overridden; then it reads the in-memory split only)."""
        return type(self).batch_indices is not Strategy.batch_indices

    def final_events(self) -> list[tuple[str, str]]:
        """(event, message) pairs the runtime records after `finish` (e.g. per-block evaluations)."""
        return []

    def train_step(self, batch: Batch, timer: StepTimer) -> float:
        """One optimizer step on this rank's batch; returns its loss.

        The default is forward, backward, `synchronize`, optimizer step. A
        strategy that owns its step overrides this and marks its phases on
        `timer`; the runtime turns them into the step's breakdown.
        """
        loss = self.forward_backward(batch, timer)
        assert self.model is not None and self.optimizer is not None
        with timer.phase("synchronize"):
            self.synchronize(self.model)
        with timer.phase("optimizer"):
            if self.spec.traits.local_optimizer:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            return loss.item()

    @staticmethod
    def kernel_backward(spec: StrategySpec) -> Callable[[nn.Module, LossFn, torch.Tensor, torch.Tensor], None] | None:
        """The gradient pass this strategy runs in place of the workload's `loss.backward()`, as
        `(model, loss_fn, x, y) -> None` leaving the gradients in `.grad`; predict-run times it with
        the workload's kernels (calibrate/facts.py). None: the plain backward."""
        return None

    def forward_backward(self, batch: Batch, timer: StepTimer) -> torch.Tensor:
        """The forward and backward passes of this rank's batch, each in its phase; returns the loss."""
        if self.model is None or self.optimizer is None or self.loss_fn is None:
            raise RuntimeError("train_step before attach(): the runtime attaches the model, optimizer and loss")
        x, y = batch
        with timer.phase("forward"):
            loss = self.loss_fn(self.model(x), y)
        with timer.phase("backward"):
            weight = self.loss_weight()
            (loss if weight == 1.0 else loss * weight).backward()
        return loss

    def batch_indices(self, sampler: Any, step: int, rank: int, per_rank: int) -> torch.Tensor:
        """The sample ids this rank trains on at `step` (runtime/data.py's GlobalBatchSampler): an equal
        slice of the global batch by default; strategies/batching.py splits it by speed and a federated
        client reads its own partition's round."""
        return sampler.rank_batch(step, rank, per_rank)

    def loss_weight(self) -> float:
        """What this rank's mean loss is multiplied by before backward: 1, or its share of a split batch
        times the workers (strategies/batching.py), so that averaging over workers stays exact."""
        return 1.0

    def synchronize(self, model: nn.Module) -> None:
        """Explicit communication after backward and before the optimizer step (none by default)."""

    def finish(self, model: nn.Module) -> None:
        """After the last step, before memory is recorded (e.g. tell servers this rank is done)."""

    def comm_stats(self, backward_end_s: float) -> CommStats:
        """Communication of the step just finished; resets the recorder for the next one."""
        return self.comm.pop(backward_end_s)

    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The whole model's parameters and buffers, as a single process would have them.

        Collective for sharded strategies: every rank must call it.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))

    def leave(self, step: int) -> None:
        """This worker is being preempted at the start of `step`: tell whoever waits on it
        (asynchronous parameter servers only; the experiment's checks refuse the others)."""
        raise NotImplementedError(f"strategy {self.spec.name} cannot lose a worker")

    def rejoin(self, step: int) -> int:
        """Back after a preemption, with the model discarded: fetch the latest one before `step`.
        Returns the model version received."""
        raise NotImplementedError(f"strategy {self.spec.name} cannot lose a worker")

    def checkpoint_state(self) -> dict[str, Any]:
        """What this rank's strategy must remember across a restart beyond the model and optimizer
        (counters, versions: plain numbers, lists and tensors). The runtime saves it with each checkpoint."""
        return {}

    def restore_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Take back what `checkpoint_state` returned, after the model and optimizer were restored."""

    def discard_comm_stats(self) -> None:
        """Forget communication outside training steps (e.g. an evaluation's all-gathers)."""
        self.comm.pop(0.0)

    def describe(self) -> dict[str, Any]:
        return self.spec.model_dump()
