"""The parameter-server loop, one for every PS protocol.

A server owns one shard of the flattened parameters and an optimizer over
it. It takes pushes from any worker in arrival order and lets the protocol
(the strategy's spec) decide: average a round or apply on arrival, how to
scale a stale gradient, and when a worker may have its answer (the staleness
bound). Per update it records staleness, queueing time (arrival to apply,
including emulated link time), apply time, the thread CPU time it cost, and
bytes, so a server bottleneck shows in the store.

With an emulated network the server's link is the shared one: pushes are
serialised on its receive side and answers on its send side, which is what
makes one server a bottleneck for many workers.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
from torch import nn

from ddlscope.runtime.instrument import optimizer_state_bytes, peak_process_bytes
from ddlscope.runtime.loop import make_optimizer
from ddlscope.runtime.rows import RowWriter
from ddlscope.strategies.base import RunContext
from ddlscope.strategies.comm import CommRecorder
from ddlscope.strategies.ps import DATA_TAG, DONE, HEADER_TAG, PUSH_HEADER, REPLY_HEADER, ParameterServer, shard_ranges
from ddlscope.workloads.base import Task

clock = time.perf_counter


class _Server:
    def __init__(self, task: Task, strategy: ParameterServer, ctx: RunContext, writer: RowWriter):
        self.spec = strategy.spec
        self.ctx, self.writer = ctx, writer
        self.workers = list(range(ctx.workers))
        index = ctx.rank - ctx.workers
        flat = torch.cat([p.detach().reshape(-1) for p in task.model.parameters()]).to(torch.float32)
        lo, hi = shard_ranges(flat.numel(), self.spec.servers)[index]
        self.shard = nn.Parameter(flat[lo:hi].clone())
        self.optimizer = make_optimizer(nn.ParameterList([self.shard]), ctx.experiment.workload)
        self.rx = CommRecorder(ctx.link, ranks=2)
        self.tx = CommRecorder(ctx.link, ranks=2)
        self.version = 0
        self.last_step = {w: -1 for w in self.workers}
        self.waiting: list[tuple[int, int]] = []  # (worker, step) pushed but not yet answered
        self.round_grads: dict[int, torch.Tensor] = {}  # this synchronous round's pushes, by worker
        self.seq = 0
        self.start = clock()
        self.busy_cpu_s = 0.0

    def serve(self) -> None:
        header = torch.empty(PUSH_HEADER, dtype=torch.int64)
        grad = torch.empty_like(self.shard.data)
        active = set(self.workers)
        while active or self.waiting:
            source = dist.recv(header, src=None, tag=HEADER_TAG)
            arrival = clock()
            kind, step, version_seen = (int(v) for v in header)
            if kind == DONE:
                active.discard(source)
                self.last_step[source] = math.inf  # a finished worker holds nobody back
                self._answer_ready()
                continue
            dist.recv(grad, src=source, tag=DATA_TAG)
            self.rx.completed(self.rx.launched(grad.numel() * 4, "p2p"))  # the server's link serialises pushes
            self._apply(source, step, version_seen, grad, arrival)
            self.last_step[source] = step
            self.waiting.append((source, step))
            self._answer_ready()
        self._finish()

    def _apply(self, worker: int, step: int, version_seen: int, grad: torch.Tensor, arrival: float) -> None:
        began, cpu_began = clock(), time.thread_time()
        staleness = self.version - version_seen
        if self.spec.averages_rounds:
            self.round_grads[worker] = grad.clone()
            if len(self.round_grads) == len(self.workers):
                # Summed in worker order, not arrival order: the same bits whoever arrives first.
                total = torch.stack([self.round_grads[w] for w in sorted(self.round_grads)]).sum(0)
                self._step_optimizer(total / len(self.workers))
                self.round_grads = {}
        else:
            # A round of pushes (one per worker, or per worker on this block) moves the model as far
            # as a synchronous step would.
            self._step_optimizer(grad * (self.spec.gradient_scale(staleness)
                                         / self.spec.pushes_per_round(len(self.workers))))
        apply_s, cpu_s = clock() - began, time.thread_time() - cpu_began
        self.busy_cpu_s += cpu_s
        self.writer.write("update", seq=self.seq, t_s=arrival - self.start, worker=worker, worker_step=step,
                          staleness=staleness, queue_s=began - arrival, apply_s=apply_s, cpu_s=cpu_s,
                          bytes=grad.numel() * 4)
        self.seq += 1

    def _step_optimizer(self, grad: torch.Tensor) -> None:
        self.shard.grad = grad
        self.optimizer.step()
        self.version += 1

    def _answer_ready(self) -> None:
        """Answer every waiting worker whose step the protocol's staleness bound now allows."""
        if self.spec.averages_rounds and self.round_grads:
            return  # a synchronous round is still open
        slowest = min(self.last_step.values())
        ready = [(w, s) for w, s in self.waiting if slowest >= s - self.spec.staleness_bound(s)]
        if not ready:
            return
        self.waiting = [item for item in self.waiting if item not in ready]
        reply = torch.tensor([self.version], dtype=torch.int64)
        params = self.shard.detach()
        sends = []
        for worker, _ in ready:
            self.tx.completed(self.tx.launched(params.numel() * 4, "p2p"))
            sends += [dist.isend(reply, worker, tag=HEADER_TAG), dist.isend(params, worker, tag=DATA_TAG)]
        for work in sends:
            work.wait()

    def _finish(self) -> None:
        wall_s = clock() - self.start
        self.writer.write("memory", bytes={
            "parameters": self.shard.numel() * self.shard.element_size(),
            "optimizer": optimizer_state_bytes(self.optimizer),
            **peak_process_bytes(self.ctx.device),
        })
        self.writer.event("server_end", f"wall_s={wall_s:.6f} busy_cpu_s={self.busy_cpu_s:.6f} updates={self.seq}")


def serve(task: Task, strategy: ParameterServer, ctx: RunContext, writer: RowWriter) -> None:
    writer.event("server_start", f"shard of {len(strategy.server_ranks)} server(s)")
    _Server(task, strategy, ctx, writer).serve()
