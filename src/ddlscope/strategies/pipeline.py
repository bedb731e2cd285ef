"""`pipeline`: the model cut into stages on torch.distributed.pipelining, one schedule step per step.

Every rank builds the whole model from the seed, keeps the layers of its
stages (rank r holds stages r, r + p, ...: torch's looped placement) and
turns the rest into meta tensors, so its memory is its stages'. The schedule
(GPipe, 1F1B, interleaved 1F1B, interleaved zero-bubble) owns the step;
the runtime's phase timer still times it: each stage computation is a
forward or backward phase (the last stage's loss is forward), each wait for
a send or receive a synchronize phase. So a stage's step row splits into
compute (forward_s + backward_s) and idle (comm_wait_s: the bubble plus the
transfers), and its bubble fraction is idle / compute.

Evaluation and the final state dict need the whole model: a forward pass
travels the stages by hand (point-to-point, shapes sent first) and the last
stage broadcasts the logits; the state dict is gathered from every rank
under the single-process model's names.
"""

from __future__ import annotations

import statistics
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, schedules
from torch.utils.checkpoint import checkpoint

from ddlscope.specs.strategies.pipeline import PipelineSpec, stage_ranges
from ddlscope.strategies import RUNTIMES
from ddlscope.strategies.averaging import InFlightAverage, flat_gradients, load_flat_gradients
from ddlscope.strategies.base import Batch, Strategy, StepTimer
from ddlscope.strategies.comm import CommStats

SCHEDULES: dict[str, type[schedules._PipelineSchedule]] = {
    "gpipe": schedules.ScheduleGPipe,
    "1f1b": schedules.Schedule1F1B,
    "interleaved": schedules.ScheduleInterleaved1F1B,
    "zero-bubble": schedules.ScheduleInterleavedZeroBubble,
}
# The stage methods that compute, and the phase each one's time goes to.
STAGE_PHASES = {"forward_one_chunk": "forward", "backward_one_chunk": "backward",
                "backward_weight_one_chunk": "backward"}
SHAPE_SLOTS = 8  # a tensor's header: rank count, then up to 7 dimensions


def model_layers(model: nn.Module) -> list[nn.Module]:
    """The model as a sequence of layers (GPT.pipeline_layers)."""
    layers = getattr(model, "pipeline_layers", None)
    if not callable(layers):
        raise TypeError(f"{type(model).__name__} does not split into pipeline layers (no pipeline_layers())")
    return list(layers())


class StageModule(nn.Module):
    """Consecutive layers of the model; submodule names are the layers' indices, so names are unique
    across ranks."""

    def __init__(self, layers: list[nn.Module], start: int, stop: int, recompute: bool = False):
        super().__init__()
        self.start, self.recompute = start, recompute
        self.layers = nn.ModuleDict({str(i): layers[i] for i in range(start, stop)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            # keep only the input; the layers run again during this stage's backward
            return checkpoint(self._run, x, use_reentrant=False)
        return self._run(x)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x


class PipelinedModel(nn.Module):
    """This rank's stages. Called on a batch (evaluation), every rank together runs the whole model and
    gets the logits."""

    def __init__(self, stages: list[StageModule], forward_all: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self._forward_all = forward_all

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward_all(x)


@RUNTIMES.register(PipelineSpec)
class Pipeline(Strategy):
    spec: PipelineSpec

    def wrap(self, model: nn.Module) -> nn.Module:
        layers = model_layers(model)
        self.ranks = self.spec.pipeline_ranks(self.ctx.workers)
        self.group = self.ctx.worker_group
        self.dp_group: Any = None
        if self.spec.dp > 1:  # a 2-D mesh: rows are pipelines, columns the replicas of a stage
            mesh = init_device_mesh(self.ctx.device.type, (self.spec.dp, self.ranks), mesh_dim_names=("dp", "pp"))
            self.group, self.dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
            self.dp_rank = mesh["dp"].get_local_rank()
        self.me = self.ctx.rank if self.group is None else dist.get_rank(self.group)
        ranges = stage_ranges(self.spec.cuts(len(layers) - 2, self.ranks), len(layers))
        self.n_stages = len(ranges)
        self.mine = [s for s in range(self.n_stages) if self.owner(s) == self.me]
        # Names in the single-process model, to give back its state dict (parameters and buffers).
        self._names = {id(t): name for name, t in model.state_dict(keep_vars=True).items()}
        self._order = list(self._names.values())
        chunks = [StageModule(layers, *ranges[s], recompute=s in self.spec.recompute) for s in self.mine]
        kept = {id(p) for chunk in chunks for p in chunk.parameters()}
        for i, layer in enumerate(layers):  # release what other ranks hold
            if not any(lo <= i < hi for lo, hi in (ranges[s] for s in self.mine)):
                if not any(id(p) in kept for p in layer.parameters()):
                    layer.to("meta")
        self.stages = [PipelineStage(chunk, s, self.n_stages, self.ctx.device, group=self.group)
                       for chunk, s in zip(chunks, self.mine)]
        for stage in self.stages:
            self._time_stage(stage)
        self._timer: StepTimer | None = None
        return PipelinedModel(chunks, self._forward_all)

    def owner(self, stage: int) -> int:
        return stage % self.ranks

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Any) -> None:
        super().attach(model, optimizer, loss_fn)
        schedule = SCHEDULES[self.spec.schedule]
        one = self.spec.schedule in ("gpipe", "1f1b")
        self.schedule = schedule(self.stages[0] if one else self.stages, self.spec.micro_batches,
                                 loss_fn=self._timed_loss(loss_fn), scale_grads=True)

    # ------------------------------------------------------------------ the step
    def train_step(self, batch: Batch, timer: StepTimer) -> float:
        assert self.optimizer is not None
        x, y = batch
        if self.dp_group is not None:  # this replica's share of the batch
            share = len(x) // self.spec.dp
            x, y = x[self.dp_rank * share:(self.dp_rank + 1) * share], y[self.dp_rank * share:(self.dp_rank + 1) * share]
        losses: list[torch.Tensor] = []
        first, last = 0 in self.mine, self.n_stages - 1 in self.mine
        args = (x,) if first else ()
        kwargs: dict[str, Any] = {"target": y, "losses": losses} if last else {}
        with self._timed(timer):
            self.schedule.step(*args, return_outputs=False, **kwargs)
        with timer.phase("synchronize"):
            loss = self._share_loss(statistics.fmean(float(v) for v in losses) if last else 0.0)
            if self.dp_group is not None:
                loss = self._average_over_replicas(loss)
        with timer.phase("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss

    def _average_over_replicas(self, loss: float) -> float:
        """Data parallel across pipelines: each stage's gradients averaged with its replicas' (one
        all-reduce through comm.py); returns the loss averaged the same way."""
        assert self.model is not None
        flat = torch.cat([flat_gradients(self.model), torch.tensor([loss], dtype=torch.float32)])
        flat = InFlightAverage(flat, self.comm, self.dp_group).wait()
        load_flat_gradients(self.model, flat[:-1])
        return float(flat[-1])

    def _share_loss(self, value: float) -> float:
        """The last stage's loss, on every rank (each rank's step row records it)."""
        return share_value(value, self._global(self.owner(self.n_stages - 1)), self.group)

    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    @contextmanager
    def _timed(self, timer: StepTimer) -> Iterator[None]:
        """Route the schedule's computations and waits to the timer's phases for one step.

        torch's schedules wait on their sends and receives through the module function
        `_wait_batch_p2p` and post them through `_batch_p2p`; swapping both for the step is the one
        place to see every wait and every message. One thread runs the schedule, so the swap is safe.
        """
        wait, post = schedules._wait_batch_p2p, schedules._batch_p2p

        def timed_wait(work: list[dist.Work]) -> None:
            with timer.phase("synchronize"):
                wait(work)

        def counted_post(ops: list[dist.P2POp], desc: str | None = None) -> list[dist.Work]:
            works = post(ops, desc)
            if len(works) != len(ops):
                return works
            return [self.comm.complete_work(w, self.comm.launched(op.tensor.numel() * op.tensor.element_size(),
                                                                  "p2p", 2))
                    if op.op is dist.isend else w for op, w in zip(ops, works)]

        schedules._wait_batch_p2p, schedules._batch_p2p = timed_wait, counted_post
        self._timer = timer
        try:
            yield
        finally:
            schedules._wait_batch_p2p, schedules._batch_p2p = wait, post
            self._timer = None

    def _time_stage(self, stage: PipelineStage) -> None:
        for method, phase in STAGE_PHASES.items():
            setattr(stage, method, self._in_phase(getattr(stage, method), phase))

    def _timed_loss(self, loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        return self._in_phase(loss_fn, "forward")  # the last stage's loss is part of its forward

    def _in_phase(self, fn: Callable[..., Any], phase: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._timer is None:
                return fn(*args, **kwargs)
            with self._timer.phase(phase):
                return fn(*args, **kwargs)

        return timed

    def comm_stats(self, backward_end_s: float) -> CommStats:
        # Every wait is a synchronize phase already: nothing to take out of the compute phases.
        return self.comm.pop(0.0)

    # ------------------------------------------------------------------ the whole model
    def _forward_all(self, x: torch.Tensor) -> torch.Tensor:
        """Forward through every stage in order (evaluation: no schedule, no micro-batches); the last
        stage broadcasts the output so every rank returns it."""
        local = {s: chunk for s, chunk in zip(self.mine, self.model.stages)}  # type: ignore[union-attr]
        h = x
        for s in range(self.n_stages):
            if self.owner(s) != self.me:
                continue
            if s > 0 and self.owner(s - 1) != self.me:
                h = self._recv(self.owner(s - 1))
            h = local[s](h)
            if s < self.n_stages - 1 and self.owner(s + 1) != self.me:
                self._send(h, self.owner(s + 1))
        return self._broadcast(h if self.n_stages - 1 in self.mine else None, self.owner(self.n_stages - 1))

    def _send(self, t: torch.Tensor, to: int) -> None:
        send_tensor(t, self._global(to), self.group)

    def _recv(self, frm: int) -> torch.Tensor:
        return recv_tensor(self._global(frm), self.group, self.ctx.device)

    def _broadcast(self, t: torch.Tensor | None, src: int) -> torch.Tensor:
        return broadcast_tensor(t, self._global(src), self.group, self.ctx.device)

    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """Every rank's parameters and buffers under the single-process model's names (collective)."""
        return gather_state_dict(list(model.stages), self._names, self._order, self.ranks,  # type: ignore[arg-type]
                                 self.group)


def gather_state_dict(modules: list[nn.Module], names: dict[int, str], order: list[str], ranks: int,
                      group: Any = None) -> dict[str, torch.Tensor]:
    """The whole model's state dict from the parts each rank holds (collective): `names` maps a tensor's
    id to its name in the single-process model, `order` is that model's order."""
    mine = {names[id(t)]: t.detach().cpu() for module in modules for t in module.state_dict(keep_vars=True).values()}
    parts: list[dict[str, torch.Tensor]] = [mine] if ranks == 1 else [{} for _ in range(ranks)]
    if ranks > 1:
        dist.all_gather_object(parts, mine, group=group)
    merged = {k: v for part in parts for k, v in part.items()}
    return {name: merged[name] for name in order if name in merged}


def share_value(value: float, src: int, group: Any = None) -> float:
    """Global rank `src`'s number on every rank (e.g. the last stage's loss, for every rank's step row)."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.broadcast(t, src=src, group=group)
    return float(t.item())


def send_tensor(t: torch.Tensor, dst: int, group: Any = None) -> None:
    """A tensor of any shape to global rank `dst`: its shape first (outside a schedule: evaluation)."""
    dist.send(_header(t), dst, group=group)
    dist.send(t.contiguous(), dst, group=group)


def recv_tensor(src: int, group: Any, device: torch.device) -> torch.Tensor:
    """What `send_tensor` sent from global rank `src`."""
    header = torch.zeros(SHAPE_SLOTS, dtype=torch.int64)
    dist.recv(header, src, group=group)
    t = torch.empty(_shape(header), device=device)
    dist.recv(t, src, group=group)
    return t


def broadcast_tensor(t: torch.Tensor | None, src: int, group: Any, device: torch.device) -> torch.Tensor:
    """Global rank `src`'s tensor (given there, None elsewhere) on every rank of `group`."""
    header = _header(t) if t is not None else torch.zeros(SHAPE_SLOTS, dtype=torch.int64)
    dist.broadcast(header, src, group=group)
    out = t.contiguous() if t is not None else torch.empty(_shape(header), device=device)
    dist.broadcast(out, src, group=group)
    return out


def _header(t: torch.Tensor) -> torch.Tensor:
    if t.dim() >= SHAPE_SLOTS:
        raise ValueError(f"a {t.dim()}-dimensional activation does not fit the {SHAPE_SLOTS}-slot header")
    return torch.tensor([t.dim(), *t.shape] + [0] * (SHAPE_SLOTS - 1 - t.dim()), dtype=torch.int64)


def _shape(header: torch.Tensor) -> list[int]:
    ndim = int(header[0])
    return [int(d) for d in header[1:1 + ndim]]
