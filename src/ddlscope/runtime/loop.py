"""The instrumented training loop, the same for every strategy.

Per step and rank it records wall time split into data, forward, backward
(compute, with overlapped communication hidden inside it), exposed
communication wait and optimizer; the parts add up to the step's wall time.
It also records samples, loss, bytes sent and the thread CPU time of the
compute phases (what oversubscribed ranks really got to compute). The step
itself is the strategy's `train_step`, timed through the PhaseTimer it is
handed (runtime/timer.py), so a strategy that owns its step is measured the
same way.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ddlscope.runtime.checkpoint import Checkpointer, rng_state, set_rng_state
from ddlscope.runtime.data import step_batches
from ddlscope.runtime.heartbeat import Heartbeat
from ddlscope.runtime.instrument import (
    ActivationMeter, device_sync, gradient_bytes, optimizer_state_bytes, parameter_bytes, peak_process_bytes)
from ddlscope.runtime.rows import RowWriter
from ddlscope.runtime.timer import PhaseTimer, step_phases
from ddlscope.runtime.trace import StepTracer
from ddlscope.specs import Experiment, WorkloadSpec
from ddlscope.strategies.base import RunContext, Strategy
from ddlscope.workloads.base import Task

clock = time.perf_counter


@dataclass
class LoopResult:
    steps: int
    train_s: float
    final_loss: float
    model: nn.Module
    optimizer: torch.optim.Optimizer


def make_optimizer(model: nn.Module, spec: WorkloadSpec) -> torch.optim.Optimizer:
    if spec.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    return torch.optim.SGD(model.parameters(), lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay)


def train(task: Task, strategy: Strategy, ctx: RunContext, writer: RowWriter,
          on_step: Callable[[int], None] | None = None, traces_dir: Path | None = None,
          checkpointer: Checkpointer | None = None, heartbeat: Heartbeat | None = None) -> LoopResult:
    """Train from step 0, or from the newest checkpoint when `checkpointer` finds one (a restart or a
    resume), to the workload's last step."""
    exp = ctx.experiment
    spec = exp.workload
    device = ctx.device
    model = strategy.wrap(task.model.to(device))
    for event, message in getattr(strategy, "setup_events", ()):  # what wrap decided (e.g. DDP's bucket plan)
        writer.event(event, message)
    optimizer = make_optimizer(model, spec)
    strategy.attach(model, optimizer, task.loss_fn)
    strategy.use_task(task)
    if heartbeat is not None:
        strategy.comm.on_launch = heartbeat.comm
    straggler = _Straggler(exp, ctx.rank)
    first_step = _restore(checkpointer, model, optimizer, strategy, straggler, writer)
    per_rank = exp.per_rank_batch()
    splits = exp.strategy.traits.splits_global_batch
    batches = step_batches(task, exp, ctx.rank if splits else 0, ctx.workers if splits else 1, per_rank, first_step,
                           choose=strategy.batch_indices if strategy.picks_samples() else None)
    memory_step = min(first_step + 1, spec.steps - 1)  # the first step pays one-off costs (buckets, lazy init)
    meter = ActivationMeter(model)
    memory: dict[str, int] = {"parameters": parameter_bytes(model)}
    eval_s = 0.0
    evaluator = _Evaluator(task, model, strategy, ctx, writer)
    tracer = StepTracer(exp.trace_steps, spec.steps, traces_dir, ctx.rank, device, writer)
    measuring = False

    def measure_gradients() -> None:
        if measuring:
            memory["gradients"] = gradient_bytes(model)

    def phase_label(name: str):  # type: ignore[no-untyped-def]
        if heartbeat is not None:
            heartbeat.beat(phase=name)
        return tracer.phase(name)  # a shared no-op label unless this step is traced

    timer = PhaseTimer(device, phase_label, straggler.after_forward, measure_gradients)
    loss_value = float("nan")

    writer.event("train_start", f"per_rank_batch={per_rank}")
    device_sync(device)
    start = clock()
    crash_steps = {f.step for f in exp.cluster.faults if f.rank == ctx.rank}
    away = {p.step: p.down_s for p in exp.cluster.preemptions if p.rank == ctx.rank}
    paused_s = 0.0  # checkpoints: not training time
    for step in range(first_step, spec.steps):
        if step in crash_steps and first_step == 0:  # an injected fault strikes the first attempt only
            _crash(writer, step)
        if heartbeat is not None:
            heartbeat.beat(step=step)
        if step in away:
            _preempted(strategy, step, away[step], writer, heartbeat)
        measuring = step == memory_step
        tracer.before_step(step)
        timer.start(clock())
        with timer.phase("data"):
            x, y = (t.to(device, non_blocking=True) for t in next(batches))
        with meter.measure() if measuring else nullcontext():
            loss_value = strategy.train_step((x, y), timer)
        if measuring:
            memory["activations"] = meter.bytes
            memory["activations_peak"] = meter.peak_bytes
        tracer.after_step(step)
        if measuring:
            memory["optimizer"] = optimizer_state_bytes(optimizer)

        comm = strategy.comm_stats(backward_end_s=timer.backward_end_s)
        phases = step_phases(timer, comm)
        straggler.learn(phases["backward_s"], timer.entries["forward"])
        writer.write(
            "step", step=step, t_s=timer.step_start_s - start, **phases, comm_s=comm.total_s,
            compute_cpu_s=timer.compute_cpu_s, samples=len(x), loss=loss_value, bytes_sent=comm.bytes_sent,
        )
        if on_step:
            on_step(step)
        if _eval_due(step, spec):
            eval_s += evaluator.at(step, clock() - start - eval_s - paused_s)
        if checkpointer is not None and checkpointer.enabled and checkpointer.due(step + 1):
            began = clock()
            if heartbeat is not None:
                heartbeat.beat(phase="checkpoint")
            evaluator.evaluate_snapshots()  # what a checkpoint makes durable includes the evaluations so far
            rank_state = {"rng": rng_state(), "strategy": strategy.checkpoint_state(), "straggler": straggler.state()}
            sealed = checkpointer.save(step + 1, model, optimizer, rank_state)
            writer.event("checkpoint", f"step={step + 1}" + (f" path={sealed}" if sealed else ""))
            paused_s += clock() - began

    train_s = clock() - start - eval_s - paused_s
    tracer.finish()
    strategy.finish(model)
    for event, message in strategy.final_events():
        writer.event(event, message)
    evaluator.evaluate_snapshots()
    memory.update(peak_process_bytes(device))
    writer.write("memory", bytes=memory)
    writer.event("train_end", f"train_s={train_s:.3f}")
    return LoopResult(spec.steps, train_s, loss_value, model, optimizer)


def _restore(checkpointer: Checkpointer | None, model: nn.Module, optimizer: torch.optim.Optimizer,
             strategy: Strategy, straggler: "_Straggler", writer: RowWriter) -> int:
    """Continue from the newest checkpoint, if any: the first step to run."""
    if checkpointer is None:
        return 0
    steps_done, state = checkpointer.restore(model, optimizer)
    if not steps_done:
        return 0
    set_rng_state(state["rng"])
    strategy.restore_checkpoint_state(state["strategy"])
    straggler.restore(state["straggler"])
    dropped = writer.drop_after(steps_done)
    writer.event("restored", f"from the checkpoint after step {steps_done}; {dropped} rows of later steps dropped")
    return steps_done


class _Straggler:
    """An emulated slow rank (cluster.slowdown, cluster.jitter): it computes `stretch` times slower,
    the extra time slept after each forward pass so that it shows as forward time. The backward pass
    it stands for is not known yet when it sleeps: it is the median of the last few steps' backward
    per forward pass, so a one-off slow backward (the first steps', a scheduler hiccup) does not
    stretch the next step too."""

    RECENT_STEPS = 5

    def __init__(self, exp: Experiment, rank: int):
        self.slowdown = exp.cluster.slowdown_of(rank)
        self.jitter = exp.cluster.jitter
        self.rng = random.Random(exp.seed * 7919 + rank) if self.jitter else None
        self.recent_backward_per_forward_s: list[float] = []  # none at the first step

    def state(self) -> dict[str, object]:
        return {"rng": list(self.rng.getstate()[1]) if self.rng else None,
                "rng_version": self.rng.getstate()[0] if self.rng else 0,
                "recent_backward_per_forward_s": list(self.recent_backward_per_forward_s)}

    def restore(self, state: dict[str, object]) -> None:
        if self.rng and state.get("rng") is not None:
            self.rng.setstate((state["rng_version"], tuple(state["rng"]), None))  # type: ignore[arg-type]
        self.recent_backward_per_forward_s = list(state.get("recent_backward_per_forward_s") or [])  # type: ignore[call-overload]

    def learn(self, backward_compute_s: float, forwards: int) -> None:
        """The step's backward compute, shared over its forward passes (micro-batches)."""
        recent = self.recent_backward_per_forward_s
        recent.append(backward_compute_s / max(forwards, 1))
        del recent[:-self.RECENT_STEPS]

    def after_forward(self, forward_s: float) -> None:
        """Sleep for this forward's share of the step's extra compute time, if any."""
        stretch = self.slowdown * (1 + self.jitter * self.rng.random()) if self.rng else self.slowdown
        if stretch <= 1:
            return
        recent = self.recent_backward_per_forward_s
        backward_s = statistics.median(recent) if recent else 2 * forward_s
        time.sleep((stretch - 1) * (forward_s + backward_s))


def _preempted(strategy: Strategy, step: int, down_s: float, writer: RowWriter, heartbeat: Heartbeat | None) -> None:
    """An emulated preemption (cluster.preemptions): leave, lose the model, wait, come back with the
    servers' newest one. NaN parameters make a return that forgot to pull fail loudly."""
    strategy.leave(step)
    writer.event("preempted", f"at step {step} for {down_s:g} s")
    assert strategy.model is not None
    with torch.no_grad():
        for p in strategy.model.parameters():
            p.fill_(float("nan"))
    back_at = time.monotonic() + down_s
    while (left := back_at - time.monotonic()) > 0:
        if heartbeat is not None:
            heartbeat.beat(phase="away")
        time.sleep(min(left, 0.5))
    version = strategy.rejoin(step)
    writer.event("rejoined", f"at step {step}, model version {version}")


def _crash(writer: RowWriter, step: int) -> None:
    """An injected fault: die at once, as a killed or preempted process would."""
    writer.event("fault", f"injected crash at step {step}")
    writer.close()
    os._exit(17)


def _eval_due(step: int, spec: WorkloadSpec) -> bool:
    last = step == spec.steps - 1
    return last or (spec.eval_every > 0 and (step + 1) % spec.eval_every == 0)


class _Evaluator:
    """Periodic evaluation that leaves the training timeline alone.

    Rank 0 evaluates without stopping the others: at an intermediate
    evaluation point it only snapshots the parameters, and evaluates the
    snapshots after training, with the wall time and samples of the moment
    they were taken. No barrier, so asynchronous protocols stay asynchronous
    and synchronous ones are not held up. A sharded model (collective
    forward) is evaluated by all ranks together, at once.
    """

    def __init__(self, task: Task, model: nn.Module, strategy: Strategy, ctx: RunContext, writer: RowWriter):
        self.task, self.strategy, self.ctx, self.writer = task, strategy, ctx, writer
        self.module = getattr(model, "module", model)  # DDP wraps the model
        self.snapshots: list[tuple[int, float, dict[str, torch.Tensor]]] = []

    def at(self, step: int, wall_s: float) -> float:
        """Evaluate (or snapshot) at this step; returns the seconds it took."""
        began = clock()
        last = step == self.ctx.experiment.workload.steps - 1
        if self.strategy.spec.traits.collective_forward:
            self._evaluate(step, wall_s)
            self.strategy.discard_comm_stats()
        elif self.ctx.rank == 0:
            if last:
                self._evaluate(step, wall_s)
            else:
                state = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
                self.snapshots.append((step, wall_s, state))
        return clock() - began

    def evaluate_snapshots(self) -> None:
        if not self.snapshots:
            return
        final = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        for step, wall_s, state in self.snapshots:
            self.module.load_state_dict(state)
            self._evaluate(step, wall_s)
        self.module.load_state_dict(final)
        self.snapshots = []

    def _evaluate(self, step: int, wall_s: float) -> None:
        spec = self.ctx.experiment.workload
        result = self.task.evaluate(self.module, self.ctx.device, spec.eval_batches)
        if self.ctx.rank == 0:
            self.writer.write("eval", step=step, wall_s=wall_s, samples_seen=(step + 1) * spec.batch_size,
                              metric_name=result.metric_name, metric=result.metric, loss=result.loss)
