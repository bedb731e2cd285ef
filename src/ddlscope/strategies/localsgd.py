"""The model-averaging family's runtime: localsgd, diloco, cocod.

Each step is forward, backward, the local optimizer step, then the
synchronize phase, where the models are averaged when the spec's schedule
says so. The warm-up (post-local SGD) is torch's: DDP with
`post_localSGD_hook`, which all-reduces gradients for `warmup_steps` steps
and then leaves them local. localsgd averages through torch's
PeriodicModelAverager / HierarchicalModelAverager, called directly rather
than through PostLocalSGDOptimizer so that the average is timed as
communication, not as the optimizer step it follows.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from torch.distributed.algorithms.model_averaging.averagers import ModelAverager, PeriodicModelAverager
from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import HierarchicalModelAverager
from torch.nn.parallel import DistributedDataParallel

from ddlscope.specs.strategies.localsgd import CoCoDSpec, DiLoCoSpec, LocalSGDSpec, ModelAveragingSpec
from ddlscope.strategies import RUNTIMES
from ddlscope.strategies.averaging import (
    InFlightAverage, ReplicatedModel, flat_parameters, load_flat_parameters, parameter_bytes)
from ddlscope.strategies.base import Batch, StepTimer
from ddlscope.strategies.compression import Hook, bucket_bytes, timed_hook


class ModelAveraging(ReplicatedModel):
    """Local steps, then `average(step)` in the synchronize phase; subclasses say how to average."""

    spec: ModelAveragingSpec

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.step = 0
        self.warmup: PostLocalSGDState | None = None

    def wrap(self, model: nn.Module) -> nn.Module:
        if not self.spec.warmup_steps:
            return super().wrap(model)
        self.warmup = PostLocalSGDState(process_group=self.group, subgroup=None,
                                        start_localSGD_iter=self.spec.warmup_steps,
                                        post_local_gradient_allreduce=False)
        on_cuda = self.ctx.device.type == "cuda"
        ddp = DistributedDataParallel(model, device_ids=[self.ctx.device.index] if on_cuda else None,
                                      process_group=self.group)
        ddp.register_comm_hook(self.warmup, _warmup_hook(timed_hook(post_localSGD_hook, bucket_bytes, self.comm)))
        return ddp

    def train_step(self, batch: Batch, timer: StepTimer) -> float:
        loss = self.forward_backward(batch, timer)
        assert self.model is not None and self.optimizer is not None
        with timer.phase("optimizer"):
            self.optimizer.step()
        with timer.phase("synchronize"):
            self.average(self.step)
        with timer.phase("optimizer"):  # after the average: torch's averagers skip parameters without gradients
            self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return loss.item()

    def average(self, step: int) -> None:
        raise NotImplementedError

    def checkpoint_state(self) -> dict[str, Any]:
        return {"step": self.step}

    def restore_checkpoint_state(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        if self.warmup is not None:
            self.warmup.iter = self.step


def _warmup_hook(timed: Hook) -> Hook:
    """post_localSGD_hook, timed while it all-reduces (the warm-up), untouched once it keeps gradients local."""

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects annotated hooks (see ddp.py)
        return timed(state, bucket) if state.iter < state.start_localSGD_iter else post_localSGD_hook(state, bucket)

    return hook


@RUNTIMES.register(LocalSGDSpec)
class LocalSGD(ModelAveraging):
    spec: LocalSGDSpec

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Any) -> None:
        super().attach(model, optimizer, loss_fn)
        self.averager = self._averager()
        self.compressed: CompressedAverage | None = None
        if self.spec.compression != "none":
            dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[self.spec.compression]
            self.compressed = CompressedAverage(flat_parameters(model), dtype, self.comm, self.group)

    def _averager(self) -> ModelAverager:
        spec = self.spec
        with warnings.catch_warnings():  # torch warns that period 1 is DDP's job: here it is the equivalence check
            warnings.simplefilter("ignore", UserWarning)
            if not spec.group_period:
                return PeriodicModelAverager(spec.period, spec.warmup_steps, process_group=self.group)
            return HierarchicalModelAverager({spec.group_period: self._group_ranks(), spec.period: self.ctx.workers},
                                             spec.warmup_steps, process_group=self.group)

    def _group_ranks(self) -> int:
        return self.spec.group_size or self.ctx.experiment.cluster.procs_per_node()

    def average(self, step: int) -> None:
        assert self.model is not None
        if self.compressed is not None:
            self._average_compressed(step)
            return
        who = self.spec.averages_after(step)
        self.averager.step = step  # torch's averager counts steps itself; keep it on ours (restarts)
        if who is None:
            self.averager.average_parameters(self.model.parameters())
            return
        ranks = self.ctx.workers if who == "all" else self._group_ranks()
        pending = self.comm.launched(parameter_bytes(self.model), "all_reduce", ranks)
        self.averager.average_parameters(self.model.parameters())
        self.comm.completed(pending)
        if who == "all":
            self.after_global_average()

    def after_global_average(self) -> None:
        """What follows an average across all ranks (DiLoCo's outer step)."""

    def _average_compressed(self, step: int) -> None:
        assert self.model is not None and self.compressed is not None
        if step < self.spec.warmup_steps:  # DDP's warm-up keeps the models equal: the anchor follows them
            self.compressed.anchor = flat_parameters(self.model)
            return
        if self.spec.averages_after(step) == "all":
            load_flat_parameters(self.model, self.compressed.average(flat_parameters(self.model)))
            self.after_global_average()

    def checkpoint_state(self) -> dict[str, Any]:
        state = super().checkpoint_state()
        if self.compressed is not None:
            state["average_anchor"] = self.compressed.anchor.clone()
        return state

    def restore_checkpoint_state(self, state: dict[str, Any]) -> None:
        super().restore_checkpoint_state(state)
        if self.compressed is not None and "average_anchor" in state:
            self.compressed.anchor = state["average_anchor"].clone()


class CompressedAverage:
    """A model average sent in 16 bits: each rank all-reduces its change since the last average (equal on
    every rank, the anchor), cast to fp16/bf16 and divided by the group size; the average is anchor + the
    mean change. Changes are small beside the weights, so 16 bits lose far less than casting the weights."""

    def __init__(self, anchor: torch.Tensor, dtype: torch.dtype, comm: Any, group: Any):
        self.anchor, self.dtype, self.comm, self.group = anchor, dtype, comm, group

    def average(self, flat: torch.Tensor) -> torch.Tensor:
        change = (flat - self.anchor).to(self.dtype).div_(dist.get_world_size(self.group))
        pending = self.comm.launched(change.numel() * change.element_size(), "all_reduce")
        dist.all_reduce(change, group=self.group)
        self.comm.completed(pending)
        self.anchor = self.anchor + change.to(flat.dtype)
        return self.anchor.clone()


@RUNTIMES.register(DiLoCoSpec)
class DiLoCo(LocalSGD):
    """The averaged model is a pseudo-gradient for an outer Nesterov SGD on the model of the last average."""

    spec: DiLoCoSpec

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Any) -> None:
        super().attach(model, optimizer, loss_fn)
        self.anchor = [p.detach().clone() for p in model.parameters()]
        momentum = self.spec.outer_momentum
        self.outer = torch.optim.SGD(self.anchor, lr=self.spec.outer_lr, momentum=momentum, nesterov=momentum > 0)

    def average(self, step: int) -> None:
        super().average(step)
        if step < self.spec.warmup_steps:  # warm-up steps keep the models equal: the anchor follows them
            with torch.no_grad():
                for a, p in zip(self.anchor, self.model.parameters()):
                    a.copy_(p)

    def after_global_average(self) -> None:
        with torch.no_grad():
            for a, p in zip(self.anchor, self.model.parameters()):
                a.grad = a - p  # the pseudo-gradient: where the workers went, reversed
            self.outer.step()
            for a, p in zip(self.anchor, self.model.parameters()):
                p.copy_(a)

    def checkpoint_state(self) -> dict[str, Any]:
        return {**super().checkpoint_state(), "anchor": [a.detach().clone() for a in self.anchor],
                "outer": self.outer.state_dict()}

    def restore_checkpoint_state(self, state: dict[str, Any]) -> None:
        super().restore_checkpoint_state(state)
        with torch.no_grad():
            for a, saved in zip(self.anchor, state["anchor"]):
                a.copy_(saved)
        self.outer.load_state_dict(state["outer"])


@RUNTIMES.register(CoCoDSpec)
class CoCoD(ModelAveraging):
    """The average of the model at round r's end is in flight during round r + 1; when it lands the worker
    keeps its progress since: model = average + (model - snapshot) (CoCoD-SGD's update)."""

    spec: CoCoDSpec

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.snapshot: torch.Tensor | None = None
        self.in_flight: InFlightAverage | None = None

    def average(self, step: int) -> None:
        last = step == self.ctx.experiment.workload.steps - 1
        if self.spec.averages_after(step) == "all":
            self._merge()
            self.snapshot = flat_parameters(self.model)
            self.in_flight = InFlightAverage(self.snapshot.clone(), self.comm, self.group)
            if not self.spec.overlap:
                self._merge()
        if last:  # nothing may stay in flight past the run
            self._merge()

    def _merge(self) -> None:
        if self.in_flight is None or self.snapshot is None:
            return
        averaged = self.in_flight.wait()
        progress = flat_parameters(self.model) - self.snapshot
        load_flat_parameters(self.model, averaged + progress)
        self.in_flight = None

    def checkpoint_state(self) -> dict[str, Any]:
        self._merge()  # a checkpoint holds no message in flight
        return super().checkpoint_state()


