"""`pipeline`: the model cut into stages on torch.distributed.pipelining, one schedule step per step.

The model is a sequence of layers: a GPT's `pipeline_layers()`, or a model
source's layers as its forward applies them (workloads/sequential.py:
torchvision/timm chains traced by torch.fx, Hugging Face decoders cut into
embedding, decoder layers and norm + head). A source's default cut balances
the layers' forward FLOPs over the stages (counted on the meta device), and
starts a stage only at a layer with parameters.

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

from ddlscope.specs import ConfigError, StrategySpec
from ddlscope.specs.strategies.pipeline import PipelineSpec, check_cuts, stage_ranges
from ddlscope.strategies import RUNTIMES
from ddlscope.strategies.averaging import InFlightAverage, flat_gradients, load_flat_gradients
from ddlscope.strategies.base import Batch, Strategy, StepTimer
from ddlscope.strategies.comm import CommStats
from ddlscope.workloads.sequential import (
    NotAChain, balanced_cuts, layer_flops, shared_parameters, split_layers, with_parameters)

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
    """The model as a sequence of layers (GPT.pipeline_layers, or a source's: workloads/sequential.py)."""
    layers = getattr(model, "pipeline_layers", None)
    if callable(layers):
        return list(layers())
    return source_layers(model, "pipeline")


def source_layers(model: nn.Module, strategy: str, workload: str | None = None) -> list[nn.Module]:
    """A model source's layers in order; a ConfigError of one line where its forward is not a chain or
    two layers share parameters (stages apart, each would train its own copy)."""
    what = f"workload.name = {workload!r}" if workload else type(model).__name__
    try:
        layers = split_layers(model)
    except NotAChain as reason:
        raise ConfigError(f"{what}: strategy {strategy} cuts a model into layers applied in order; "
                          f"{reason}") from None
    shared = shared_parameters(layers)
    if shared:
        parameter, first, second = shared[0]
        name = next((n for n, p in model.named_parameters() if p is parameter), "a parameter")
        raise ConfigError(f"{what}: layers {first} and {second} of its sequence share {name} (tied weights); "
                          f"strategy {strategy} would train a copy in each stage; use a model without tied weights")
    return layers


class SourceLayout:
    """A model source's layers on the meta device, with a sample of its input: where to cut (forward
    FLOPs per layer) and what crosses each cut (shapes, dtypes), with no compute and no memory.

    The copy is the workload's own meta model, built afresh rather than deep-copied: a block that
    recomputes (workload.recompute) holds a forward bound to the original block, which a copy would
    call on the original's weights."""

    def __init__(self, layers: list[nn.Module], sample: torch.Tensor):
        self.layers, self.sample = layers, sample

    @classmethod
    def of(cls, workload: Any) -> "SourceLayout | None":
        """The layout of a model source's spec; None where its model cannot run on the meta device."""
        from ddlscope.workloads import WORKLOADS
        from ddlscope.workloads.sources import example_input

        model = WORKLOADS.get(workload.name).meta_model(workload)
        if model is None:
            return None
        try:
            layers = split_layers(model.to("meta"))
        except NotAChain:  # check_model refused it before launch; nothing to lay out here
            return None
        for inputs in (None, "tokens"):  # a module: source may take images or token ids
            try:
                # two samples: a batch norm in training mode refuses one sample at 1x1
                sample = example_input(workload, 2, "meta", inputs)
                with torch.no_grad():
                    _through(layers, sample)
                return cls(layers, sample)
            except Exception:  # noqa: BLE001 (not this input kind)
                continue
        return None

    def costs(self) -> list[float]:
        """Forward FLOPs of each layer on the sample (two inputs: only their ratios matter)."""
        return layer_flops(self.layers, self.sample)

    def flows(self, ranges: list[tuple[int, int]], micro_batch: int) -> list[torch.Tensor]:
        """The tensor entering each stage, then the model's output, for one micro-batch (meta: shapes,
        dtypes and whether each needs a gradient)."""
        h = self.sample[:1].expand(micro_batch, *self.sample.shape[1:])
        flows = [h]
        # With autograd on: an output that needs a gradient tells torch to receive one for it in backward.
        with torch.enable_grad():
            for lo, hi in ranges:
                h = _through(self.layers[lo:hi], h)
                flows.append(h.detach().requires_grad_(h.requires_grad))
        return flows


def _through(layers: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


def source_cuts(spec: PipelineSpec, layers: list[nn.Module], stages: int, layout: SourceLayout | None) -> list[int]:
    """Where a source's stages start: the spec's partition, else the cut that balances forward FLOPs
    (parameter counts where the model cannot run on meta), starting stages only at layers with
    parameters (never at a parameterless op, e.g. an activation)."""
    if spec.partition:
        return list(spec.partition)
    try:
        costs = layout.costs() if layout is not None else None
    except Exception:  # noqa: BLE001 (an operation the FLOP counter cannot run on meta)
        costs = None
    if costs is None or not any(costs):
        costs = [float(sum(p.numel() for p in layer.parameters())) for layer in layers]
    return balanced_cuts(costs, stages, with_parameters(layers)[1:])


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

    @classmethod
    def check_model(cls, spec: StrategySpec, model: nn.Module) -> None:
        """A source's layers: a chain, no tied weights, enough places to start the stages, a partition
        within them (a GPT's were checked from its spec)."""
        assert isinstance(spec, PipelineSpec)
        if callable(getattr(model, "pipeline_layers", None)):
            return
        layers = source_layers(model, "pipeline", spec._workload)
        stages = spec.stages()
        if stages is None:
            return
        if spec.partition:
            check_cuts(spec.partition, stages, len(layers))
            return
        starts = len(with_parameters(layers)[1:]) + 1
        if stages > starts:
            raise ConfigError(f"cluster.world_size = {spec._world_size}: {stages} stages ({stages // spec.chunks} "
                              f"ranks x {spec.chunks} chunks) but the model has only {starts} places to start one "
                              f"(its layers with parameters; {len(layers)} layers in all); use fewer ranks or chunks")

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
        ranges = stage_ranges(self._cuts(model, layers), len(layers))
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
        shapes = self._stage_shapes(model, ranges)
        self.stages = [PipelineStage(chunk, s, self.n_stages, self.ctx.device, group=self.group, **shapes.get(s, {}))
                       for chunk, s in zip(chunks, self.mine)]
        for stage in self.stages:
            self._time_stage(stage)
        self._timer: StepTimer | None = None
        return PipelinedModel(chunks, self._forward_all)

    def _cuts(self, model: nn.Module, layers: list[nn.Module]) -> list[int]:
        if callable(getattr(model, "pipeline_layers", None)):  # a GPT: embedding, blocks, head
            return self.spec.cuts(len(layers) - 2, self.ranks)
        layout = SourceLayout.of(self.ctx.experiment.workload)
        self._layout = layout if layout is not None and len(layout.layers) == len(layers) else None
        return source_cuts(self.spec, layers, self.ranks * self.spec.chunks, self._layout)

    def _stage_shapes(self, model: nn.Module, ranges: list[tuple[int, int]]) -> dict[int, dict[str, torch.Tensor]]:
        """A source's stages' input and output for one micro-batch, as meta tensors (torch's static
        mode). Without them torch infers the shapes by running each stage once more in training mode, on
        the first micro-batch and on empty buffers: harmless to a GPT, but a batch norm would count that
        run (garbage) in its running statistics."""
        layout = getattr(self, "_layout", None)
        if layout is None or callable(getattr(model, "pipeline_layers", None)):
            return {}
        micro = self.ctx.experiment.workload.batch_size // (self.spec.micro_batches * self.spec.dp)
        try:
            flows = layout.flows(ranges, micro)
        except Exception:  # noqa: BLE001 (a micro-batch the model refuses: the first step says so, in torch's words)
            return {}
        return {s: {"input_args": flows[s], "output_args": flows[s + 1]} for s in self.mine}

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
