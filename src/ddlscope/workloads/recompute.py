"""Activation recompute, shared by the workloads that offer it (`workload.recompute`).

`recomputed(fn, x)` runs `fn(x)` under torch.utils.checkpoint (non-reentrant): autograd keeps only
`x` and rebuilds fn's activations in backward, one more forward of fn for a smaller activation
footprint. The options, as Korthikanti et al. 2022 name them:

- none: every activation autograd saves is kept;
- selective: a transformer's attention core (from q, k, v to its output) is rebuilt: the part that
  holds s x s scores in an unfused attention (5 a s / h of REFERENCE.md's 34 + 5 a s / h per s b h);
- full: each block keeps only its input (2 s b h bytes in 16-bit, 4 s b h in fp32) and runs its
  forward again in backward.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Literal

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

Recompute = Literal["none", "selective", "full"]
BlockRecompute = Literal["none", "full"]  # networks without attention: no core to recompute selectively
RECOMPUTE_HELP = ("activation recompute (torch.utils.checkpoint): none; selective (the attention core: "
                  "transformers only); full (each block keeps only its input and runs its forward again in backward)")


def through_blocks(blocks: Iterable[nn.Module], x: Tensor, recompute: str) -> Tensor:
    """x through the blocks in turn; under full recompute each keeps only its input."""
    for block in blocks:
        x = recomputed(block, x) if recompute == "full" else block(x)
    return x


def recomputed(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """fn(x) with fn's activations rebuilt in backward instead of kept; plain fn(x) where autograd
    keeps nothing anyway (evaluation), and inside `recompute_off`."""
    _asked[0] += 1
    if _off[0] or not torch.is_grad_enabled():
        return fn(x)
    return checkpoint(fn, x, use_reentrant=False)


def recomputed_call(fn: Callable[..., Tensor], *args: object, **kwargs: object) -> Tensor:
    """`recomputed` for a block taking any arguments (a transformers decoder layer's masks and rotary
    embeddings among them): non-reentrant checkpointing passes keyword arguments through."""
    _asked[0] += 1
    if _off[0] or not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    return checkpoint(fn, *args, use_reentrant=False, **kwargs)


def recompute_blocks(blocks: Iterable[nn.Module]) -> None:
    """Make each block recompute its activations in backward (keeping only its inputs), whatever
    the model around it: the block's own forward is called through `recomputed_call`."""
    for block in blocks:
        original = block.forward
        block.forward = lambda *args, _forward=original, **kwargs: recomputed_call(_forward, *args, **kwargs)


_off, _asked = [0], [0]  # one profiling pass at a time, in one thread (runtime/profiler.py)


@contextmanager
def recompute_off() -> Iterator[list[int]]:
    """Inside, `recomputed` runs fn plainly: the model's own computation (model FLOPs, the activations it
    keeps without recompute), not what a step with recompute runs. Yields a one-element list: how many
    times the model asked for recompute meanwhile (0: it does not recompute)."""
    asked = [0]
    _off[0] += 1
    before = _asked[0]
    try:
        yield asked
    finally:
        _off[0] -= 1
        asked[0] = _asked[0] - before
