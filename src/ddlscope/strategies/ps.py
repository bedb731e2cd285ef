"""The parameter-server family: ps-sync, ps-async, ssp, ps-stale-aware.

Written on torch.distributed point-to-point messages. The last `servers`
ranks are servers, each owning one contiguous shard of the flattened
parameters (servers=1 is the single, CPU-bound server of the main study);
the first cluster.world_size ranks are workers. Each step a worker pushes its
gradient shard to every server and pulls the new parameter shard back. The
servers' loop lives in runtime/ps_server.py; this module holds the worker
side, the message layout and each protocol's rules:

- ps-sync: a server averages one push from every worker, applies the
  optimizer once, and answers all of them: the same update as DDP.
- ps-async: every push is applied on arrival (gradient / workers, so a round
  of pushes moves the model as far as one synchronous step) and answered at
  once. With block_cyclic, a worker pushes and pulls one server's block per
  step, block (worker + step) mod servers (block-partitioned asynchronous SGD
  with momentum, PAPERS.md item 2): 1/servers of the traffic, and each block
  hears from workers / servers of them per round.
- ssp: like async, but a worker that pushed step t gets its answer only when
  every worker has pushed step t - s: nobody runs more than s steps ahead of
  the slowest. s = 0 is synchronous.
- ps-stale-aware: async, with each gradient scaled by 1 / (1 + staleness)
  (staleness-aware learning rate, Zhang et al. 2016), and a full
  synchronisation (an s = 0 barrier) every `sync_every` steps.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
from pydantic import Field
from torch import nn

from ddlscope.specs import StrategySpec, remember_spec_class
from ddlscope.strategies import STRATEGIES
from ddlscope.strategies.base import RunContext, Strategy

# Message layout: a header (int64) then, for pushes and replies, a float32 payload.
PUSH, DONE = 0, 1
HEADER_TAG, DATA_TAG = 11, 12
PUSH_HEADER = 3  # kind, worker step, server version the gradient was computed on
REPLY_HEADER = 1  # server version of the parameters sent back


def shard_ranges(numel: int, shards: int) -> list[tuple[int, int]]:
    """Contiguous, nearly equal [lo, hi) ranges covering numel elements."""
    bounds = [round(i * numel / shards) for i in range(shards + 1)]
    return list(zip(bounds, bounds[1:]))


class PSSpec(StrategySpec):
    servers: int = Field(1, ge=1, description="server ranks, each owning a shard of the parameters")

    def extra_ranks(self) -> int:
        return self.servers

    def staleness_bound(self, step: int) -> float:
        """How many steps a worker that pushed `step` may run ahead of the slowest."""
        return math.inf

    def gradient_scale(self, staleness: int) -> float:
        return 1.0

    def blocks_pushed(self, worker: int, step: int) -> list[int]:
        """The servers (indices into the server ranks) a worker pushes to and pulls from at `step`."""
        return list(range(self.servers))

    def pushes_per_round(self, workers: int) -> float:
        """Pushes one server takes in a round of one step per worker: an asynchronous push moves the
        model 1 / this as far as a synchronous step would."""
        return workers

    averages_rounds: ClassVar[bool] = False  # True: one averaged update per round (ps-sync)


class PSSyncSpec(PSSpec):
    averages_rounds: ClassVar[bool] = True
    name: Literal["ps-sync"] = "ps-sync"

    def staleness_bound(self, step: int) -> float:
        return 0


class PSAsyncSpec(PSSpec):
    name: Literal["ps-async"] = "ps-async"
    block_cyclic: bool = Field(
        False, description="each step push one server's block of the gradient and pull that block only, "
                           "block (worker + step) mod servers: 1/servers of the traffic, each block updated "
                           "asynchronously with the servers' momentum (PAPERS.md item 2)")

    def blocks_pushed(self, worker: int, step: int) -> list[int]:
        return [(worker + step) % self.servers] if self.block_cyclic else super().blocks_pushed(worker, step)

    def pushes_per_round(self, workers: int) -> float:
        # A block hears from workers / servers of them per round; never scaled up when fewer.
        return max(workers / self.servers, 1.0) if self.block_cyclic else workers


class SSPSpec(PSSpec):
    name: Literal["ssp"] = "ssp"
    staleness: int = Field(2, ge=0, description="s: how many steps a worker may run ahead of the slowest")

    def staleness_bound(self, step: int) -> float:
        return self.staleness


class StaleAwareSpec(PSSpec):
    name: Literal["ps-stale-aware"] = "ps-stale-aware"
    sync_every: int = Field(10, ge=1, description="full synchronisation of all workers every N steps")

    def staleness_bound(self, step: int) -> float:
        return 0 if (step + 1) % self.sync_every == 0 else math.inf

    def gradient_scale(self, staleness: int) -> float:
        return 1.0 / (1 + max(staleness, 0))


for _spec in (PSSyncSpec, PSAsyncSpec, SSPSpec, StaleAwareSpec):
    remember_spec_class(_spec)


class ParameterServer(Strategy):
    """Worker side of every PS protocol; servers run runtime/ps_server.py."""

    local_optimizer = False
    spec: PSSpec

    def __init__(self, spec: PSSpec, ctx: RunContext):
        super().__init__(spec, ctx)
        self.server_ranks = list(range(ctx.workers, ctx.workers + spec.servers))
        self._ranges: list[tuple[int, int]] = []
        self._versions = [0] * spec.servers
        self._step = 0

    def is_server(self) -> bool:
        return self.ctx.rank >= self.ctx.workers

    def wrap(self, model: nn.Module) -> nn.Module:
        numel = sum(p.numel() for p in model.parameters())
        self._ranges = shard_ranges(numel, self.spec.servers)
        return model

    def synchronize(self, model: nn.Module) -> None:
        params = list(model.parameters())
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        blocks = self.spec.blocks_pushed(self.ctx.rank, self._step)
        sends, receipts = [], []
        pending = self.comm.launched(sum(hi - lo for lo, hi in (self._ranges[s] for s in blocks)) * 4, "p2p")
        for s in blocks:
            server, (lo, hi) = self.server_ranks[s], self._ranges[s]
            header = torch.tensor([PUSH, self._step, self._versions[s]], dtype=torch.int64)
            sends.append(dist.isend(header, server, tag=HEADER_TAG))
            sends.append(dist.isend(_read_range(grads, lo, hi), server, tag=DATA_TAG))
            reply_header = torch.empty(REPLY_HEADER, dtype=torch.int64)
            shard = torch.empty(hi - lo, dtype=torch.float32)
            receipts.append((s, reply_header, shard, dist.irecv(reply_header, server, tag=HEADER_TAG),
                             dist.irecv(shard, server, tag=DATA_TAG)))
        for work in sends:
            work.wait()
        for s, reply_header, shard, header_work, shard_work in receipts:
            header_work.wait()
            shard_work.wait()
            self._versions[s] = int(reply_header[0])
            _write_range(params, self._ranges[s][0], shard)
        self.comm.completed(pending)
        self._step += 1

    def save_checkpoint(self, model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
        """The workers' model only: the optimizer state lives on the servers and is not saved."""
        if self.ctx.rank == 0:
            os.makedirs(path, exist_ok=True)
            torch.save(model.state_dict(), os.path.join(path, "model.pt"))

    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        return model.state_dict()

    def finish(self, model: nn.Module) -> None:
        done = torch.tensor([DONE, self._step, 0], dtype=torch.int64)
        for server in self.server_ranks:
            dist.send(done, server, tag=HEADER_TAG)


def _pieces(tensors: list[torch.Tensor], lo: int, hi: int) -> Iterator[tuple[torch.Tensor, int, int, int, int]]:
    """Elements [lo, hi) of the tensors flattened end to end, tensor by tensor: (tensor, a, b, i, j)
    where the tensor's flat elements [a, b) are the range's elements [i, j)."""
    offset = 0
    for t in tensors:
        start, end = max(lo, offset), min(hi, offset + t.numel())
        if start < end:
            yield t, start - offset, end - offset, start - lo, end - lo
        offset += t.numel()


def _read_range(tensors: list[torch.Tensor], lo: int, hi: int) -> torch.Tensor:
    """Elements lo..hi of the tensors flattened end to end, as one contiguous fp32 CPU tensor: only
    the tensors a server's shard covers are copied (a block-cyclic step sends one shard)."""
    pieces = [t.reshape(-1)[a:b] for t, a, b, _, _ in _pieces(tensors, lo, hi)]
    if not pieces:  # an empty shard (more servers than elements)
        return torch.empty(0, dtype=torch.float32)
    return torch.cat(pieces).to("cpu", torch.float32)


def _write_range(params: list[nn.Parameter], lo: int, values: torch.Tensor) -> None:
    """Copy `values` into the flattened parameters from element `lo` on (a server's shard)."""
    with torch.no_grad():
        for p, a, b, i, j in _pieces(params, lo, lo + values.numel()):
            if b - a == p.numel():  # the whole tensor, whatever its layout
                p.copy_(values[i:j].view_as(p))
            else:  # a shard boundary cuts it: a flat view (parameters are contiguous)
                p.view(-1)[a:b].copy_(values[i:j])


@STRATEGIES.register("ps-sync")
class PSSync(ParameterServer):
    spec_class = PSSyncSpec
    description = "parameter server, synchronous: average every worker's push, one update, all pull"


@STRATEGIES.register("ps-async")
class PSAsync(ParameterServer):
    spec_class = PSAsyncSpec
    description = "parameter server, asynchronous: apply each push on arrival; staleness recorded"


@STRATEGIES.register("ssp")
class SSP(ParameterServer):
    spec_class = SSPSpec
    description = "stale synchronous parallel: async, but no worker more than s steps ahead of the slowest"


@STRATEGIES.register("ps-stale-aware")
class PSStaleAware(ParameterServer):
    spec_class = StaleAwareSpec
    description = "async PS with lr / (1 + staleness) and a full synchronisation every sync_every steps"
