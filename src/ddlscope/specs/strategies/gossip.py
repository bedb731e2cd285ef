"""`gossip`: decentralised averaging with neighbours, no server (PAPERS.md item 11, without its privacy part).

After each local optimizer step a worker sends its parameters to its
neighbours in the topology, receives theirs, and keeps the uniform mean of
its own and theirs (weight 1 / (degree + 1) each). Every topology here is
symmetric and regular, so the mixing matrix is doubly stochastic and the
workers' mean model moves like synchronous SGD's. On the complete graph the
mean over all is global averaging: local SGD with period 1.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

from ddlscope.specs.strategy import StrategySpec, Traits, strategy_spec

Topology = Literal["ring", "torus", "exponential", "complete"]


@strategy_spec
class GossipSpec(StrategySpec):
    traits = Traits(family="decentralized", simplicity=7, synchronous=False)
    description = "gossip: each step average the model with the neighbours in a ring, torus, exponential or complete graph"
    advice = "no central server or global collective: each worker talks to a few neighbours only"

    name: Literal["gossip"] = "gossip"
    topology: Topology = Field("ring", description="ring (2 neighbours), torus (2-D, up to 4), exponential "
                                                   "(ranks at distance 2^k), complete (everybody)")

    def neighbours(self, rank: int, world: int) -> list[int]:
        """The ranks `rank` exchanges with, sorted; symmetric (j in i's list iff i in j's) and never itself."""
        if self.topology == "complete":
            peers = set(range(world))
        elif self.topology == "ring":
            peers = {(rank + 1) % world, (rank - 1) % world}
        elif self.topology == "exponential":
            peers = {(rank + sign * 2**k) % world for k in range(max(1, math.ceil(math.log2(world))))
                     for sign in (1, -1) if 2**k < world}
        else:
            rows = torus_rows(world)
            cols = world // rows
            r, c = divmod(rank, cols)
            peers = {((r + dr) % rows) * cols + (c + dc) % cols for dr, dc in ((1, 0), (-1, 0), (0, 1), (0, -1))}
        return sorted(peers - {rank})


def torus_rows(world: int) -> int:
    """The 2-D torus' rows: the largest divisor of `world` not above its square root (1 row: a ring)."""
    return max(d for d in range(1, math.isqrt(world) + 1) if world % d == 0)
