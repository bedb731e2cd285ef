"""`partitioned`: each rank trains one part of the network on its own loss (PAPERS.md item 20).

Rank k holds the layers of part k (the rest of the model, built from the same seed, becomes meta
tensors). A step on rank k: receive part k - 1's output for the batch (rank 0 takes the inputs), run its
layers, send the output on (detached: only activations travel, forward), then compare its output with
the batch's synthetic target and step its own optimizer. The synthetic target of part k is a fixed
random vector per class, drawn once from a generator seeded by the run seed and k (one-hot labels times
a random matrix); the last part's target is the labels, under the workload's loss. No gradient crosses
parts, so a rank's memory is its part's weights, gradients, optimizer state and activations.

Evaluation runs the parts in sequence (every rank together); the final state dict is gathered under the
single-process names. The sends go through strategies/comm.py, so their bytes are counted and an
emulated link delays them.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddlscope.specs import ConfigError, StrategySpec
from ddlscope.specs.strategies.partitioned import PartitionedSpec, even_cuts
from ddlscope.specs.strategies.pipeline import stage_ranges
from ddlscope.strategies import RUNTIMES
from ddlscope.strategies.base import Batch, Strategy, StepTimer
from ddlscope.strategies.comm import CommStats
from ddlscope.strategies.pipeline import (
    SourceLayout, StageModule, broadcast_tensor, gather_state_dict, recv_tensor, send_tensor, share_value,
    source_layers)
from ddlscope.workloads.sequential import with_parameters


def layer_sequence(model: nn.Module, workload: str | None = None) -> list[nn.Module]:
    """The model as layers applied in order: a GPT's pipeline_layers(), an nn.Sequential's modules, a
    model source's layers in forward order (workloads/sequential.py)."""
    layers = getattr(model, "pipeline_layers", None)
    if callable(layers):
        return list(layers())
    if isinstance(model, nn.Sequential):
        return list(model)
    return source_layers(model, "partitioned", workload)


def part_cuts(spec: PartitionedSpec, layers: list[nn.Module], parts: int) -> list[int]:
    """Where parts 1, 2, ... start: the spec's cut points, or an even share of the layers with parameters."""
    if spec.partition:
        if spec.partition[-1] >= len(layers):
            raise ValueError(f"strategy.partition = {spec.partition}: the model has {len(layers)} layers")
        return list(spec.partition)
    return even_cuts([i for i, layer in enumerate(layers) if any(True for _ in layer.parameters())], parts)


class PartitionedModel(nn.Module):
    """This rank's part. Called on a batch (evaluation), every rank together runs the parts in order and
    gets the output."""

    def __init__(self, part: StageModule, strategy: "Partitioned"):
        super().__init__()
        self.part = part
        self._strategy = [strategy]  # a list: not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._strategy[0].forward_all(x)


@RUNTIMES.register(PartitionedSpec)
class Partitioned(Strategy):
    spec: PartitionedSpec

    @classmethod
    def check_model(cls, spec: StrategySpec, model: nn.Module) -> None:
        assert isinstance(spec, PartitionedSpec)
        layers = layer_sequence(model, spec._workload)
        parts = spec._world_size
        if parts is None:
            return
        if spec.partition and spec.partition[-1] >= len(layers):
            raise ConfigError(f"strategy.partition = {spec.partition}: the model has {len(layers)} layers; cut "
                              f"points must be within 1..{len(layers) - 1}")
        if not spec.partition:
            even_cuts(with_parameters(layers), parts)  # a layer with parameters per part, or one line

    def wrap(self, model: nn.Module) -> nn.Module:
        layers = layer_sequence(model)
        self.parts, self.group = self.ctx.workers, self.ctx.worker_group
        self.me = dist.get_rank(self.group) if self.parts > 1 else 0
        self.ranges = stage_ranges(part_cuts(self.spec, layers, self.parts), len(layers))
        self._names = {id(t): name for name, t in model.state_dict(keep_vars=True).items()}
        self._order = list(self._names.values())
        # A weightless copy of the whole model: the shapes every part sends and receives.
        self._shapes_of = self._weightless(model, layers)
        self._shapes: dict[tuple[int, ...], list[torch.Size]] = {}
        self._targets: dict[int, torch.Tensor] = {}
        part = StageModule(layers, *self.ranges[self.me])
        kept = {id(p) for p in part.parameters()}
        lo, hi = self.ranges[self.me]
        for i, layer in enumerate(layers):  # release what other ranks hold
            if not lo <= i < hi and not any(id(p) in kept for p in layer.parameters()):
                layer.to("meta")
        self.last = self.me == self.parts - 1
        return PartitionedModel(part, self)

    def _weightless(self, model: nn.Module, layers: list[nn.Module]) -> nn.Sequential:
        """The layers on the meta device: a model source's built afresh there (a recomputing block's
        forward is bound to the original, which a deep copy would call), else a deep copy."""
        if not (callable(getattr(model, "pipeline_layers", None)) or isinstance(model, nn.Sequential)):
            layout = SourceLayout.of(self.ctx.experiment.workload)
            if layout is not None and len(layout.layers) == len(layers):
                return nn.Sequential(*layout.layers)
        return nn.Sequential(*copy.deepcopy(layers)).to("meta")

    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    # ------------------------------------------------------------------ the step
    def train_step(self, batch: Batch, timer: StepTimer) -> float:
        assert self.model is not None and self.optimizer is not None and self.loss_fn is not None
        x, y = batch
        shapes = self._part_shapes(x)
        with timer.phase("synchronize"):
            h = self._receive(shapes[self.me - 1]) if self.me > 0 else x
        with timer.phase("forward"):
            out = self.model.part(h)  # type: ignore[operator]
            sent = self._send_on(out) if not self.last else None
            loss = self.loss_fn(out, y) if self.last else self.local_loss(out, y, classes=shapes[-1][-1])
        with timer.phase("backward"):
            loss.backward()
        with timer.phase("synchronize"):
            if sent is not None:
                sent.wait()
            # the task's loss (the last part's) on every rank's step row
            value = loss.item() if self.parts == 1 else share_value(loss.item(), self._global(self.parts - 1),
                                                                    self.group)
        with timer.phase("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return value

    def local_loss(self, out: torch.Tensor, y: torch.Tensor, classes: int) -> torch.Tensor:
        """Mean squared error between the part's output and its synthetic target of the labels."""
        per_label = out.numel() // y.numel()
        target = self.synthetic_target(self.me, classes, per_label)
        return nn.functional.mse_loss(out.reshape(*y.shape, per_label), target[y])

    def synthetic_target(self, part: int, classes: int, width: int) -> torch.Tensor:
        """(classes, width): class c's fixed target vector for part `part` (one-hot labels times this
        matrix), the same on every call and every rank."""
        if part not in self._targets:
            generator = torch.Generator().manual_seed(self.ctx.experiment.seed * 1009 + part)
            self._targets[part] = self.spec.target_scale * torch.randn(classes, width, generator=generator).to(
                self.ctx.device)
        return self._targets[part]

    def _part_shapes(self, x: torch.Tensor) -> list[torch.Size]:
        """The output shape of every part for an input shaped like x (meta: no compute); the last is the
        model's output, whose last dimension is the number of classes."""
        key = tuple(x.shape)
        if key not in self._shapes:
            h, shapes = x.to("meta"), []
            for lo, hi in self.ranges:
                for layer in list(self._shapes_of)[lo:hi]:
                    h = layer(h)
                shapes.append(h.shape)
            self._shapes[key] = shapes
        return self._shapes[key]

    def _receive(self, shape: torch.Size) -> torch.Tensor:
        h = torch.empty(shape, device=self.ctx.device)
        dist.recv(h, self._global(self.me - 1), group=self.group)
        return h

    def _send_on(self, out: torch.Tensor) -> dist.Work:
        """Part k's output to part k + 1 (forward only: detached), counted and delayed by comm.py."""
        payload = out.detach().contiguous()
        work = dist.isend(payload, self._global(self.me + 1), group=self.group)
        assert work is not None
        self._in_flight = payload  # keep the buffer alive until the send completes
        return self.comm.complete_work(work, self.comm.launched(payload.numel() * payload.element_size(), "p2p", 2))

    def comm_stats(self, backward_end_s: float) -> CommStats:
        # Every wait is a synchronize phase already: nothing to take out of the compute phases.
        return self.comm.pop(0.0)

    # ------------------------------------------------------------------ the whole model
    def forward_all(self, x: torch.Tensor) -> torch.Tensor:
        """Every part in order (evaluation); the last part's rank broadcasts the output to all."""
        assert self.model is not None
        h = x if self.me == 0 else recv_tensor(self._global(self.me - 1), self.group, self.ctx.device)
        h = self.model.part(h)  # type: ignore[operator]
        if self.parts == 1:
            return h
        if not self.last:
            send_tensor(h, self._global(self.me + 1), self.group)
        return broadcast_tensor(h if self.last else None, self._global(self.parts - 1), self.group, self.ctx.device)

    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """Every rank's part under the single-process model's names (collective)."""
        return gather_state_dict([model.part], self._names, self._order, self.parts, self.group)  # type: ignore[list-item]
