"""Memory per rank, by category, of a model table under a strategy: priced from the strategy's traits.

Torch-free: reads a ModelTable (specs/model_table.py) and a strategy spec's
Traits, never a strategy's name. Categories are the runtime's
(runtime/loop.py records parameters, gradients, optimizer, activations) plus
two it does not count, buffers and communication buffers:

- parameters, gradients: replicated, or split over the ranks when the traits
  say the model states are sharded (`shards_model_states`: FSDP2's Shard(0),
  each parameter's rows padded to a multiple of the world size, as
  `fully_shard` allocates them) or the model is cut into stages
  (`stages_model`: the pipeline family);
- optimizer: AdamW keeps two fp32 tensors per parameter, SGD one with
  momentum (none without); sharded like the parameters; none on a worker whose
  optimizer steps elsewhere (`local_optimizer = False`): the extra ranks
  (parameter servers) hold it, each for its contiguous share of the
  flattened parameters;
- activations: the table's saved bytes per sample x the samples a rank runs
  (`splits_global_batch`); with recompute each unit keeps only its input (what
  the runtime counts), and backward rebuilds one unit at a time on top of it
  (`transient_bytes`, in the total);
- buffers: BatchNorm statistics and the like, on every rank;
- communication: the flat buffers the strategy's exchange allocates
  (replicated collectives: one gradient-sized set of buckets; sharded: the
  gathered root, the running and the prefetched unit, and one unit's
  reduce-scatter input; servers: the pushed gradient and the pulled
  parameters; decentralized and federated: one received model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ddlscope.specs.model_table import ModelTable, ParamEntry
from ddlscope.specs.strategy import Traits

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "buffers", "communication")
# The categories the runtime measures per rank (runtime/loop.py): what an estimate is checked against.
MEASURED_CATEGORIES = ("parameters", "gradients", "optimizer", "activations")
FP32_BYTES = 4
FSDP_PREFETCHED_UNITS = 2  # the unit running and the next one, gathered ahead


@dataclass(frozen=True)
class MemoryQuery:
    """What a strategy, a cluster and a workload say about one rank's memory."""

    traits: Traits
    world_size: int
    global_batch: int
    extra_ranks: int = 0  # parameter servers beyond the world size
    optimizer: str = "adamw"
    momentum: float = 0.0
    recompute: bool = False

    @property
    def per_rank_batch(self) -> int:
        return self.global_batch // self.world_size if self.traits.splits_global_batch else self.global_batch


@dataclass
class RankMemory:
    """Bytes per category on one rank; `role` says which ranks (worker, server). `transient_bytes` is
    held only for a while on top of them: under recompute, one unit's activations rebuilt in backward."""

    role: str
    bytes: dict[str, float] = field(default_factory=dict)
    transient_bytes: float = 0.0

    @property
    def total_bytes(self) -> float:
        return sum(self.bytes.values()) + self.transient_bytes


def price(table: ModelTable, query: MemoryQuery) -> list[RankMemory]:
    """Per-rank memory of a worker (rank 0: the largest shard), and of a server where there are any.

    The table's parameters are priced in the dtype they were traced in (fp32 on CPU runs)."""
    worker = RankMemory("worker", transient_bytes=_rebuilt_bytes(table, query), bytes={
        "parameters": _model_state_bytes(table.params, query),
        "gradients": _model_state_bytes([p for p in table.params if p.trainable], query),
        "optimizer": _worker_optimizer_bytes(table, query),
        "activations": _activation_bytes(table, query),
        "buffers": float(table.buffer_bytes),
        "communication": _communication_bytes(table, query),
    })
    ranks = [worker]
    if query.extra_ranks and not query.traits.local_optimizer:
        ranks.append(_server(table, query))
    return ranks


# --------------------------------------------------------------------------- model states
def _splits_model(traits: Traits) -> bool:
    """Whether each rank holds only its part of the model's states."""
    return traits.shards_model_states or traits.stages_model


def _model_state_bytes(params: list[ParamEntry] | tuple[ParamEntry, ...], query: MemoryQuery) -> float:
    """Rank 0's bytes of `params`: all of them, its Shard(0) rows, or its share of the stages."""
    traits, n = query.traits, query.world_size
    if traits.shards_model_states:
        return float(sum(_shard_rows(p.dim0, n) * (p.numel // p.dim0) * p.element_bytes for p in params))
    total = float(sum(p.bytes for p in params))
    return total / n if traits.stages_model else total


def _shard_rows(dim0: int, ranks: int) -> int:
    """Rows of a `dim0`-row tensor on rank 0 under Shard(0): torch.chunk's ceil(dim0 / ranks), the most any
    rank holds (FSDP2 pads every rank's storage to it; later ranks' optimizer states hold fewer)."""
    return math.ceil(dim0 / ranks)


def optimizer_states_per_param(optimizer: str, momentum: float) -> int:
    """State tensors per parameter, each fp32 of its size: AdamW exp_avg and exp_avg_sq (its step counter
    is a scalar, which the runtime does not count); SGD a momentum buffer when momentum > 0."""
    if optimizer == "adamw":
        return 2
    return 1 if momentum > 0 else 0


def _worker_optimizer_bytes(table: ModelTable, query: MemoryQuery) -> float:
    if not query.traits.local_optimizer:
        return 0.0  # it steps on the servers; the worker's optimizer never creates state
    states = optimizer_states_per_param(query.optimizer, query.momentum)
    trainable = [p for p in table.params if p.trainable]
    return states * _model_state_bytes(trainable, query)


def _server(table: ModelTable, query: MemoryQuery) -> RankMemory:
    """A server: a contiguous 1/servers of the flattened parameters (fp32) and the optimizer over it."""
    shard_bytes = FP32_BYTES * math.ceil(table.param_count / query.extra_ranks)
    states = optimizer_states_per_param(query.optimizer, query.momentum)
    return RankMemory("server", {"parameters": float(shard_bytes), "gradients": 0.0,
                                 "optimizer": float(states * shard_bytes), "activations": 0.0, "buffers": 0.0,
                                 "communication": float(shard_bytes)})


# --------------------------------------------------------------------------- activations
def _activation_bytes(table: ModelTable, query: MemoryQuery) -> float:
    """What autograd keeps through the step: with recompute, what the units keep (their inputs)."""
    recomputing = query.recompute and table.units
    return _per_rank(table.activation_bytes_recompute if recomputing else table.activation_bytes, table, query)


def _rebuilt_bytes(table: ModelTable, query: MemoryQuery) -> float:
    """Under recompute, backward rebuilds one unit's activations at a time: the largest, for a while."""
    return _per_rank(table.largest_unit_activation_bytes, table, query) if query.recompute else 0.0


def _per_rank(traced_bytes: float, table: ModelTable, query: MemoryQuery) -> float:
    """Bytes counted at the table's batch, at the rank's batch."""
    if query.per_rank_batch < 1:
        return 0.0
    scaled = traced_bytes * query.per_rank_batch / table.traced_batch
    # A model cut over the ranks (stages, heads) runs 1/world of its layers per rank: a first-order share.
    return scaled / query.world_size if query.traits.splits_layers else scaled


# --------------------------------------------------------------------------- communication buffers
def _communication_bytes(table: ModelTable, query: MemoryQuery) -> float:
    traits = query.traits
    gradient_bytes = float(table.trainable_bytes)
    if traits.single_process or query.world_size == 1:
        return 0.0
    if traits.shards_model_states and not traits.stages_model:
        return _sharded_exchange_bytes(table)
    if traits.family == "server":
        return 2.0 * gradient_bytes  # the flat push of the gradient, the pulled parameters
    if traits.family == "collective":
        return gradient_bytes  # the flat all-reduce buckets (DDP) or the averaged model (local SGD)
    if traits.family in ("decentralized", "federated"):
        return float(table.param_bytes)  # a neighbour's or the server's model, received whole
    return 0.0


def _sharded_exchange_bytes(table: ModelTable) -> float:
    """FSDP2's all-gather outputs and reduce-scatter input at their peak: the root's parameters (gathered
    for the whole step), the running and the prefetched unit's, and the largest unit's gradients."""
    *blocks, root = table.unit_param_bytes()
    largest_block = max(blocks, default=0)
    gathered = root + FSDP_PREFETCHED_UNITS * largest_block
    return float(gathered + max(largest_block, root))


# --------------------------------------------------------------------------- fitting
def fits(rank: RankMemory, device_memory_bytes: float, framework_overhead_bytes: float) -> bool:
    return rank.total_bytes + framework_overhead_bytes <= device_memory_bytes
