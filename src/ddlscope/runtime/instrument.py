"""Cheap measurements around the training loop: clocks and memory by category.

Memory is counted from the tensors themselves: parameters, gradients and
optimizer state (local shards only, so sharded strategies count what this
rank holds), activations as the tensors autograd saves for backward during one
measured step (through saved-tensor hooks, which cost too much to leave on
every step), and the process peak RSS (or CUDA allocator peaks) as a
cross-check.
"""

from __future__ import annotations

import resource
import sys
from contextlib import contextmanager
from typing import Any, Iterable, Iterator

import torch
from torch import Tensor, nn


def device_sync(device: torch.device) -> None:
    """Make host clocks meaningful: wait for queued device work (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def local_tensor(t: Tensor) -> Tensor:
    """The part of a (possibly sharded) tensor that lives on this rank."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _storage_key(t: Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def unique_storage_bytes(tensors: Iterable[Tensor], exclude: set[int] = frozenset()) -> int:
    """Bytes of the distinct storages behind `tensors` (views and shared buffers count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        t = local_tensor(t)
        if t.device.type == "meta" or not t.untyped_storage().nbytes():
            continue
        ptr, nbytes = _storage_key(t)
        if ptr not in exclude:
            seen[ptr] = max(seen.get(ptr, 0), nbytes)
    return sum(seen.values())


def parameter_bytes(model: nn.Module) -> int:
    return unique_storage_bytes(model.parameters())


def gradient_bytes(model: nn.Module) -> int:
    return unique_storage_bytes(p.grad for p in model.parameters() if p.grad is not None)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return unique_storage_bytes(
        v for state in optimizer.state.values() for v in state.values() if isinstance(v, Tensor) and v.dim() > 0
    )


class ActivationMeter:
    """Bytes autograd keeps for backward, counted by saved-tensor hooks.

    Parameters that autograd saves (a Linear saves its weight), and views of
    them, are excluded: they are model state, not activations. `bytes` is
    every distinct storage saved during the measured step; `peak_bytes` the
    most held at one moment (a saved tensor is let go when autograd frees it,
    after its backward): the same for a plain step, less for a pipeline
    schedule or recomputation, whose micro-batches' activations come and go.
    """

    def __init__(self, model: nn.Module):
        self._param_ptrs = {_storage_key(local_tensor(p.detach()))[0] for p in model.parameters()}
        self._model = model
        self._saved: dict[int, int] = {}
        self._live: dict[int, list[int]] = {}  # storage -> [bytes, saved tensors holding it]
        self._live_bytes = 0
        self.bytes = 0
        self.peak_bytes = 0

    def _pack(self, t: Tensor) -> Any:
        if t.device.type == "meta":
            return t
        ptr, nbytes = _storage_key(local_tensor(t))  # a DTensor (tensor parallel) holds its shard
        # Parameters are looked up at pack time: a sharded model swaps in gathered,
        # unsharded weights only while a unit runs, and those are model state too.
        if ptr in self._param_ptrs or ptr in self._current_param_ptrs():
            return t
        self._saved[ptr] = max(self._saved.get(ptr, 0), nbytes)
        entry = self._live.setdefault(ptr, [nbytes, 0])
        if entry[1] == 0:
            self._live_bytes += entry[0]
        entry[1] += 1
        self.peak_bytes = max(self.peak_bytes, self._live_bytes)
        return _Saved(t, ptr, self)

    def _release(self, ptr: int) -> None:
        entry = self._live.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self._live_bytes -= entry[0]
            del self._live[ptr]

    def _current_param_ptrs(self) -> set[int]:
        return {_storage_key(p.detach())[0] for p in self._model.parameters() if not hasattr(p, "to_local")}

    @contextmanager
    def measure(self) -> Iterator[None]:
        self._saved, self._live, self._live_bytes, self.peak_bytes = {}, {}, 0, 0
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield
        self.bytes = sum(self._saved.values())


class _Saved:
    """A saved tensor as the meter hands it to autograd: freed with the graph node that holds it."""

    __slots__ = ("tensor", "ptr", "meter")

    def __init__(self, tensor: Tensor, ptr: int, meter: ActivationMeter):
        self.tensor, self.ptr, self.meter = tensor, ptr, meter

    def __del__(self) -> None:
        self.meter._release(self.ptr)


def _unpack(packed: Any) -> Tensor:
    return packed.tensor if isinstance(packed, _Saved) else packed


def peak_process_bytes(device: torch.device) -> dict[str, int]:
    """Peak RSS of this process, plus the CUDA allocator's peaks on a GPU."""
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peaks = {"peak_rss": rss_kib * (1 if sys.platform == "darwin" else 1024)}
    if device.type == "cuda":
        peaks["cuda_peak_allocated"] = torch.cuda.max_memory_allocated(device)
        peaks["cuda_peak_reserved"] = torch.cuda.max_memory_reserved(device)
    return peaks
