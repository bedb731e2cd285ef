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

from ddlscope.runtime.checkpoint import Checkpointer, latest_checkpoint, load_trusted, partial_dir, write_atomically
from ddlscope.runtime.heartbeat import Heartbeat
from ddlscope.runtime.instrument import optimizer_state_bytes, peak_process_bytes
from ddlscope.runtime.loop import make_optimizer
from ddlscope.runtime.rows import RowWriter
from ddlscope.strategies.base import RunContext
from ddlscope.strategies.comm import CommRecorder
from ddlscope.strategies.ps import (DATA_TAG, DONE, HEADER_TAG, JOIN, LEAVE, PUSH_HEADER, REPLY_HEADER,
                                    ParameterServer, shard_ranges)
from ddlscope.workloads.base import Task

clock = time.perf_counter


class _Server:
    def __init__(self, task: Task, strategy: ParameterServer, ctx: RunContext, writer: RowWriter,
                 checkpointer: Checkpointer | None = None, heartbeat: Heartbeat | None = None):
        self.spec = strategy.spec
        self.ctx, self.writer, self.checkpointer, self.heartbeat = ctx, writer, checkpointer, heartbeat
        self.workers = self.spec.pushers(ctx.workers)  # the ranks whose pushes and DONE it waits for
        self.index = index = ctx.rank - ctx.workers
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
        self.next_checkpoint = self._first_checkpoint()  # steps done at the next checkpoint (None: none)
        self._restore()

    def serve(self) -> None:
        header = torch.empty(PUSH_HEADER, dtype=torch.int64)
        grad = torch.empty_like(self.shard.data)
        active = set(self.workers)
        while active or self.waiting:
            if self.heartbeat is not None:
                self.heartbeat.beat(phase="serve")
            source = dist.recv(header, src=None, tag=HEADER_TAG)
            arrival = clock()
            kind, step, version_seen = (int(v) for v in header)
            if kind == DONE:
                active.discard(source)
                self.last_step[source] = math.inf  # a finished worker holds nobody back
                self._answer_ready()
                continue
            if kind == LEAVE:  # preempted: holds nobody back while away, and stays expected
                self.last_step[source] = math.inf
                self.writer.event("worker_left", f"worker={source} step={step} version={self.version}")
                self._answer_ready()
                continue
            if kind == JOIN:  # back, with nothing: it pulls the newest shard before its next push
                self.last_step[source] = step - 1
                self._send_params([source])
                self.writer.event("worker_joined", f"worker={source} step={step} version={self.version}")
                continue
            dist.recv(grad, src=source, tag=DATA_TAG)
            self.rx.completed(self.rx.launched(grad.numel() * 4, "p2p"))  # the server's link serialises pushes
            if self.spec.answers_before_apply():  # lock-free: the worker reads without waiting for the update
                self.last_step[source] = step
                self._send_params([source])
                self._apply(source, step, version_seen, grad, arrival)
                continue
            self._apply(source, step, version_seen, grad, arrival)
            self.last_step[source] = step
            self.waiting.append((source, step))
            self._checkpoint_if_due()
            self._answer_ready()
        self._finish()

    # -- checkpoints: the servers' part (runtime/checkpoint.py has the layout and the workers' part)
    def _first_checkpoint(self) -> int | None:
        every = self.ctx.experiment.checkpoint_every
        return every if every and every < self.ctx.experiment.workload.steps else self._final_checkpoint()

    def _final_checkpoint(self) -> int | None:
        final = self.checkpointer is not None and self.checkpointer.final
        return self.ctx.experiment.workload.steps if final else None

    def _checkpoint_if_due(self) -> None:
        """Once every worker has pushed the last step before a checkpoint (and, for a synchronous
        protocol, its round is applied), save this server's state. `_answer_ready` holds every answer
        to that step until then, so no worker runs ahead of the cut: the state saved is exactly the
        one the workers' checkpoint continues from, for asynchronous protocols too (a checkpoint
        costs them one barrier)."""
        while (self.checkpointer is not None and self.next_checkpoint is not None
               and min(self.last_step.values()) >= self.next_checkpoint - 1 and not self.round_grads):
            steps_done = self.next_checkpoint
            folder = partial_dir(self.checkpointer.root, steps_done)
            folder.mkdir(parents=True, exist_ok=True)
            write_atomically(folder / f"server-{self.index}.pt", {
                "step": steps_done, "shard": self.shard.detach().clone(), "optimizer": self.optimizer.state_dict(),
                "version": self.version, "seq": self.seq, "busy_cpu_s": self.busy_cpu_s})
            every = self.ctx.experiment.checkpoint_every
            following = steps_done + every if every else None
            steps = self.ctx.experiment.workload.steps
            self.next_checkpoint = following if following is not None and following < steps \
                else (self._final_checkpoint() if steps_done < steps else None)

    def _held_for_checkpoint(self, step: int) -> bool:
        return self.next_checkpoint is not None and step == self.next_checkpoint - 1 \
            and self.checkpointer is not None

    def _restore(self) -> None:
        if self.checkpointer is None:
            return
        found = latest_checkpoint(self.checkpointer.root, self.ctx.experiment, key=self.checkpointer.key or None)
        if found is None:
            return
        state = load_trusted(found.folder / f"server-{self.index}.pt")
        with torch.no_grad():
            self.shard.copy_(state["shard"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version, self.seq, self.busy_cpu_s = int(state["version"]), int(state["seq"]), float(state["busy_cpu_s"])
        self.last_step = {w: found.step - 1 for w in self.workers}
        while self.next_checkpoint is not None and self.next_checkpoint <= found.step:
            self.next_checkpoint = self.next_checkpoint + self.ctx.experiment.checkpoint_every \
                if self.ctx.experiment.checkpoint_every else None
            if self.next_checkpoint is not None and self.next_checkpoint >= self.ctx.experiment.workload.steps:
                self.next_checkpoint = self._final_checkpoint()
        dropped = self.writer.drop_after(found.step, update_seq=self.seq)
        self.writer.event("restored", f"server {self.index} from the checkpoint after step {found.step}; "
                                      f"{dropped} later update rows dropped")

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
        ready = [(w, s) for w, s in self.waiting
                 if slowest >= s - (0 if self._held_for_checkpoint(s) else self.spec.staleness_bound(s))]
        if not ready:
            return
        self.waiting = [item for item in self.waiting if item not in ready]
        self._send_params([worker for worker, _ in ready])

    def _send_params(self, workers: list[int]) -> None:
        """The current version and shard to each of `workers`."""
        reply = torch.tensor([self.version], dtype=torch.int64)
        params = self.shard.detach()
        sends = []
        for worker in workers:
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


def serve(task: Task, strategy: ParameterServer, ctx: RunContext, writer: RowWriter,
          checkpointer: Checkpointer | None = None, heartbeat: Heartbeat | None = None) -> None:
    writer.event("server_start", f"shard of {len(strategy.server_ranks)} server(s)")
    _Server(task, strategy, ctx, writer, checkpointer, heartbeat).serve()
