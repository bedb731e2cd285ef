"""`nodepar`: a graph transformer's nodes split over the ranks; attention's halo on all-to-all collectives.

Node parallel (sequence parallelism for graphs): rank r owns one contiguous range of node ids (the
generated graph orders nodes by community, so a range keeps most edges inside the rank) and computes
only the rows of its nodes. Attention of node i needs the keys and values of its in-neighbours; those
another rank owns are its halo. Each layer, every rank sends the rows of its nodes that others need
and receives its halo with one `all_to_all_single` (uneven splits), through the CommRecorder so bytes
are counted and emulated networks delay them. The backward pass sends the halo's gradients back to
their owners the same way (`HaloExchange`, an autograd Function).

Parameters are replicated. Every rank takes the step's whole batch and keeps the loss of the batch
nodes it owns, scaled by their share of the batch; the gradients are then summed over the ranks
(one all-reduce), which gives exactly the single-process gradient.

`replicate` mode (what `auto` picks while the whole graph's activations fit the memory budget):
every rank computes the whole graph, keeps every world-th batch node's loss, and sums gradients the
same way. No halo traffic, but no memory saved.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ddlscope.specs.strategies.nodepar import NodeParallelSpec
from ddlscope.strategies import RUNTIMES
from ddlscope.strategies.averaging import ReplicatedModel, flat_gradients, load_flat_gradients
from ddlscope.strategies.base import Batch, StepTimer
from ddlscope.strategies.comm import CommRecorder, CommStats

clock = time.perf_counter


def partition_bounds(nodes: int, ranks: int) -> Tensor:
    """Node id ranges [bounds[r], bounds[r + 1]) per rank: contiguous, sizes differ by at most one."""
    return torch.tensor([nodes * r // ranks for r in range(ranks + 1)])


def halo_of(src: Tensor, dst: Tensor, start: int, end: int) -> Tensor:
    """Sorted global ids of the nodes outside [start, end) with an edge into a node inside it."""
    into = (dst >= start) & (dst < end)
    sources = src[into]
    return torch.unique(sources[(sources < start) | (sources >= end)])


class HaloLayout:
    """The nodes of one rank and how to fetch its halo: the `layout` a GraphTransformer computes on.

    Local ids: the owned nodes first (global id - start), then the halo in ascending global id, which
    is also ascending owner rank: the order one all-to-all delivers them in.
    """

    def __init__(self, src: Tensor, dst: Tensor, nodes: int, rank: int, ranks: int, comm: CommRecorder, group: Any):
        self.comm, self.group, self.rank = comm, group, rank
        self.bounds = partition_bounds(nodes, ranks)
        start, end = int(self.bounds[rank]), int(self.bounds[rank + 1])
        self.start, self.owned = start, torch.arange(start, end)
        owner = torch.bucketize(torch.arange(nodes), self.bounds[1:], right=True)
        halo = halo_of(src, dst, start, end)
        self.recv_counts = torch.bincount(owner[halo], minlength=ranks).tolist()
        # what each other rank needs from me: its halo's nodes that I own (every rank has the whole graph)
        wanted = [halo_of(src, dst, int(self.bounds[r]), int(self.bounds[r + 1])) for r in range(ranks)]
        mine = [w[owner[w] == rank] - start if r != rank else torch.empty(0, dtype=torch.long)
                for r, w in enumerate(wanted)]
        self.send_index = torch.cat(mine)
        self.send_counts = [len(m) for m in mine]
        local = torch.full((nodes,), -1, dtype=torch.long)
        local[self.owned] = torch.arange(end - start)
        local[halo] = torch.arange(end - start, end - start + len(halo))
        into = (dst >= start) & (dst < end)
        self.src, self.dst = local[src[into]], local[dst[into]]
        self.forward_wait_s = self.backward_wait_s = 0.0  # blocked in halo exchanges since the last pop

    def to(self, device: torch.device) -> "HaloLayout":
        if self.src.device != device:
            self.owned, self.src, self.dst, self.send_index = (
                t.to(device) for t in (self.owned, self.src, self.dst, self.send_index))
        return self

    def with_halo(self, rows: Tensor) -> Tensor:
        return HaloExchange.apply(rows, self)

    def exchange(self, send: Tensor, send_counts: list[int], recv_counts: list[int]) -> Tensor:
        """One all-to-all: rows to every rank in rank order, rows from every rank in rank order."""
        recv = send.new_empty((sum(recv_counts), send.shape[1]))
        pending = self.comm.launched(send.numel() * send.element_size(), "all_to_all")
        dist.all_to_all_single(recv, send.contiguous(), recv_counts, send_counts, group=self.group)
        self.comm.completed(pending)
        return recv

    def select(self, out: Tensor, node_ids: Tensor) -> Tensor:
        """The rows of `node_ids`: local ones directly; any other (evaluation, no gradient) from an
        all-gather of every rank's rows, so each rank can evaluate any nodes."""
        local = node_ids - self.start
        if bool(((local >= 0) & (local < len(self.owned))).all()):
            return out[local]
        if torch.is_grad_enabled() and out.requires_grad:
            raise ValueError("node-parallel: training reads only the nodes this rank owns")
        return self.gather_all(out)[node_ids]

    def gather_all(self, out: Tensor) -> Tensor:
        """Every node's rows, in global order (an all-gather; ranks' row counts differ by at most one)."""
        sizes = (self.bounds[1:] - self.bounds[:-1]).tolist()
        padded = out.new_zeros((max(sizes), *out.shape[1:]))
        padded[:len(out)] = out
        gathered = out.new_empty((len(sizes) * len(padded), *out.shape[1:]))
        pending = self.comm.launched(padded.numel() * padded.element_size(), "all_gather")
        dist.all_gather_single(gathered, padded, group=self.group)
        self.comm.completed(pending)
        rows = gathered.view(len(sizes), *padded.shape)
        return torch.cat([rows[r, :n] for r, n in enumerate(sizes)])


class HaloExchange(torch.autograd.Function):
    """rows of the owned nodes -> [owned rows; halo rows]. Backward: the halo rows' gradients go back
    to their owners (the reverse all-to-all) and are added to the owned rows' gradients."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, layout: HaloLayout) -> Tensor:  # type: ignore[override]
        ctx.layout, ctx.owned = layout, len(rows)
        began = clock()
        halo = layout.exchange(rows[layout.send_index], layout.send_counts, layout.recv_counts)
        layout.forward_wait_s += clock() - began
        return torch.cat([rows, halo])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        layout: HaloLayout = ctx.layout
        began = clock()
        returned = layout.exchange(grad[ctx.owned:], layout.recv_counts, layout.send_counts)
        layout.backward_wait_s += clock() - began
        return grad[:ctx.owned].index_add(0, layout.send_index, returned), None


@RUNTIMES.register(NodeParallelSpec)
class NodeParallel(ReplicatedModel):
    spec: NodeParallelSpec

    def wrap(self, model: nn.Module) -> nn.Module:
        model = super().wrap(model)
        self.mode = self.spec.resolved_mode(self.ctx.experiment.workload, self.ctx.workers)
        self.halo: HaloLayout | None = None
        if self.mode == "node-parallel":
            full = model.layout  # type: ignore[attr-defined]
            nodes = len(full.owned)
            self.halo = HaloLayout(full.src.cpu(), full.dst.cpu(), nodes, self.ctx.rank, self.ctx.workers, self.comm,
                                   self.group)
            model.layout = self.halo  # type: ignore[attr-defined]
        return model

    def my_batch(self, node_ids: Tensor) -> Tensor:
        """Which batch entries this rank computes the loss of: the nodes it owns, or (replicate) every
        world-th entry. A boolean mask over the batch."""
        if self.halo is None:
            return torch.arange(len(node_ids), device=node_ids.device) % self.ctx.workers == self.ctx.rank
        local = node_ids - self.halo.start
        return (local >= 0) & (local < len(self.halo.owned))

    def train_step(self, batch: Batch, timer: StepTimer) -> float:
        assert self.model is not None and self.optimizer is not None and self.loss_fn is not None
        node_ids, labels = batch
        keep = self.my_batch(node_ids)
        start = self.halo.start if self.halo is not None else 0
        with timer.phase("forward"):
            logits = self.model.node_logits()  # type: ignore[operator]
            # every rank's backward must run, even without batch nodes: its halo exchanges are collectives
            loss = logits.sum() * 0.0
            if keep.any():
                share = float(keep.sum()) / len(node_ids)  # the summed gradients are the whole batch's mean
                loss = loss + self.loss_fn(logits[node_ids[keep] - start], labels[keep]) * share
        with timer.phase("backward"):
            loss.backward()
        with timer.phase("synchronize"):
            total = self._sum_gradients_and(loss.detach())
        with timer.phase("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return total

    def _sum_gradients_and(self, loss: Tensor) -> float:
        """Sum the gradients (and the loss) over the ranks in one all-reduce; returns the batch's loss."""
        assert self.model is not None
        flat = torch.cat([flat_gradients(self.model), loss.reshape(1)])
        pending = self.comm.launched(flat.numel() * flat.element_size(), "all_reduce")
        dist.all_reduce(flat, group=self.group)
        self.comm.completed(pending)
        load_flat_gradients(self.model, flat[:-1])
        return float(flat[-1])

    def comm_stats(self, backward_end_s: float) -> CommStats:
        """The halo exchanges block: all their time is exposed, in the forward and backward phases."""
        stats = self.comm.pop(backward_end_s)
        if self.halo is not None:
            stats.exposed_in_forward_s = self.halo.forward_wait_s
            stats.exposed_in_backward_s = self.halo.backward_wait_s
            self.halo.forward_wait_s = self.halo.backward_wait_s = 0.0
        else:
            stats.exposed_in_backward_s = 0.0  # the only collective runs after backward (synchronize)
        return stats

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "resolved_mode": getattr(self, "mode", None)}

