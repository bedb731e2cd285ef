"""The step profiler: what one rank's training step computes and holds, counted once for everyone.

`profile_step` runs one forward + backward of a per-rank batch on a copy of
the model (the model itself is left untouched: no gradients, no RNG drawn, no
BatchNorm statistics) and returns a `StepProfile`. Its readers each convert it
into what they report:

- the worker (runtime/flops.py): model FLOPs per step, for MFU;
- advise (advise.profile_workload): FLOPs, the nn.Linear GEMM shapes,
  activation bytes and the FSDP unit count, for the cluster-scale models;
- calibrate (calibrate.workload_facts): FLOPs, op counts, per-matmul shapes,
  memory-bound bytes and parameter sizes, for the local predictor.

Two passes, because they need different tensors:

1. Shapes (always): on a copy on the meta device (shapes only: no memory, no
   time, whatever the model's size), under FlopCounterMode with attention
   forced through the math SDPA kernel (the counter sees 0 FLOPs in CPU
   flash attention), with forward hooks on nn.Linear and saved-tensor hooks
   for the activations autograd keeps. A model with an op that has no meta
   kernel is counted on a real copy instead, with the RNG state put back.
   FLOPs and GEMMs are counted with recompute (workload.recompute) off: the
   model's own; a model that recomputes is counted again as it runs, for its
   hardware FLOPs and the activations it keeps.
2. Ops (`count_ops=True`): on a real copy, under a dispatch mode that counts
   every op, the shape of every matmul and the bytes every other op reads and
   writes. Real tensors because meta kernels dispatch slightly different ops
   (one fewer in gpt-char's step), and without the saved-tensor hooks of pass
   1 because those add ops of their own; the counts are what the step's real
   kernels do.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from ddlscope.strategies.units import wrap_units
from ddlscope.workloads.base import Dataset, LossFn, Task
from ddlscope.workloads.recompute import recompute_off

MATMUL_OPS = ("mm", "addmm", "bmm")
CONV_OPS = ("convolution", "convolution_backward")


@dataclass(frozen=True)
class Matmul:
    """One dispatched matmul of the step (forward or backward): `batch` x (m, k) @ (k, n)."""

    batch: int
    m: int
    k: int
    n: int
    conv: bool = False  # a convolution's implicit GEMM (priced at the calibrated convolution rate)

    @property
    def flops(self) -> float:
        return 2.0 * self.batch * self.m * self.k * self.n

    @property
    def effective_size(self) -> float:
        """The side of the square matmul with as many multiply-adds per batch entry: (m k n)^(1/3)."""
        return (self.m * self.k * self.n) ** (1 / 3)


@dataclass(frozen=True)
class OpCounts:
    """What the step's real kernels do (pass 2). A small model's CPU step is mostly per-op overhead."""

    ops: int  # every op the dispatcher saw, forward + backward
    matmuls: tuple[Matmul, ...]  # in dispatch order
    other_op_bytes: int  # bytes read and written by every op that is not a matmul (memory-bound work)


@dataclass(frozen=True)
class StepProfile:
    """One rank's training step: forward + backward of `batch` samples."""

    batch: int
    flops: int  # forward + backward (FlopCounterMode): model FLOPs, nothing recomputed
    hardware_flops: int  # what the step runs: model FLOPs plus the forwards recompute runs again
    counted_on: str  # "meta", or the device of the real copy pass 1 fell back to
    linear_gemms: tuple[tuple[int, int, int], ...]  # (m, n, k) of each nn.Linear forward, in call order
    activation_bytes: int  # tensors autograd saves for backward, parameters excluded (fewer under recompute)
    param_numel: tuple[int, ...]  # per parameter tensor, in model.parameters() order
    param_dim0: tuple[int, ...]  # each parameter's first dimension (1 for a scalar): what FSDP shards
    param_dtype: torch.dtype  # of the first parameter
    param_bytes: int
    gradient_bytes: int  # of the parameters that require a gradient
    unit_param_numel: tuple[int, ...]  # per wrap unit (strategies.units.wrap_units)
    root_param_numel: int  # parameters outside every unit (they stay with FSDP's root)
    ops: OpCounts | None = None  # pass 2, when asked for

    @property
    def params(self) -> int:
        return sum(self.param_numel)

    @property
    def units(self) -> int:
        return len(self.unit_param_numel)

    def optimizer_bytes(self, optimizer: str, momentum: float) -> int:
        return optimizer_states_per_param(optimizer, momentum) * self.param_bytes


def optimizer_states_per_param(optimizer: str, momentum: float) -> int:
    """State tensors the optimizer keeps per parameter, each of the parameter's size and dtype:
    AdamW exp_avg and exp_avg_sq; SGD a momentum buffer when momentum > 0."""
    if optimizer == "adamw":
        return 2
    return 1 if momentum > 0 else 0


def first_batch(dataset: Dataset, size: int) -> tuple[Tensor, Tensor]:
    """Samples 0 .. size-1 (wrapping around a smaller dataset), as a step of `size` would read them.

    The ids are CPU tensors: a dataset built under the meta device indexes with them too, and one
    whose data is real (a corpus read from package data) needs them; profile_step moves the batch.
    """
    return dataset.get(torch.arange(size) % max(len(dataset), 1))


def profile_task(task: Task, batch: int, *, count_ops: bool = False) -> StepProfile:
    """`profile_step` of the task's model on its first `batch` training samples."""
    x, y = first_batch(task.train, batch)
    return profile_step(task.model, task.loss_fn, x, y, count_ops=count_ops)


def profile_step(model: nn.Module, loss_fn: LossFn, x: Tensor, y: Tensor, *, count_ops: bool = False) -> StepProfile:
    """Profile forward + backward of `model` on (x, y); see the module docstring. `model` is left untouched."""
    with recompute_off() as asked:  # the model's own computation: model FLOPs, each GEMM once
        shapes = _shapes_pass(model, loss_fn, x, y)
    # A model that recomputes (workload.recompute) runs more than that and keeps less: counted as it runs.
    as_run = _shapes_pass(model, loss_fn, x, y) if asked[0] else shapes
    params = list(model.parameters())
    units = wrap_units(model)
    in_units = {id(p) for unit in units for p in unit.parameters()}
    return StepProfile(
        batch=len(x), flops=shapes.flops, hardware_flops=as_run.flops, counted_on=shapes.counted_on,
        linear_gemms=tuple(shapes.linear_gemms),
        activation_bytes=as_run.activation_bytes,
        param_numel=tuple(p.numel() for p in params), param_dim0=tuple(p.shape[0] if p.dim() else 1 for p in params),
        param_dtype=params[0].dtype if params else torch.float32,
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        gradient_bytes=sum(p.numel() * p.element_size() for p in params if p.requires_grad),
        unit_param_numel=tuple(sum(p.numel() for p in unit.parameters()) for unit in units),
        root_param_numel=sum(p.numel() for p in params if id(p) not in in_units),
        ops=_ops_pass(model, loss_fn, x, y) if count_ops else None)


# --------------------------------------------------------------------------- pass 1: shapes
@dataclass
class _Shapes:
    flops: int
    linear_gemms: list[tuple[int, int, int]]
    activation_bytes: int
    counted_on: str


def _shapes_pass(model: nn.Module, loss_fn: LossFn, x: Tensor, y: Tensor) -> _Shapes:
    try:
        return _count_shapes(copy.deepcopy(model).to("meta"), loss_fn, x.to("meta"), y.to("meta"), "meta")
    except Exception:  # an op without a meta kernel: count on a real copy
        device = _device_of(model)
        if device.type == "meta":
            raise  # nothing real to fall back to
        with _rng_put_back(device):
            return _count_shapes(copy.deepcopy(model), loss_fn, x.to(device), y.to(device), str(device))


def _count_shapes(model: nn.Module, loss_fn: LossFn, x: Tensor, y: Tensor, where: str) -> _Shapes:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    model.train()
    gemms: list[tuple[int, int, int]] = []

    def on_linear(module: nn.Linear, inputs: tuple[Any, ...], _out: Any) -> None:
        k = module.in_features
        gemms.append((int(inputs[0].numel() // k), module.out_features, k))

    param_ids = {id(p) for p in model.parameters()}
    saved = [0]

    def pack(t: Tensor) -> Tensor:
        base = getattr(t, "_base", None)  # a view of a parameter is the parameter, not an activation
        if id(t) not in param_ids and (base is None or id(base) not in param_ids):
            saved[0] += t.numel() * t.element_size()
        return t

    hooks = [m.register_forward_hook(on_linear) for m in model.modules() if isinstance(m, nn.Linear)]
    counter = FlopCounterMode(display=False)
    try:
        with sdpa_kernel(SDPBackend.MATH), counter:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = loss_fn(model(x), y)
            loss.backward()
    finally:
        for hook in hooks:
            hook.remove()
    return _Shapes(int(counter.get_total_flops()), gemms, saved[0], where)


# --------------------------------------------------------------------------- pass 2: ops
def _ops_pass(model: nn.Module, loss_fn: LossFn, x: Tensor, y: Tensor) -> OpCounts:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = _device_of(model)
    if device.type == "meta":
        raise ValueError("op counts need a real model: meta kernels dispatch different ops")
    replica = copy.deepcopy(model).train()
    counter = _OpCounter()
    with _rng_put_back(device), sdpa_kernel(SDPBackend.MATH), counter:
        loss_fn(replica(x.to(device)), y.to(device)).backward()
    return OpCounts(counter.count, tuple(counter.matmuls), counter.other_bytes)


class _OpCounter(TorchDispatchMode):
    """Counts every dispatched op; records each matmul's shape and every other op's bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.other_bytes = 0
        self.matmuls: list[Matmul] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += 1
        out = func(*args, **(kwargs or {}))
        name = str(getattr(func, "__name__", func)).split(".")[0]
        mats = [a for a in args if isinstance(a, Tensor) and a.dim() >= 2]
        if name in MATMUL_OPS and len(mats) >= 2:
            a, b = mats[-2], mats[-1]  # addmm's first argument is the bias
            self.matmuls.append(Matmul(batch=a.shape[0] if a.dim() == 3 else 1, m=a.shape[-2], k=a.shape[-1],
                                       n=b.shape[-1]))
        elif name in CONV_OPS:
            self.matmuls.extend(_conv_as_gemms(name, args, out))
        else:  # memory-bound: bytes read and written
            outs = out if isinstance(out, (tuple, list)) else [out]
            self.other_bytes += sum(t.nbytes for t in (*args, *outs) if isinstance(t, Tensor))
        return out


# Forward ops that keep a CNN layer's shape, by the kind predict/cnn.py prices them as (memory-bound).
SHAPE_KEEPING_OPS = {"native_group_norm": "norm", "native_batch_norm": "norm", "native_layer_norm": "norm",
                     "_native_batch_norm_legit": "norm", "_native_batch_norm_legit_no_training": "norm",
                     "relu": "relu", "relu_": "relu", "gelu": "relu", "silu": "relu", "hardtanh": "relu",
                     "add": "add", "add_": "add", "mul": "add", "native_dropout": "dropout"}
POOL_OPS = {"max_pool2d_with_indices": "maxpool", "avg_pool2d": "avgpool", "_adaptive_avg_pool2d": "avgpool",
            "mean": "avgpool"}


def one_image_training_mode(model: nn.Module) -> nn.Module:
    """The model in training mode for a forward of one image: the ops training runs (dropout), and no
    inference fast path (nn.MultiheadAttention's fused kernel in eval hides its projections), but
    batch norms on their running statistics: batch statistics of one image are undefined on a 1x1
    map (ResNet-50's last stage at 32x32), and the op priced is the same normalisation."""
    model.train()
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.eval()
    return model


def forward_flops(model: nn.Module, image: Tensor) -> float:
    """Forward FLOPs of one image as torch counts them, in the mode `cnn_layer_records` runs (attention
    through the math kernel, which FlopCounterMode counts; PLATFORM.md)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    replica = one_image_training_mode(copy.deepcopy(model))
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), counter:
        replica(image.to(_device_of(replica)))
    return float(counter.get_total_flops())


def cnn_layer_records(model: nn.Module, image: Tensor) -> list[dict[str, Any]]:
    """A CNN's forward as the layer list predict/cnn.py prices (its `Layer` fields, as dicts): every
    convolution, linear layer, norm, activation, residual add or scale, pooling and concatenation of
    one image's forward, recorded from the ops a real forward dispatches, so any registered vision
    workload can be predicted at cluster scale. `unit` is the index of the FSDP unit the op ran in
    (strategies/units.py: `model.blocks`, a model's repeated blocks, ...), 0 before the first unit
    (the stem) and one past the last after it.
    """
    device = _device_of(model)
    if device.type == "meta":
        raise ValueError("layer records need a real model: meta kernels dispatch different ops")
    replica = one_image_training_mode(copy.deepcopy(model))
    recorder = _LayerRecorder()
    blocks = wrap_units(replica)
    hooks = []
    for i, block in enumerate(blocks):
        hooks.append(block.register_forward_pre_hook(lambda *_, i=i: recorder.enter_unit(i + 1)))
    if blocks:
        hooks.append(blocks[-1].register_forward_hook(lambda *_: recorder.enter_unit(len(blocks) + 1)))
    try:
        with torch.no_grad(), recorder:
            replica(image[:1].to(device))
    finally:
        for hook in hooks:
            hook.remove()
    return recorder.records


class _LayerRecorder(TorchDispatchMode):
    """Turns one forward's dispatched ops into CNN layer records (square spatial sizes)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[dict[str, Any]] = []
        self.unit = 0

    def enter_unit(self, unit: int) -> None:
        self.unit = unit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        name = str(getattr(func, "__name__", func)).split(".")[0]
        first = out[0] if isinstance(out, (tuple, list)) else out
        if isinstance(first, Tensor):
            record = self._record(name, args, first)
            if record is not None:
                self.records.append({"name": f"{name}{len(self.records)}", "unit": self.unit, **record})
        return out

    def _record(self, name: str, args: tuple[Any, ...], out: Tensor) -> dict[str, Any] | None:
        x = args[0] if args and isinstance(args[0], Tensor) else None
        if name == "convolution" and x is not None:
            weight = args[1]
            return {"kind": "conv", "c_in": x.shape[1], "c_out": out.shape[1], "h_in": x.shape[-1],
                    "h_out": out.shape[-1], "kernel": weight.shape[-1], "stride": int(args[3][0]),
                    "groups": int(args[8]), "bias": args[2] is not None,
                    "first": not any(r["kind"] == "conv" for r in self.records)}
        if name in ("addmm", "mm") and out.dim() == 2:
            a = args[-2]
            # One image's rows: 1 for a classifier head, every pixel or token for a linear applied per
            # position (ConvNeXt's channels-last MLP, a ViT's projections).
            return {"kind": "linear", "c_in": a.shape[-1], "c_out": out.shape[-1], "h_in": 1, "h_out": 1,
                    "bias": name == "addmm", "positions": a.shape[0]}
        if x is None or out.dim() not in (2, 3, 4):
            return None
        per_position = _per_position_width(name, args, out)
        if per_position and name in SHAPE_KEEPING_OPS:  # tokens (B, T, C) or channels-last (B, H, W, C)
            return {"kind": SHAPE_KEEPING_OPS[name], "c_in": per_position, "c_out": per_position, "h_in": 1,
                    "h_out": 1, "positions": out.numel() // per_position}
        if out.dim() == 3:
            return None
        channels, size = out.shape[1], (out.shape[-1] if out.dim() == 4 else 1)
        if name in SHAPE_KEEPING_OPS and any(isinstance(a, Tensor) and a.shape == out.shape for a in args):
            return {"kind": SHAPE_KEEPING_OPS[name], "c_in": channels, "c_out": channels, "h_in": size, "h_out": size}
        if name in POOL_OPS and x.dim() == 4:
            return {"kind": POOL_OPS[name], "c_in": x.shape[1], "c_out": x.shape[1], "h_in": x.shape[-1],
                    "h_out": size, "kernel": max(x.shape[-1] // max(size, 1), 1),
                    "stride": max(x.shape[-1] // max(size, 1), 1)}
        if name == "cat" and out.dim() == 4:
            return {"kind": "concat", "c_in": channels, "c_out": channels, "h_in": size, "h_out": size}
        return None


def _per_position_width(name: str, args: tuple[Any, ...], out: Tensor) -> int:
    """The channels of a per-position layout (tokens, or channels-last images), 0 for channels-first.

    A layer norm over the last dimension of a 3-D or 4-D tensor normalises each position on its own
    (its weight has the last dimension's size); any other op on a 3-D tensor is per token."""
    if name == "native_layer_norm" and out.dim() in (3, 4):
        normalized = math.prod(args[1]) if isinstance(args[1], (list, tuple)) else out.shape[-1]
        return int(normalized) if normalized == out.shape[-1] else 0
    return int(out.shape[-1]) if out.dim() == 3 else 0


def _conv_as_gemms(name: str, args: tuple[Any, ...], out: Any) -> list[Matmul]:
    """A convolution's kernels as the GEMMs they compute (im2col, the implicit-GEMM view).

    The forward is, per group, (N Ho Wo) x (C_in/g kh kw) @ (.. , C_out/g); the backward computes
    the input's gradient and the weight's, each a GEMM of the same multiply-adds, for the
    gradients `output_mask` asks for (none for the input of the first layer). Priced like any
    matmul of that size, which is how CPU (oneDNN) and GPU (cuDNN) libraries run them.
    """
    if name == "convolution":
        x, weight, groups, wanted = args[0], args[1], int(args[8]), (True,)
        y = out
    else:  # convolution_backward(grad_output, input, weight, ..., groups, output_mask)
        y, x, weight, groups = args[0], args[1], args[2], int(args[9])
        wanted = tuple(bool(m) for m in args[10][:2])
    if x.dim() < 3:
        return []
    rows = y.shape[0] * math.prod(y.shape[2:])  # N x output positions
    reduction = math.prod(weight.shape[1:])  # C_in / g x kernel positions
    channels = weight.shape[0] // groups  # C_out / g
    return [Matmul(batch=groups, m=rows, k=reduction, n=channels, conv=True) for w in wanted if w]


# --------------------------------------------------------------------------- helpers
def _device_of(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _rng_put_back(device: torch.device) -> Any:
    """Random ops of a real step (dropout) draw from the RNG; training must not see that."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])


# --------------------------------------------------------------------------- per layer (the pipeline partitioner)
@dataclass(frozen=True)
class LayerProfile:
    """One pipeline layer (model.pipeline_layers()) on one micro-batch, measured on a copy of the model."""

    name: str
    # medians of `repeats` runs, in thread CPU time: what the layer costs, not what else ran on the machine
    forward_s: float  # the last layer's includes the loss
    backward_s: float
    param_bytes: int
    activation_bytes: int  # what autograd saves for this layer's backward, parameters excluded
    input_bytes: int  # the layer's input (what a recomputed stage keeps per micro-batch)


def profile_layers(model: nn.Module, loss_fn: LossFn, x: Tensor, y: Tensor, repeats: int = 3) -> list[LayerProfile]:
    """Time each layer's forward and backward on (x, y) and count its saved activations, layer by layer
    on a copy: each layer's input is a leaf, so its backward is timed alone with the output's gradient."""
    import statistics
    import time

    from ddlscope.runtime.instrument import ActivationMeter

    layers = copy.deepcopy(model).pipeline_layers()
    inputs, outputs, metered, forward_s = [], [], [], []
    h: Tensor = x
    for i, layer in enumerate(layers):
        leaf = h.detach().requires_grad_(h.is_floating_point())
        meter = ActivationMeter(layer)
        times = []
        for repeat in range(repeats):
            began = time.thread_time()
            with meter.measure() if repeat == repeats - 1 else _no_meter():
                out = layer(leaf)
                if i == len(layers) - 1:
                    out = loss_fn(out, y)
            times.append(time.thread_time() - began)
        inputs.append(leaf)
        outputs.append(out)
        metered.append(meter.bytes)
        forward_s.append(statistics.median(times))
        h = out
    backward_s = [0.0] * len(layers)
    grad: Tensor | None = None
    for i in reversed(range(len(layers))):
        times = []
        for repeat in range(repeats):
            began = time.thread_time()
            torch.autograd.backward(outputs[i], grad, retain_graph=repeat < repeats - 1)
            times.append(time.thread_time() - began)
        backward_s[i] = statistics.median(times)
        grad = inputs[i].grad
    return [LayerProfile(name=type(layer).__name__ + (f" {i - 1}" if 0 < i < len(layers) - 1 else ""),
                         forward_s=forward_s[i], backward_s=backward_s[i],
                         param_bytes=sum(p.numel() * p.element_size() for p in layer.parameters()),
                         activation_bytes=metered[i], input_bytes=inputs[i].numel() * inputs[i].element_size())
            for i, layer in enumerate(layers)]


def _no_meter() -> Any:
    from contextlib import nullcontext

    return nullcontext()


# --------------------------------------------------------------------------- per module (calibrate --model)
@dataclass(frozen=True)
class ModuleTiming:
    """One piece of a model's split (a pipeline layer, a child module, or the loss) on one batch, timed
    alone on the model's device with its input as a leaf: wall clock, device synchronised, medians."""

    name: str
    forward_s: float
    backward_s: float
    param_bytes: int
    activation_bytes: int  # what autograd saves for its backward, parameters excluded
    input_bytes: int  # its tensor inputs (what a pipeline stage boundary receives here)
    output_bytes: int  # its tensor outputs (what it sends on)
    flops: int  # forward + backward (FlopCounterMode, math attention)
    # on a GPU, forward + backward's CUDA kernels alone (torch.profiler, one profiled run): forward_s +
    # backward_s beyond it is the stack's per-layer overhead (Python, autograd's engine, launches) beside
    # its kernels. None on a CPU: there the profiler's cost per op is the size of a small model's ops
    # (a tiny GPT's profiled aten time came out above its unprofiled wall time)
    kernel_s: float | None = None


def model_split(model: nn.Module, most: int = 64) -> tuple[str, list[tuple[str, nn.Module]]]:
    """The pieces a model is profiled in, and which split that is: the layer sequence that `pipeline`
    cuts (workloads/sequential.py) where the model is such a chain, else its children opened from the
    top, where one child holds most of the parameters (a wrapper such as a Hugging Face encoder) or is a
    ModuleList/Sequential (the blocks), until at most `most` pieces (leaf-ish top-level children). A list
    of blocks too long to open within `most` becomes contiguous groups of its blocks (ModuleGroup), each
    timed as one in the model's own forward: a ModuleList has no forward of its own to time (a residual
    model's 70-block body was profiled as if it held none of the compute)."""
    from ddlscope.workloads.sequential import split_layers

    try:
        layers = split_layers(model)
        return "layer sequence (the pipeline's layers)", [(f"{i} {type(layer).__name__}", layer)
                                                         for i, layer in enumerate(layers)]
    except Exception as why:  # noqa: BLE001 (NotAChain, or fx tracing failing in one of its many ways)
        reason = str(why).strip().splitlines()[0] if str(why).strip() else type(why).__name__
    pieces = list(model.named_children())
    total = max(sum(p.numel() for p in model.parameters()), 1)
    while (i := _openable(pieces, total)) is not None:
        name, module = pieces[i]
        children = list(module.named_children())
        room = most - (len(pieces) - 1)
        if len(children) <= room:
            pieces = pieces[:i] + [(f"{name}.{child}", m) for child, m in children] + pieces[i + 1:]
        else:  # too many to open: a list of blocks in groups, anything else stays one piece (it has a forward)
            if isinstance(module, (nn.ModuleList, nn.Sequential)):
                pieces = pieces[:i] + _grouped(name, children, max(room, 1)) + pieces[i + 1:]
            break
    # a ModuleList left unopened (the room ran out) is timed as one group: it has no forward to hook
    pieces = [_grouped(name, list(m.named_children()), 1)[0] if isinstance(m, nn.ModuleList) and len(m) else (name, m)
              for name, m in pieces]
    return f"children (not a layer chain: {reason})", pieces


class ModuleGroup(nn.Module):
    """Contiguous children of a list of blocks, timed as one in the model's own forward: from the first's
    forward pre-hook to the last's forward hook, and back from the gradient of the last's output to that
    of the first's input (whatever the model does between them, residual adds included, is inside)."""

    def __init__(self, members: list[nn.Module]):
        super().__init__()
        self.members = nn.ModuleList(members)


def _grouped(name: str, children: list[tuple[str, nn.Module]], groups: int) -> list[tuple[str, nn.Module]]:
    """`children` in at most `groups` contiguous groups of near-equal sizes, named by their first and last."""
    size = math.ceil(len(children) / groups)
    runs = [children[start:start + size] for start in range(0, len(children), size)]
    return [(f"{name}.{run[0][0]}-{run[-1][0]}", ModuleGroup([m for _, m in run])) for run in runs]


def _openable(pieces: list[tuple[str, nn.Module]], total: int) -> int | None:
    """The index of the first piece to open (a list of blocks, or a wrapper holding most parameters)."""
    for i, (_, module) in enumerate(pieces):
        children = list(module.named_children())
        share = sum(p.numel() for p in module.parameters()) / total
        if (children and not isinstance(module, ModuleGroup)
                and (isinstance(module, (nn.ModuleList, nn.Sequential)) or share > 0.5)):
            return i
    return None


def profile_modules(model: nn.Module, loss_fn: LossFn, x: Tensor, y: Tensor, pieces: list[tuple[str, nn.Module]],
                    chain: bool, repeats: int = 5, warmup: int = 2) -> list[ModuleTiming]:
    """Each piece of `model` timed alone on the inputs it gets in one real forward of (x, y), then the
    loss on the model's output: forward and backward (the output's gradient random, as a real one is
    dense), each the median of `repeats` after `warmup`. `chain`: the pieces are layers applied in
    order (pipeline layers, which may hold wrappers the model's forward never calls), else modules of
    the model whose inputs a forward pre-hook captures; a ModuleGroup is timed in the model's own
    forward and backward (_time_groups). A piece no hook saw is left out (the caller notes it). The
    model is used as it is (give a copy)."""
    members = [m for _, piece in pieces if isinstance(piece, ModuleGroup) for m in piece.members]
    inputs, output = _captured_inputs(model, x, pieces + [("", m) for m in members], chain)
    device = x.device
    in_situ = _time_groups(model, loss_fn, x, y, [(n, p) for n, p in pieces if isinstance(p, ModuleGroup)],
                           inputs, repeats, warmup)
    timed = [in_situ[name] if isinstance(module, ModuleGroup) else
             _time_piece(name, module, *inputs[id(module)], repeats, warmup, device)
             for name, module in pieces if (name in in_situ if isinstance(module, ModuleGroup) else id(module) in inputs)]
    loss = _LossPiece(loss_fn, y)
    return timed + [_time_piece("loss", loss, (output,), {}, repeats, warmup, device)]


def _time_groups(model: nn.Module, loss_fn: LossFn, x: Tensor, y: Tensor, groups: list[tuple[str, ModuleGroup]],
                 inputs: dict[int, tuple[tuple[Any, ...], dict[str, Any]]], repeats: int, warmup: int
                 ) -> dict[str, ModuleTiming]:
    """Each group timed in whole forward + backward steps of the model (wall clock, the device synchronised
    at each mark): forward from its first member's pre-hook to its last member's forward hook; backward from
    the gradient of the last member's output to that of the first member's input (to the end of the
    backward where that input needs none). Medians of `repeats` steps after `warmup`."""
    import statistics
    import time

    from torch.utils._pytree import tree_flatten

    from ddlscope.runtime.instrument import ActivationMeter

    groups = [(name, group) for name, group in groups if id(group.members[0]) in inputs]
    if not groups:
        return {}
    device = x.device
    marks: dict[str, dict[str, float]] = {}

    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def needing_grad(tree: Any) -> list[Tensor]:
        return [t for t in tree_flatten(tree)[0] if isinstance(t, Tensor) and t.requires_grad]

    def on_grad(name: str, key: str, last: bool) -> Any:
        def hook(grad: Tensor) -> None:
            t = now()
            mark = marks.setdefault(name, {})
            mark[key] = max(mark.get(key, t), t) if last else min(mark.get(key, t), t)
        return hook

    hooks, meters, metering = [], {name: ActivationMeter(group) for name, group in groups}, [False]
    entered: dict[str, Any] = {}
    for name, group in groups:
        def pre(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], name: str = name) -> None:
            marks.setdefault(name, {}).setdefault("f0", now())  # a first block called twice: its first call
            for t in needing_grad((args, kwargs)):
                t.register_hook(on_grad(name, "b1", last=True))
            if metering[0]:
                entered[name] = meters[name].measure()
                entered[name].__enter__()

        def post(_m: nn.Module, _args: Any, out: Any, name: str = name) -> None:
            if name in entered:
                entered.pop(name).__exit__(None, None, None)
            marks.setdefault(name, {})["f1"] = now()
            for t in needing_grad(out):
                t.register_hook(on_grad(name, "b0", last=False))

        hooks += [group.members[0].register_forward_pre_hook(pre, with_kwargs=True),
                  group.members[-1].register_forward_hook(post)]
    runs: list[dict[str, dict[str, float]]] = []
    try:
        for run in range(warmup + repeats + 1):
            metering[0] = run == warmup + repeats  # the last run counts activations, untimed
            marks.clear()
            loss_fn(model(x), y).backward()
            end = now()
            model.zero_grad(set_to_none=True)
            runs.append({name: {**mark, "end": end} for name, mark in marks.items()})
    finally:
        for hook in hooks:
            hook.remove()
    timed = runs[warmup:warmup + repeats]
    out: dict[str, ModuleTiming] = {}
    for name, group in groups:
        first_in, last = inputs[id(group.members[0])], group.members[-1]
        last_in = inputs.get(id(last), ((), {}))
        out[name] = ModuleTiming(
            name=name, forward_s=statistics.median(max(r[name]["f1"] - r[name]["f0"], 0.0) for r in timed),
            backward_s=statistics.median(_backward_s(r[name]) for r in timed),
            param_bytes=sum(p.numel() * p.element_size() for p in group.parameters()),
            activation_bytes=int(meters[name].bytes), input_bytes=_tensor_bytes(first_in),
            output_bytes=_tensor_bytes(_output_of(last, *last_in)),
            flops=sum(_piece_flops(m, *inputs[id(m)]) for m in group.members if id(m) in inputs))
    return out


def _backward_s(mark: dict[str, float]) -> float:
    """From the gradient of the group's output to its input's (the end of the backward where the input
    needs none); 0 where the output needs no gradient (no backward runs through the group)."""
    return mark.get("b1", mark["end"]) - mark["b0"] if "b0" in mark else 0.0


class _LossPiece(nn.Module):
    def __init__(self, loss_fn: LossFn, y: Tensor):
        super().__init__()
        self.loss_fn, self.y = loss_fn, y

    def forward(self, out: Tensor) -> Tensor:
        return self.loss_fn(out, self.y)


def _captured_inputs(model: nn.Module, x: Tensor, pieces: list[tuple[str, nn.Module]], chain: bool
                     ) -> tuple[dict[int, tuple[tuple[Any, ...], dict[str, Any]]], Tensor]:
    """Each piece's (args, kwargs) in one forward of x, detached (the first call, for a module called
    twice), and the model's output."""
    captured: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}

    def keep(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if id(module) not in captured:
            captured[id(module)] = _detached((args, kwargs))

    # with autograd on: which inputs require a gradient (a hidden state does, the images or a mask do not)
    # is what each piece's backward computes, and the captured copies keep that flag
    if chain:
        h: Any = x
        for _, layer in pieces:
            keep(layer, (h,), {})
            h = layer(h)
        return captured, _detached(h)
    hooks = [m.register_forward_pre_hook(keep, with_kwargs=True) for _, m in pieces]
    try:
        out = model(x)
    finally:
        for hook in hooks:
            hook.remove()
    return captured, _detached(out)


def _detached(tree: Any) -> Any:
    """Copies of the tensors in `tree`, cut from the graph, requiring a gradient where the originals did."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, Tensor) else t,
                    tree)


def _leaves(tree: Any) -> Any:
    """Fresh leaves of the captured tensors (flags kept): each run's graph starts at them."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.detach().requires_grad_(t.requires_grad) if isinstance(t, Tensor) else t, tree)


def _time_piece(name: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], repeats: int,
                warmup: int, device: torch.device) -> ModuleTiming:
    import statistics
    import time

    from torch.utils._pytree import tree_flatten

    from ddlscope.runtime.instrument import ActivationMeter

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def run(meter: Any = None) -> tuple[float, float]:
        a, k = _leaves((args, kwargs))
        sync()
        began = time.perf_counter()
        with meter.measure() if meter is not None else _no_meter():
            out = module(*a, **k)
        sync()
        forward_s = time.perf_counter() - began
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor) and t.requires_grad]
        grads = [torch.randn_like(t) for t in outs]
        sync()
        began = time.perf_counter()
        if outs:
            torch.autograd.backward(outs, grads)
        sync()
        backward_s = time.perf_counter() - began
        module.zero_grad(set_to_none=True)
        return forward_s, backward_s

    times = [run() for _ in range(warmup + repeats)][warmup:]
    kernel_s = _kernel_s(run) if device.type == "cuda" else None
    meter = ActivationMeter(module)
    run(meter)
    return ModuleTiming(
        name=name, forward_s=statistics.median(t[0] for t in times), backward_s=statistics.median(t[1] for t in times),
        param_bytes=sum(p.numel() * p.element_size() for p in module.parameters()),
        activation_bytes=int(meter.bytes), input_bytes=_tensor_bytes((args, kwargs)),
        output_bytes=_tensor_bytes(_output_of(module, args, kwargs)), flops=_piece_flops(module, args, kwargs),
        kernel_s=kernel_s)


def _kernel_s(run: Any) -> float:
    """Seconds of CUDA kernels in one `run()` (forward + backward), from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e6


def _tensor_bytes(tree: Any) -> int:
    from torch.utils._pytree import tree_flatten

    return sum(t.numel() * t.element_size() for t in tree_flatten(tree)[0] if isinstance(t, Tensor))


def _output_of(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    with torch.no_grad():
        return module(*args, **kwargs)


def _piece_flops(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Forward + backward FLOPs of the piece, counted as the step profiler counts the whole model's
    (FlopCounterMode, attention through the math kernel, whose FLOPs the counter sees)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils._pytree import tree_flatten
    from torch.utils.flop_counter import FlopCounterMode

    a, k = _leaves((args, kwargs))
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        outs = [t for t in tree_flatten(module(*a, **k))[0] if isinstance(t, Tensor) and t.requires_grad]
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
    module.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())
