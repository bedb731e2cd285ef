"""The parameter-server family: ps-sync, ps-async, ssp, ps-stale-aware.

Written on torch.distributed point-to-point messages. The last `servers`
ranks are servers, each owning one contiguous shard of the flattened
parameters (servers=1 is the single, CPU-bound server of the main study);
the first cluster.world_size ranks are workers. Each step a worker pushes its
gradient shard to every server and pulls the new parameter shard back. The
servers' loop lives in runtime/ps_server.py; this module holds the worker
side and the message layout. Each protocol's rules (who may run ahead, how a
stale gradient is scaled, which blocks a worker exchanges) are methods of its
spec, in specs/strategies/ps.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddlscope.specs.strategies.ps import PSSpec
from ddlscope.strategies import RUNTIMES
from ddlscope.strategies.base import RunContext
from ddlscope.strategies.batching import SplitBatch

# Message layout: a header (int64) then, for pushes and replies, a float32 payload.
PUSH, DONE, LEAVE, JOIN = 0, 1, 2, 3
HEADER_TAG, DATA_TAG = 11, 12
PUSH_HEADER = 3  # kind, worker step, server version the gradient was computed on
REPLY_HEADER = 1  # server version of the parameters sent back


def shard_ranges(numel: int, shards: int) -> list[tuple[int, int]]:
    """Contiguous, nearly equal [lo, hi) ranges covering numel elements."""
    bounds = [round(i * numel / shards) for i in range(shards + 1)]
    return list(zip(bounds, bounds[1:]))


@RUNTIMES.register(PSSpec)
class ParameterServer(SplitBatch):  # batch_split: strategies/batching.py
    """Worker side of every PS protocol; servers run runtime/ps_server.py."""

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

    def leave(self, step: int) -> None:
        """Preempted: every server stops waiting for this worker (it holds nobody back meanwhile)."""
        for server in self.server_ranks:
            dist.send(torch.tensor([LEAVE, step, 0], dtype=torch.int64), server, tag=HEADER_TAG)

    def rejoin(self, step: int) -> int:
        """Back: every server sends its newest shard, which replaces the discarded model."""
        assert self.model is not None
        params = list(self.model.parameters())
        for s, server in enumerate(self.server_ranks):
            dist.send(torch.tensor([JOIN, step, 0], dtype=torch.int64), server, tag=HEADER_TAG)
            lo, hi = self._ranges[s]
            reply_header, shard = torch.empty(REPLY_HEADER, dtype=torch.int64), torch.empty(hi - lo)
            dist.recv(reply_header, server, tag=HEADER_TAG)
            dist.recv(shard, server, tag=DATA_TAG)
            self._versions[s] = int(reply_header[0])
            _write_range(params, lo, shard)
        return sum(self._versions)

    def checkpoint_state(self) -> dict[str, Any]:
        return {"versions": list(self._versions), "step": self._step}

    def restore_checkpoint_state(self, state: dict[str, Any]) -> None:
        self._versions, self._step = list(state["versions"]), int(state["step"])

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
