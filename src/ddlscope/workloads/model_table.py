"""Build a model table (specs/model_table.py) from one traced forward + loss, allocating nothing.

The model is moved onto fake CPU tensors (torch's FakeTensorMode: shapes,
dtypes and storages, no memory) and one forward of a micro-batch and its loss
runs under three observers:

- a module stack (global forward pre/post hooks): which module is running,
  so that each op and saved tensor lands on the innermost one;
- saved-tensor hooks counting what autograd keeps for backward by distinct
  storage, parameters excluded: the convention of the runtime's
  ActivationMeter (runtime/instrument.py), so the estimate and the measured
  `activations` category count the same thing;
- a dispatch mode adding torch's FLOP formulas per op and the GEMM/conv
  shapes. CPU attention dispatches `_scaled_dot_product_flash_attention_for_cpu`,
  which torch's counter prices at 0 (PLATFORM.md); it is priced here as the
  math kernel is, while the activations stay those of the kernel a run uses.

Fake CPU tensors rather than the meta device: attention picks its CPU kernel
(so the saved tensors are the run's), and Hugging Face models, whose forward
reads mask values, run. A model whose op has no fake kernel is traced on a
real copy instead (the built-in workloads are small).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from ddlscope.specs.model_table import Gemm, LayerRow, ModelTable, ParamEntry, UnitRow
from ddlscope.workloads.base import LossFn, cross_entropy
from ddlscope.workloads.recompute import recompute_off

LOSS_ROW = "(loss)"
MATMUL_OPS = {"mm", "addmm", "bmm"}
CONV_OPS = {"convolution"}


# --------------------------------------------------------------------------- entry point
def trace_model_table(model: nn.Module, loss_fn: LossFn, x: Tensor, y: Tensor, *, name: str,
                      units: list[nn.Module] | None = None) -> ModelTable:
    """The table of `model` on the batch (x, y); `units` are FSDP's (strategies.units.wrap_units).

    `model` may be on the meta device (it is then re-homed on fake tensors, in place) or real (a copy is
    traced; the model is left untouched)."""
    units = units or []
    on_meta = any(t.device.type == "meta" for t in _tensors_of(model))
    try:
        # A real model is copied (deepcopy keeps tied weights one tensor), then re-homed on fake tensors.
        return _trace(model if on_meta else copy.deepcopy(model), loss_fn, x, y, name, units, model, fake=True)
    except Exception:
        if on_meta:
            raise  # nothing real to fall back to
    # An op without a fake kernel (data-dependent shapes): count on a real copy; RNG put back.
    replica = copy.deepcopy(model)
    with torch.random.fork_rng(devices=[]):
        return _trace(replica, loss_fn, x, y, name, units, model, fake=False)


def _tensors_of(model: nn.Module) -> Iterator[Tensor]:
    yield from model.parameters()
    yield from model.buffers()


# --------------------------------------------------------------------------- the trace
def _trace(model: nn.Module, loss_fn: LossFn, x: Tensor, y: Tensor, name: str, units: list[nn.Module],
           original: nn.Module, fake: bool) -> ModelTable:
    from torch._subclasses.fake_tensor import FakeTensorMode

    # Units were found on `original`; map them onto the traced model by their path.
    unit_paths = _unit_paths(original, units)
    with ExitStack() as stack:
        if fake:
            mode = stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            _to_fake(model, mode)
            x, y = _fake_like(x, mode), _fake_like(y, mode)
        modules = dict(model.named_modules())
        unit_of = _unit_membership(modules, unit_paths)
        recorder = _Recorder(model, {path: i for i, path in enumerate(unit_paths)})
        stack.enter_context(recompute_off())  # the model's own activations; recompute is priced from the units
        if fake:
            stack.enter_context(_hf_masks_as_on_real_tensors())
            stack.enter_context(_repeats_copied(recorder, {path: modules[path] for path in unit_paths}))
        model.train()
        with recorder.observing():
            loss_fn(model(x), y)
        rows = _rows(model, recorder, unit_of)
    return ModelTable(model=name, traced_batch=int(x.shape[0]) if x.dim() else 1, counted_on="fake" if fake else "cpu",
                      layers=tuple(rows), units=tuple(recorder.unit_rows(unit_paths, rows)),
                      activation_bytes_recompute=recorder.recompute_bytes(unit_of))


@contextmanager
def _repeats_copied(recorder: "_Recorder", units: dict[str, nn.Module]) -> Iterator[None]:
    """Trace each distinct unit twice, copy the second for its later repeats (fake tensors only).

    An 80-layer model runs 80 identical decoder layers: the same ops on the same shapes, each keeping the
    same bytes. Tracing is a few thousand fake ops per second, so a unit whose class, parameter shapes and
    input shapes match a unit traced twice already returns fresh outputs of the traced shapes at once, and
    its rows are the second one's (the second, not the first: what the first keeps that its successors
    share with it, such as a transformer's rotary tables, is counted once, on the first)."""
    seen: dict[tuple[Any, ...], list[str]] = {}
    outputs: dict[str, Any] = {}

    def wrapped(path: str, module: nn.Module, forward: Any) -> Any:
        def forward_or_copy(*args: Any, **kwargs: Any) -> Any:
            signature = _signature(module, args, kwargs)
            traced = seen.setdefault(signature, [])
            if len(traced) >= 2:
                template = traced[1]
                recorder.copies[path] = template
                fresh = _fresh_like(outputs[template])
                recorder.saved_as_template(path, template, outputs[template], fresh)
                return fresh
            out = forward(*args, **kwargs)
            traced.append(path)
            outputs[path] = out
            return out
        return forward_or_copy

    originals = {path: module.__dict__.get("forward") for path, module in units.items()}
    for path, module in units.items():
        module.forward = wrapped(path, module, module.forward)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for path, module in units.items():
            if originals[path] is None:
                del module.forward
            else:
                module.forward = originals[path]  # type: ignore[method-assign]


def _signature(module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, ...]:
    def describe(value: Any) -> Any:
        if isinstance(value, Tensor):
            return ("tensor", tuple(value.shape), value.dtype, value.requires_grad)
        if isinstance(value, (list, tuple)):
            return tuple(describe(v) for v in value)
        if isinstance(value, dict):
            return tuple((k, describe(v)) for k, v in sorted(value.items(), key=lambda kv: str(kv[0])))
        plain = isinstance(value, (int, float, str, bool, type(None)))
        return ("value", type(value).__name__, value if plain else None)

    state = tuple((name, tuple(t.shape), t.dtype, t.requires_grad)
                  for name, t in (*module.named_parameters(), *module.named_buffers()))
    # What parameters do not show: strides, paddings, dropout rates (two blocks alike but for a stride).
    settings = tuple((type(m).__name__, m.extra_repr(), m.training) for m in module.modules())
    return type(module).__name__, state, settings, describe(args), describe(kwargs)


def _fresh_like(value: Any) -> Any:
    """New tensors of `value`'s shapes, strides and dtypes, requiring a gradient where it did, so that what
    follows runs and saves as it would."""
    if isinstance(value, Tensor):
        fresh = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
        return fresh.requires_grad_(value.requires_grad)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_fresh_like(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_fresh_like(v) for v in value)
    if isinstance(value, dict):
        return type(value)({k: _fresh_like(v) for k, v in value.items()})
    return value


# transformers' mask decisions that read a tensor's values, and what each decides on real, unpadded,
# unpacked batches (the runtime's: HFModel passes no attention mask, positions are 0..seq-1).
_HF_MASK_DECISIONS = {"_ignore_causal_mask_sdpa": "padding", "_ignore_bidirectional_mask_sdpa": "padding",
                      "find_packed_sequence_indices": "packing"}


@contextmanager
def _hf_masks_as_on_real_tensors() -> Iterator[None]:
    """transformers builds a full (batch, 1, seq, seq) attention mask when the tensors it decides on are fake
    (it takes them for a compiler tracing the model), where a real run skips the mask and calls attention
    with `is_causal`: the trace would count a tensor the run never saves. Inside, a fake padding mask is
    decided on as no padding, fake positions as one sequence per row."""
    import sys

    masking = sys.modules.get("transformers.masking_utils")
    originals = {name: getattr(masking, name) for name in _HF_MASK_DECISIONS if hasattr(masking, name)}
    from torch._subclasses.fake_tensor import FakeTensor

    def as_on_real_tensors(name: str, decide: Callable[..., Any]) -> Callable[..., Any]:
        def decided(first: Any, *args: Any, **kwargs: Any) -> Any:
            if not isinstance(first, FakeTensor):
                return decide(first, *args, **kwargs)
            return decide(None, *args, **kwargs) if _HF_MASK_DECISIONS[name] == "padding" else None
        return decided

    for name, decide in originals.items():
        setattr(masking, name, as_on_real_tensors(name, decide))
    try:
        yield
    finally:
        for name, decide in originals.items():
            setattr(masking, name, decide)


def _unit_paths(model: nn.Module, units: list[nn.Module]) -> list[str]:
    path_of = {id(m): path for path, m in model.named_modules()}
    return [path_of[id(u)] for u in units if id(u) in path_of]


def _unit_membership(modules: dict[str, nn.Module], unit_paths: list[str]) -> dict[str, int]:
    """module path -> unit index, for every module inside a unit (the unit itself included)."""
    member: dict[str, int] = {}
    for index, path in enumerate(unit_paths):
        for sub in modules:
            if sub == path or sub.startswith(path + "."):
                member.setdefault(sub, index)
    return member


def _to_fake(model: nn.Module, mode: Any) -> None:
    """Replace every parameter and buffer by a fake CPU tensor of its shape, once per distinct tensor, so
    that tied weights (an LM head sharing the embedding) stay one tensor."""
    swapped: dict[int, Tensor] = {}
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in swapped:
                with mode:
                    swapped[id(p)] = nn.Parameter(torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad)
            module._parameters[key] = swapped[id(p)]  # type: ignore[assignment]
        for key, b in list(module._buffers.items()):
            if b is None:
                continue
            if id(b) not in swapped:
                with mode:
                    swapped[id(b)] = torch.empty_like(b, device="cpu")
            module._buffers[key] = swapped[id(b)]


def _fake_like(t: Tensor, mode: Any) -> Tensor:
    if t.device.type == "meta":
        with mode:
            return torch.empty_like(t, device="cpu")
    return mode.from_tensor(t)


# --------------------------------------------------------------------------- the observers
def _storage(t: Tensor) -> tuple[int, int]:
    """A storage's identity and size, for real and fake tensors alike (a fake storage has no address)."""
    s = t.untyped_storage()
    return s._cdata, s.nbytes()


class _Recorder:
    """Module stack, saved storages and per-op FLOPs of one forward + loss."""

    def __init__(self, model: nn.Module, unit_index: dict[str, int]):
        self.path_of = {id(m): path for path, m in model.named_modules()}
        self.root = model
        self.stack: list[str] = []
        self.unit_index = unit_index
        self.param_keys = {_storage(p.detach())[0] for p in model.parameters()}
        self.saved: dict[int, list[Any]] = {}  # storage -> [bytes, first row that saved it]
        self.keep: list[Tensor] = []  # saved tensors held until the end: their storage ids stay unique
        self.unit_inputs: dict[int, dict[int, int]] = {}  # unit -> {storage: bytes}
        self.flops: dict[str, float] = {}
        self.gemms: dict[str, list[Gemm]] = {}
        self.copies: dict[str, str] = {}  # unit path -> the traced unit whose rows it repeats

    @property
    def row(self) -> str:
        return self.stack[-1] if self.stack else LOSS_ROW

    @contextmanager
    def observing(self) -> Iterator[None]:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        handles = [register_module_forward_pre_hook(self._enter),
                   register_module_forward_hook(self._leave, always_call=True)]
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t), _FlopMode(self):
                yield
        finally:
            for h in handles:
                h.remove()

    def _enter(self, module: nn.Module, args: Any) -> None:
        path = self.path_of.get(id(module))
        if path is None:
            return
        self.stack.append(path)
        index = self.unit_index.get(path)
        if index is not None:
            self.unit_inputs.setdefault(index, {}).update(self._storages(args))

    def _leave(self, module: nn.Module, args: Any, out: Any) -> None:
        path = self.path_of.get(id(module))
        if path is not None and self.stack and self.stack[-1] == path:
            self.stack.pop()

    def _storages(self, value: Any) -> dict[int, int]:
        found: dict[int, int] = {}
        for t in flat_tensors(value):
            key, nbytes = _storage(t)
            if key not in self.param_keys and nbytes:
                found[key] = max(found.get(key, 0), nbytes)
                self.keep.append(t)
        return found

    def _pack(self, t: Tensor) -> Tensor:
        key, nbytes = _storage(t)
        if key in self.param_keys:  # model state, not an activation (the meter's rule)
            return t
        entry = self.saved.get(key)
        if entry is None:
            self.saved[key] = [nbytes, self.row]
            self.keep.append(t)
        else:
            entry[0] = max(entry[0], nbytes)
        return t

    def saved_as_template(self, path: str, template: str, template_out: Any, fresh: Any) -> None:
        """A repeated unit's fresh outputs are saved where the template's were saved inside the template
        (a block ending in a ReLU keeps its own output): the copied rows hold those bytes already, so a
        later op saving them again must not count them twice."""
        for kept, new in zip(flat_tensors(template_out), flat_tensors(fresh)):
            entry = self.saved.get(_storage(kept)[0])
            if entry is not None and (entry[1] == template or entry[1].startswith(template + ".")):
                key, nbytes = _storage(new)
                self.saved[key] = [nbytes, path + entry[1][len(template):]]
                self.keep.append(new)

    def count(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        name = func.__name__.split(".")[0]
        flops = _op_flops(func, args, kwargs, out)
        if flops:
            self.flops[self.row] = self.flops.get(self.row, 0.0) + flops
        gemm = _gemm_of(name, args, out)
        if gemm is not None:
            self.gemms.setdefault(self.row, []).append(gemm)

    def activation_by_row(self) -> dict[str, int]:
        by_row: dict[str, int] = {}
        for nbytes, row in self.saved.values():
            by_row[row] = by_row.get(row, 0) + nbytes
        return by_row

    def recompute_bytes(self, unit_of: dict[str, int]) -> int:
        """Distinct storages kept when each unit keeps only its inputs (torch.utils.checkpoint)."""
        kept = {key: nbytes for key, (nbytes, row) in self.saved.items() if row not in unit_of}
        for inputs in self.unit_inputs.values():
            for key, nbytes in inputs.items():
                kept[key] = max(kept.get(key, 0), nbytes)
        return sum(kept.values())

    def unit_rows(self, unit_paths: list[str], rows: list[LayerRow]) -> list[UnitRow]:
        per_unit = [0] * len(unit_paths)
        for row in rows:
            if row.unit is not None:
                per_unit[row.unit] += row.activation_bytes
        return [UnitRow(index=i, name=path, input_bytes=sum(self.unit_inputs.get(i, {}).values()),
                        activation_bytes=per_unit[i]) for i, path in enumerate(unit_paths)]


def flat_tensors(value: Any) -> Iterator[Tensor]:
    """The tensors in a model's input or output: a tensor, or nested tuples, lists and dicts of them (a
    transformers ModelOutput is a dict), depth first."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from flat_tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from flat_tensors(v)


class _FlopMode(TorchDispatchMode):
    """Hands every dispatched op to the recorder (FLOPs, GEMM shapes)."""

    def __init__(self, recorder: _Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.recorder.count(func, args, kwargs, out)
        return out


def _op_flops(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> float:
    from torch.utils.flop_counter import flop_registry, sdpa_flop_count

    packet = getattr(func, "overloadpacket", func)
    if packet in flop_registry:
        return float(flop_registry[packet](*args, **kwargs, out_val=out))
    if packet is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:  # 0 in torch's counter
        q, k, v = args[:3]
        return float(sdpa_flop_count(q.shape, k.shape, v.shape))
    return 0.0


def _gemm_of(name: str, args: tuple[Any, ...], out: Any) -> Gemm | None:
    if name in MATMUL_OPS:
        mats = [a for a in args if isinstance(a, Tensor) and a.dim() >= 2]
        if len(mats) < 2:
            return None
        a, b = mats[-2], mats[-1]  # addmm's first argument is the bias
        return Gemm(batch=a.shape[0] if a.dim() == 3 else 1, m=a.shape[-2], k=a.shape[-1], n=b.shape[-1])
    if name in CONV_OPS and isinstance(out, Tensor) and out.dim() >= 3:
        x, w = args[0], args[1]
        groups = int(args[8]) if len(args) > 8 else 1
        # Implicit GEMM per group: (batch x output positions) x (in/groups x kernel) @ (.. , out/groups).
        positions = out[0, 0].numel()
        return Gemm(batch=groups, m=out.shape[0] * positions, k=w[0].numel(), n=w.shape[0] // groups, conv=True)
    return None


# --------------------------------------------------------------------------- rows
def _rows(model: nn.Module, recorder: _Recorder, unit_of: dict[str, int]) -> list[LayerRow]:
    owned_params, owned_buffers = _ownership(model)
    activations = recorder.activation_by_row()
    kinds = {path: type(m).__name__ for path, m in model.named_modules()}
    for copy_path, template in recorder.copies.items():  # a repeated unit: the rows of the one it repeats
        for path in [p for p in kinds if p == copy_path or p.startswith(copy_path + ".")]:
            source = template + path[len(copy_path):]
            for table in (activations, recorder.flops, recorder.gemms):
                if source in table:
                    table[path] = table[source]  # type: ignore[index]
    paths = [p for p in kinds if p in owned_params or p in owned_buffers or p in activations or p in recorder.flops]
    if LOSS_ROW in activations or LOSS_ROW in recorder.flops:
        paths.append(LOSS_ROW)
    return [LayerRow(name=path, kind=kinds.get(path, "loss"), unit=unit_of.get(path),
                     params=tuple(owned_params.get(path, ())), buffer_bytes=owned_buffers.get(path, 0),
                     forward_flops=recorder.flops.get(path, 0.0), gemms=tuple(recorder.gemms.get(path, ())),
                     activation_bytes=activations.get(path, 0)) for path in paths]


def _ownership(model: nn.Module) -> tuple[dict[str, list[ParamEntry]], dict[str, int]]:
    """Each distinct parameter and buffer on the first module (in model order) that holds it."""
    seen: set[int] = set()
    params: dict[str, list[ParamEntry]] = {}
    buffers: dict[str, int] = {}
    for path, module in model.named_modules():
        for p in module._parameters.values():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            params.setdefault(path, []).append(ParamEntry(numel=p.numel(), dim0=p.shape[0] if p.dim() else 1,
                                                          element_bytes=p.element_size(), trainable=p.requires_grad))
        for b in module._buffers.values():
            if b is None or id(b) in seen:
                continue
            seen.add(id(b))
            buffers[path] = buffers.get(path, 0) + b.numel() * b.element_size()
    return params, buffers


def iter_rows(table: ModelTable, kinds: Iterable[str]) -> list[LayerRow]:
    """The table's rows whose module class is one of `kinds` (tests, reports)."""
    wanted = set(kinds)
    return [row for row in table.layers if row.kind in wanted]



# --------------------------------------------------------------------------- any workload, on its batch
def table_of_workload(spec: Any, batch: int, seed: int,
                      units_of: Callable[[nn.Module], list[nn.Module]] | None = None) -> ModelTable:
    """The table of the workload `spec` at `batch` samples: a model source (torchvision:, timm:, hf:,
    module:) is built on the meta device with a batch of its input shape; a built-in workload is built
    as it trains (under the meta device first: the models and synthetic data are then never allocated)
    and traced on its first samples."""
    model, loss_fn, x, y = _model_batch_loss(spec, batch, seed)
    units = units_of(model) if units_of is not None else []
    return trace_model_table(model, loss_fn, x, y, name=spec.name, units=units)


def _model_batch_loss(spec: Any, batch: int, seed: int) -> tuple[nn.Module, LossFn, Tensor, Tensor]:
    from ddlscope.workloads import sources

    if isinstance(spec, sources.SourceSpec):
        return _source_model_batch_loss(spec, batch, seed)
    return _builtin_model_batch_loss(spec, batch, seed)


def _source_model_batch_loss(spec: Any, batch: int, seed: int) -> tuple[nn.Module, LossFn, Tensor, Tensor]:
    from ddlscope.workloads import sources

    loss_fn: LossFn = cross_entropy
    inputs: str | None = None
    with torch.device("meta"):
        if isinstance(spec, sources.ModuleSpec):
            made = sources.user_workload(spec)
            model, inputs, loss_fn = made.model, made.inputs, made.loss or cross_entropy
            if made.datasets is not None:  # the user's own data: its first samples give the shapes
                x, y = _first_samples(made.datasets(seed)[0], batch)
                return model, loss_fn, x, y
        else:
            model = sources.model_of(spec)
    x = sources.example_input(spec, batch, "meta", inputs)
    per_position = (isinstance(spec, sources.HFSpec) and model._causal) or inputs == "tokens"
    y = torch.zeros(x.shape[:2] if per_position else x.shape[:1], dtype=torch.int64, device="meta")
    return model, loss_fn, x, y


def _builtin_model_batch_loss(spec: Any, batch: int, seed: int) -> tuple[nn.Module, LossFn, Tensor, Tensor]:
    from ddlscope.workloads import WORKLOADS

    builder = WORKLOADS.get(spec.name)
    try:
        with torch.device("meta"):
            task = builder.build(spec, seed)
            x, y = _first_samples(task.train, batch)
    except Exception:  # a workload whose data needs real tensors (read from package data): build it for real
        task = builder.build(spec, seed)
        x, y = _first_samples(task.train, batch)
    return task.model, task.loss_fn, x, y


def _first_samples(dataset: Any, batch: int) -> tuple[Tensor, Tensor]:
    """Samples 0 .. batch-1 (wrapping around a smaller dataset), as the runtime's profiler reads them."""
    return dataset.get(torch.arange(batch, device="cpu") % max(len(dataset), 1))
