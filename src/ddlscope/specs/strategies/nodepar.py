"""`nodepar`: a graph workload's nodes split over the ranks, attention's halo exchanged each layer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from ddlscope.specs.base import ConfigError
from ddlscope.specs.strategy import StrategySpec, Traits, strategy_spec

if TYPE_CHECKING:
    from ddlscope.specs.experiment import Experiment

FLOAT_BYTES = 4
# Tensors autograd keeps per edge and head in sparse attention: the gathered q, k and v rows (head_dim
# each) and about six per-edge scalars (scores, exp, the gathered denominator, weights, ...).
SPARSE_EDGE_SCALARS = 6
# Dense attention keeps the softmax weights per node pair and head, and the boolean edge mask (a
# quarter of a float) per node pair.
DENSE_MASK_FLOATS = 0.25
# Per node and layer, in units of hidden: the block's LayerNorms, qkv, projection and 4x MLP.
NODE_HIDDEN_UNITS = 16


def attention_activation_bytes(workload: Any, ranks: int) -> float:
    """Bytes autograd saves for one training step of a graph transformer whose nodes are split `ranks`
    ways (1: the whole graph). Sparse attention costs per edge, dense per node pair."""
    nodes, hidden, heads, layers = workload.nodes, workload.hidden, workload.heads, workload.layers
    if workload.attention == "dense":
        per_layer = nodes * nodes / ranks * (heads + DENSE_MASK_FLOATS)
    else:
        per_layer = workload.edges_estimate() / ranks * (3 * hidden + SPARSE_EDGE_SCALARS * heads)
    return layers * FLOAT_BYTES * (per_layer + nodes / ranks * NODE_HIDDEN_UNITS * hidden)


@strategy_spec
class NodeParallelSpec(StrategySpec):
    # Every rank computes the forward of its own nodes (collective: the halo exchange), takes the
    # step's whole batch and keeps the loss of the nodes it owns; gradients are summed.
    traits = Traits(family="tensor", simplicity=6, collective_forward=True, splits_global_batch=False)
    description = ("graph node parallel: the graph's nodes split over the ranks, each computes its nodes' edge "
                   "attention and fetches its halo (remote in-neighbours' keys and values) with an all-to-all "
                   "per layer; 'replicate' below a memory budget")
    advice = "graph transformers whose attention (edges x heads) does not fit one device's memory"

    name: Literal["nodepar"] = "nodepar"
    mode: Literal["auto", "replicate", "node-parallel"] = Field(
        "auto", description="auto: replicate the graph when its activations fit memory_budget_bytes, else split")
    memory_budget_bytes: int = Field(256 * 2**20, ge=1, description="activation bytes one rank may hold (auto mode)")

    def resolved_mode(self, workload: Any, ranks: int) -> str:
        """replicate or node-parallel: auto replicates (no halo traffic) while the whole graph fits."""
        if self.mode != "auto":
            return self.mode
        if ranks == 1 or attention_activation_bytes(workload, 1) <= self.memory_budget_bytes:
            return "replicate"
        return "node-parallel"

    def check_experiment(self, exp: "Experiment") -> None:
        if not hasattr(exp.workload, "edges_estimate"):
            raise ConfigError(f"workload.name = {exp.workload.name!r}: strategy nodepar splits a graph's nodes; "
                              "use the graph-transformer workload")
        if exp.cluster.world_size > exp.workload.nodes // 2:
            raise ConfigError(f"cluster.world_size = {exp.cluster.world_size}: strategy nodepar needs at least "
                              f"2 nodes per rank (workload.nodes = {exp.workload.nodes})")
        if exp.checkpoint_every or exp.checkpoint_every_s or exp.checkpoint_dir or exp.cluster.max_restarts:
            raise ConfigError("checkpoint_every: strategy nodepar does not checkpoint yet; drop checkpoints and "
                              "cluster.max_restarts")
