"""The parameter-server family's knobs and protocol rules: ps-sync, ps-async, ssp, ps-stale-aware.

The rules (who may run ahead, how a stale gradient is scaled, which blocks a
worker exchanges) are plain arithmetic on the spec, so the servers' loop
(runtime/ps_server.py), the workers (strategies/ps.py) and the predictor
read the same ones.

- ps-sync: a server averages one push from every worker, applies the
  optimizer once, and answers all of them: the same update as DDP.
- ps-async: every push is applied on arrival (gradient / workers, so a round
  of pushes moves the model as far as one synchronous step) and answered at
  once. With block_cyclic, a worker pushes and pulls one server's block per
  step, block (worker + step) mod servers (block-partitioned asynchronous SGD
  with momentum, PAPERS.md item 2): 1/servers of the traffic, and each block
  hears from workers / servers of them per round.
- ssp: like async, but a worker that pushed step t gets its answer only when
  every worker has pushed step t - s: nobody runs more than s steps ahead of
  the slowest. s = 0 is synchronous.
- ps-stale-aware: async, with each gradient scaled by 1 / (1 + staleness)
  (staleness-aware learning rate, Zhang et al. 2016), and a full
  synchronisation (an s = 0 barrier) every `sync_every` steps.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

from pydantic import Field

from ddlscope.specs.base import ConfigError
from ddlscope.specs.strategies.batching import HeteroBatchKnobs
from ddlscope.specs.strategy import Traits, strategy_spec


class PSSpec(HeteroBatchKnobs):  # batch_split, worker_speeds: specs/strategies/batching.py
    """What every parameter-server protocol shares: the servers, which own the optimizer."""

    servers: int = Field(1, ge=1, description="server ranks, each owning a shard of the parameters")

    averages_rounds: ClassVar[bool] = False  # True: one averaged update per round (ps-sync)

    def extra_ranks(self) -> int:
        return self.servers

    def staleness_bound(self, step: int) -> float:
        """How many steps a worker that pushed `step` may run ahead of the slowest."""
        return math.inf

    def gradient_scale(self, staleness: int) -> float:
        return 1.0

    def blocks_pushed(self, worker: int, step: int) -> list[int]:
        """The servers (indices into the server ranks) a worker pushes to and pulls from at `step`."""
        return list(range(self.servers))

    def answers_before_apply(self) -> bool:
        """Whether a push is answered with the parameters before its gradient is applied (lock-free)."""
        return False

    def pushes_per_round(self, workers: int) -> float:
        """Pushes one server takes in a round of one step per worker: an asynchronous push moves the
        model 1 / this as far as a synchronous step would."""
        return workers

    def pushers(self, workers: int) -> list[int]:
        """The worker ranks that push to the servers (and tell them when done): all of them here; one
        per compute group for omnivore (specs/strategies/omnivore.py)."""
        return list(range(workers))


def _server_traits(simplicity: int, synchronous: bool) -> Traits:
    return Traits(family="server", simplicity=simplicity, synchronous=synchronous, local_optimizer=False)


@strategy_spec
class PSSyncSpec(PSSpec):
    traits = _server_traits(3, synchronous=True)
    description = "parameter server, synchronous: average every worker's push, one update, all pull"
    advice = "synchronous, but through a server"
    averages_rounds: ClassVar[bool] = True

    name: Literal["ps-sync"] = "ps-sync"

    def staleness_bound(self, step: int) -> float:
        return 0


@strategy_spec
class PSAsyncSpec(PSSpec):
    traits = _server_traits(4, synchronous=False)
    description = "parameter server, asynchronous: apply each push on arrival; staleness recorded"
    advice = "the main study's choice when workers are heterogeneous or not gang-scheduled"

    name: Literal["ps-async"] = "ps-async"
    block_cyclic: bool = Field(
        False, description="each step push one server's block of the gradient and pull that block only, "
                           "block (worker + step) mod servers: 1/servers of the traffic, each block updated "
                           "asynchronously with the servers' momentum (PAPERS.md item 2)")

    # -- Hogwild-style lock-free updates (PAPERS.md item 1, Hogbatch) -----------------------------
    lock_free: bool = Field(
        False, description="answer a push with the current parameters before its gradient is applied, as a "
                           "lock-free (Hogwild) reader would: the worker never waits for the update, and its next "
                           "gradient is one update staler")

    def check_experiment(self, exp: Any) -> None:
        super().check_experiment(exp)
        if self.lock_free and (exp.checkpoint_every or exp.checkpoint_every_s):
            raise ConfigError("strategy.lock_free cannot be combined with checkpoints (a checkpoint holds the "
                              "answers until every worker is at the cut); drop checkpoint_every or lock_free")

    def answers_before_apply(self) -> bool:
        return self.lock_free

    def blocks_pushed(self, worker: int, step: int) -> list[int]:
        return [(worker + step) % self.servers] if self.block_cyclic else super().blocks_pushed(worker, step)

    def pushes_per_round(self, workers: int) -> float:
        # A block hears from workers / servers of them per round; never scaled up when fewer.
        return max(workers / self.servers, 1.0) if self.block_cyclic else workers


@strategy_spec
class SSPSpec(PSSpec):
    traits = _server_traits(5, synchronous=False)
    description = "stale synchronous parallel: async, but no worker more than s steps ahead of the slowest"
    advice = "asynchrony with bounded staleness, for heterogeneous workers"

    name: Literal["ssp"] = "ssp"
    staleness: int = Field(2, ge=0, description="s: how many steps a worker may run ahead of the slowest")

    def staleness_bound(self, step: int) -> float:
        return self.staleness


@strategy_spec
class StaleAwareSpec(PSSpec):
    traits = _server_traits(6, synchronous=False)
    description = "async PS with lr / (1 + staleness) and a full synchronisation every sync_every steps"
    advice = "asynchrony with a staleness-aware learning rate, for heterogeneous workers"

    name: Literal["ps-stale-aware"] = "ps-stale-aware"
    sync_every: int = Field(10, ge=1, description="full synchronisation of all workers every N steps")

    def staleness_bound(self, step: int) -> float:
        return 0 if (step + 1) % self.sync_every == 0 else math.inf

    def gradient_scale(self, staleness: int) -> float:
        return 1.0 / (1 + max(staleness, 0))
