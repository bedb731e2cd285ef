"""Federated training: fedavg and the block-cyclic per-block variants mm-psgd and mc-psgd (PAPERS.md item 5).

Each rank is a client that holds its own part of the training set (`partition`:
iid, Dirichlet(alpha) label skew, block-cyclic, or the whole set replicated).
One step of the run is one round (McMahan et al. 2017): the sampled clients
(`client_fraction` of them) each train `local_epochs` epochs over their data in
minibatches of `workload.batch_size` (or exactly `local_steps` minibatches),
then the models are averaged, weighted by the clients' sample counts; clients
not sampled this round contribute nothing and receive the average.

Block-cyclic data (Ding et al., "Distributed optimization over block-cyclic
data"): a cycle has `blocks` blocks of `rounds_per_block` rounds each; during
block b every client's data follow block b's distribution. The per-block
variants keep one predictor per block:
- mm-psgd: the global model trains on every block (block-mixed); block b's
  predictor is the average of the global models that ended block b in each
  cycle so far.
- mc-psgd: also a block-separate chain per block (trained only during its
  block, starting from the global model the first time its block comes); block
  b's predictor is whichever of mm-psgd's average and that chain has the lower
  loss on the clients' block-b data.

The data layout itself (who holds which samples, in what order) is in
ddlscope.workloads.partition, torch-free.
"""

from __future__ import annotations

import random
from typing import Any, Literal

from pydantic import Field, model_validator

from ddlscope.specs.base import ConfigError
from ddlscope.specs.strategy import StrategySpec, Traits, strategy_spec

Partition = Literal["iid", "dirichlet", "block-cyclic", "replicated"]


@strategy_spec
class FedAvgSpec(StrategySpec):
    # Each client takes workload.batch_size samples per local step, from its own data.
    traits = Traits(family="federated", simplicity=6, splits_global_batch=False)
    description = "FedAvg: each rank a client on its own data partition; rounds of local epochs, weighted averages"
    advice = "data that must stay on its clients: local epochs per round, one weighted model average per round"

    name: Literal["fedavg"] = "fedavg"
    partition: Partition = Field("iid", description="iid, dirichlet (label skew), block-cyclic, or replicated "
                                                     "(every client holds the whole set, in the same order)")
    alpha: float = Field(0.5, gt=0, le=1e4, description="Dirichlet concentration of the label skew (small: each "
                                                       "client holds few labels)")
    blocks: int = Field(2, ge=1, le=10, description="block-cyclic: blocks per cycle (the labels split into this "
                                                    "many groups, one per block)")
    rounds_per_block: int = Field(2, ge=1, description="block-cyclic: rounds spent in a block before the next")
    block_purity: float = Field(1.0, ge=0, le=1, description="block-cyclic: fraction of a block's samples drawn "
                                                             "from its own label group (1: disjoint blocks)")
    local_epochs: int = Field(1, ge=1, le=1000, description="E: epochs over the client's data per round")
    local_steps: int = Field(0, ge=0, description="exactly this many local minibatches per round instead of "
                                                  "local_epochs (0: off)")
    client_fraction: float = Field(1.0, gt=0, le=1, description="C: fraction of the clients sampled each round "
                                                                "(at least one)")
    size_skew: float = Field(0.0, ge=0, le=3, description="unbalanced clients: sizes drawn lognormal with this "
                                                          "sigma (0: equal sizes)")

    def check_experiment(self, exp: Any) -> None:
        if exp.workload.data != "memory":
            raise ConfigError(f"workload.data = {exp.workload.data!r}: strategy {self.name} deals each client its "
                              "samples from the in-memory split (its partition); use data = 'memory'")
        # The labels split into `blocks` groups: more blocks than labels leaves blocks without data. The
        # workload's label count where its spec says it (a generated graph's communities, a source's classes).
        labels = getattr(exp.workload, "communities", None) or getattr(exp.workload, "classes", None)
        if self.partition == "block-cyclic" and isinstance(labels, int) and self.blocks > labels:
            raise ConfigError(f"strategy.blocks = {self.blocks}: more blocks than the workload's {labels} labels "
                              f"(some blocks would hold no samples); use at most {labels}")
        if self.partition == "block-cyclic" and self.blocks > 1 and exp.workload.steps < self.rounds_per_block:
            raise ConfigError(f"workload.steps = {exp.workload.steps}: a federated run's steps are rounds; "
                              f"block-cyclic data needs at least rounds_per_block = {self.rounds_per_block}")

    def block_of_round(self, round_: int) -> int:
        """The block whose distribution the clients' data follow in this round (0 without block-cyclic data)."""
        if self.partition != "block-cyclic":
            return 0
        return (round_ // self.rounds_per_block) % self.blocks

    def ends_block(self, round_: int) -> bool:
        """Whether this round is the last one of its block in the current cycle."""
        return self.partition == "block-cyclic" and (round_ + 1) % self.rounds_per_block == 0

    def sampled_clients(self, round_: int, clients: int, seed: int) -> list[int]:
        """The clients that train in this round: the same on every rank (seeded by the run's seed and the
        round), at least one, `client_fraction` of them rounded."""
        take = max(1, int(round(self.client_fraction * clients)))
        if take >= clients:
            return list(range(clients))
        rng = random.Random(seed * 1_000_003 + round_)
        return sorted(rng.sample(range(clients), take))

    def per_block(self) -> bool:
        """Whether the strategy keeps one predictor per block."""
        return False

    def models_trained_per_round(self) -> int:
        """Models each sampled client trains and the ranks average in a round."""
        return 1


class PerBlockSpec(FedAvgSpec):
    """The per-block variants: block-cyclic data, one predictor per block."""

    partition: Partition = Field("block-cyclic", description="must be block-cyclic: the per-block predictors "
                                                              "follow its blocks")

    @model_validator(mode="after")
    def _block_cyclic(self) -> "PerBlockSpec":
        if self.partition != "block-cyclic":
            raise ValueError(f"partition = {self.partition!r}: {self.name} keeps one predictor per block of "
                             "block-cyclic data; use partition = 'block-cyclic'")
        return self

    def per_block(self) -> bool:
        return True


@strategy_spec
class MMPSGDSpec(PerBlockSpec):
    traits = Traits(family="federated", simplicity=7, splits_global_batch=False)
    description = ("MM-PSGD: FedAvg on block-cyclic data; block b's predictor averages the global models that "
                   "ended block b in each cycle")
    advice = "block-cyclic client data: one predictor per block, at no extra training cost"

    name: Literal["mm-psgd"] = "mm-psgd"


@strategy_spec
class MCPSGDSpec(PerBlockSpec):
    traits = Traits(family="federated", simplicity=8, splits_global_batch=False)
    description = ("MC-PSGD: MM-PSGD plus a block-separate chain per block; block b's predictor is the better of "
                   "the two on the clients' block-b data")
    advice = "block-cyclic client data with distinct blocks: a separate chain per block, twice the training"

    name: Literal["mc-psgd"] = "mc-psgd"

    def models_trained_per_round(self) -> int:
        return 2  # the block-mixed global model and the block's own chain
