"""`gossip`: local step, then one exchange of parameters with each neighbour (torch point-to-point).

All sends and receives of a step go out together through
`dist.batch_isend_irecv`; each message is accounted (and, on an emulated
network, delayed) as a point-to-point message of the model's bytes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddlscope.specs.strategies.gossip import GossipSpec
from ddlscope.strategies import RUNTIMES
from ddlscope.strategies.averaging import ReplicatedModel, flat_parameters, load_flat_parameters
from ddlscope.strategies.base import Batch, StepTimer


@RUNTIMES.register(GossipSpec)
class Gossip(ReplicatedModel):
    spec: GossipSpec

    def wrap(self, model: nn.Module) -> nn.Module:
        self.peers = self.spec.neighbours(self.ctx.rank, self.ctx.workers)
        return super().wrap(model)

    def train_step(self, batch: Batch, timer: StepTimer) -> float:
        loss = self.forward_backward(batch, timer)
        assert self.model is not None and self.optimizer is not None
        with timer.phase("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        with timer.phase("synchronize"):
            self._mix()
        return loss.item()

    def _mix(self) -> None:
        """This rank's model becomes the mean of its own and its neighbours'."""
        assert self.model is not None
        mine = flat_parameters(self.model)
        received = [torch.empty_like(mine) for _ in self.peers]
        ops = [dist.P2POp(dist.isend, mine, peer, self.group) for peer in self.peers]
        ops += [dist.P2POp(dist.irecv, buf, peer, self.group) for buf, peer in zip(received, self.peers)]
        pending = [self.comm.launched(mine.numel() * mine.element_size(), "p2p") for _ in self.peers]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        for message in pending:
            self.comm.completed(message)
        load_flat_parameters(self.model, torch.stack([mine, *received]).mean(dim=0))
