"""`partitioned`: the network cut into parts trained independently against synthetic targets (PAPERS.md
item 20, partitioned training with synthetic intermediate labels).

Part k runs on rank k. Its input is part k - 1's output (detached: sent forward, never a gradient back);
its loss compares its own output with a synthetic target of the labels, so no backward crosses parts and
a rank holds only its part's weights, gradients, optimizer state and activations. The last part's loss
is the workload's own. With one part it is plain one-process training.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, PrivateAttr

from ddlscope.specs.base import ConfigError
from ddlscope.specs.strategy import StrategySpec, Traits, strategy_spec

if TYPE_CHECKING:
    from ddlscope.specs.experiment import Experiment

@strategy_spec
class PartitionedSpec(StrategySpec):
    # Every rank reads the whole batch (part 0 the inputs, every part the labels for its target); the
    # model is the parts in sequence, so evaluation needs every rank. Not synchronous in the traits'
    # sense: each part follows its own loss, which is not the end-to-end update.
    traits = Traits(family="pipeline", simplicity=9, synchronous=False, collective_forward=True,
                    splits_global_batch=False, shards_model_states=True)
    description = ("the network cut into parts, one per rank, each trained on its own loss against a synthetic "
                   "target of the labels; activations go forward only, no gradient crosses parts")
    advice = ("when a device holds only a part of the model and end-to-end accuracy may be traded for memory "
              "and independence (no backward pass between devices)")

    name: Literal["partitioned"] = "partitioned"
    partition: list[int] = Field(
        default_factory=list,
        description="cut points into the model's layer sequence (an nn.Sequential's modules, a GPT's "
                    "embedding/blocks/head, a model source's layers in forward order): world_size - 1 "
                    "increasing indices where parts 1, 2, ... start; empty: the layers with parameters split "
                    "as evenly as possible")
    target_scale: float = Field(1.0, gt=0, le=1e6, description="standard deviation of the synthetic target vectors: "
                                                       "each class's fixed random vector per part")

    # What check_experiment saw, for the runtime's check_model (handed this spec alone), which counts a
    # model source's layers from the built model.
    _world_size: int | None = PrivateAttr(None)
    _workload: str | None = PrivateAttr(None)

    def check_experiment(self, exp: "Experiment") -> None:
        self._world_size, self._workload = exp.cluster.world_size, exp.workload.name
        if exp.checkpoint_every or exp.checkpoint_every_s or exp.checkpoint_dir or exp.cluster.max_restarts:
            raise ConfigError("checkpoint_every: strategy partitioned does not checkpoint yet (each rank holds "
                              "another part); drop checkpoints and cluster.max_restarts")
        parts = exp.cluster.world_size
        if self.partition and len(self.partition) != parts - 1:
            raise ConfigError(f"strategy.partition = {self.partition}: {parts} parts (one per rank) need "
                              f"{parts - 1} cut points")
        if any(b <= a for a, b in zip([0, *self.partition], self.partition)):
            raise ConfigError(f"strategy.partition = {self.partition}: cut points must increase strictly from 1")


def even_cuts(with_params: list[int], parts: int) -> list[int]:
    """Cut points that give each part an equal share (as near as can be) of the layers with parameters:
    part k starts at the (k n / parts)-th such layer. `with_params` are their indices, increasing."""
    n = len(with_params)
    if parts > n:
        raise ConfigError(f"cluster.world_size = {parts}: strategy partitioned needs a layer with parameters per "
                          f"part and the model has {n}")
    return [with_params[(k * n) // parts] for k in range(1, parts)]
