"""Mechanics the model-averaging and stale-gradient strategies share.

Starting every worker from rank 0's model, a model or its gradients as one
flat tensor, and a non-blocking average of a flat tensor that is accounted
(and, on an emulated network, delayed) by the strategy's CommRecorder like
every other message. The strategies decide when to launch and when to wait.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddlscope.strategies.base import Strategy
from ddlscope.strategies.comm import CommRecorder


class ReplicatedModel(Strategy):
    """A strategy whose workers each hold the whole model and exchange it (or its gradients) themselves:
    they start from rank 0's model, and talk within the training ranks' group."""

    @property
    def group(self) -> Any:
        return self.ctx.worker_group if self.ctx.worker_group is not None else dist.group.WORLD

    def wrap(self, model: nn.Module) -> nn.Module:
        broadcast_model(model, self.group)
        return model


def broadcast_model(model: nn.Module, group: Any) -> None:
    """Every rank starts from rank 0's parameters and buffers (what DDP's constructor does)."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=src, group=group)


def parameter_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def flat_parameters(model: nn.Module) -> torch.Tensor:
    """A copy of the parameters as one flat tensor."""
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


def load_flat_parameters(model: nn.Module, flat: torch.Tensor) -> None:
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(flat, model.parameters())


def flat_gradients(model: nn.Module) -> torch.Tensor:
    """The gradients as one new flat tensor (zeros for a parameter that got none)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in model.parameters()])


def load_flat_gradients(model: nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    for p in model.parameters():
        p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()


class InFlightAverage:
    """The mean of `tensor` over the group, computed in place by a non-blocking all-reduce.

    The tensor is divided by the group size before the sum (gloo has no AVG),
    as torch's model averaging does. `wait()` returns it averaged; until then
    the caller must not touch it.
    """

    def __init__(self, tensor: torch.Tensor, comm: CommRecorder, group: Any):
        self.tensor = tensor
        members = dist.get_world_size(group)
        tensor.div_(members)
        # The group's size prices the wire (a subgroup's all-reduce moves less than the workers' one).
        pending = comm.launched(tensor.numel() * tensor.element_size(), "all_reduce", ranks=members)
        self._work = comm.complete_work(dist.all_reduce(tensor, group=group, async_op=True), pending)

    def wait(self) -> torch.Tensor:
        self._work.wait()
        return self.tensor


class Landed:
    """An average that has arrived already (kept in a checkpoint): waits for nothing."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def wait(self) -> torch.Tensor:
        return self.tensor


def weighted_sum(flat: torch.Tensor, weight: float, comm: CommRecorder, group: Any) -> torch.Tensor:
    """Sum over the group of each rank's `weight` x `flat`, by one accounted all-reduce: the weighted mean
    when the weights sum to 1 over the group (federated averaging's n_k / n, known to every rank). A
    weight of 1 (one client) or 1/2 (two equal ones) keeps the values exact."""
    buffer = flat * weight
    pending = comm.launched(buffer.numel() * buffer.element_size(), "all_reduce")
    dist.all_reduce(buffer, group=group)
    comm.completed(pending)
    return buffer
