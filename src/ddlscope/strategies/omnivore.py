"""`omnivore`'s workers: a synchronous compute group in front of the asynchronous parameter server.

Each step the members of a group average their gradients by one all-reduce
inside the group (strategies/averaging.py: accounted and emulated like every
message); the group's leader pushes that mean to the servers and pulls the
model exactly as a ps-async worker does (strategies/ps.py), then broadcasts
the model inside the group. The servers run the one server loop
(runtime/ps_server.py), hearing only from the leaders (OmnivoreSpec.pushers).
A group of one rank skips both collectives: it is a ps-async worker.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from ddlscope.specs.strategies.omnivore import OmnivoreSpec, group_members
from ddlscope.strategies import RUNTIMES
from ddlscope.strategies.averaging import (InFlightAverage, flat_gradients, flat_parameters, load_flat_gradients,
                                           load_flat_parameters)
from ddlscope.strategies.base import RunContext
from ddlscope.strategies.ps import ParameterServer


@RUNTIMES.register(OmnivoreSpec)
class Omnivore(ParameterServer):
    spec: OmnivoreSpec

    def __init__(self, spec: OmnivoreSpec, ctx: RunContext):
        super().__init__(spec, ctx)
        groups = group_members(ctx.workers, spec.groups)
        self.members = next((g for g in groups if ctx.rank in g), [])  # empty on a server
        self.leader = self.members[0] if self.members else -1
        self.group = self._make_group(groups)

    def _make_group(self, groups: list[list[int]]) -> Any:
        """This rank's group's process group (None for a group of one, and on a server). new_group is
        collective over the whole world, servers included, so every rank builds every group, in order."""
        size = len(groups[0])
        if size == 1:
            return None
        if size == self.ctx.workers:  # one group: the training ranks' own group
            return self.ctx.worker_group if self.ctx.worker_group is not None else dist.group.WORLD
        mine = None
        for ranks in groups:
            made = dist.new_group(ranks)
            if self.ctx.rank in ranks:
                mine = made
        return mine

    def is_leader(self) -> bool:
        return self.ctx.rank == self.leader

    def synchronize(self, model: nn.Module) -> None:
        if self.group is None:  # a group of one: a ps-async worker
            super().synchronize(model)
            return
        mean = InFlightAverage(flat_gradients(model), self.comm, self.group).wait()
        if self.is_leader():
            load_flat_gradients(model, mean)
            super().synchronize(model)  # push the group's mean, pull the model
        self._broadcast_model(model)

    def _broadcast_model(self, model: nn.Module) -> None:
        """The model the leader pulled, to every member of its group."""
        flat = flat_parameters(model)
        pending = self.comm.launched(flat.numel() * flat.element_size(), "broadcast", ranks=len(self.members))
        dist.broadcast(flat, src=self.leader, group=self.group)
        self.comm.completed(pending)
        if not self.is_leader():
            load_flat_parameters(model, flat)

    def finish(self, model: nn.Module) -> None:
        if self.is_leader() or self.group is None:
            super().finish(model)  # only pushers tell the servers they are done
