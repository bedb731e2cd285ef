"""`omnivore`: compute groups, synchronous inside a group, asynchronous across groups (PAPERS.md item 15).

Omnivore (Hadjis et al. 2016) splits the workers into `groups` compute
groups of equal size, contiguous ranks. Inside a group the workers all-reduce
their gradients (synchronous SGD on the group's share of the batch); the
group's first rank, its leader, pushes the group's mean gradient to the
parameter servers as one push, pulls the model back and broadcasts it inside
the group. Across groups the servers apply pushes as they arrive, ps-async's
rule with `workers` replaced by `groups`: each push is scaled by 1 / groups,
so a round of one push per group moves the model as far as one synchronous
step. groups = 1 is `ps-sync`'s update (one push, the whole batch's mean),
groups = workers is `ps-async`'s.

The paper's other half, the tuner, is torch-free arithmetic here too: each
group's asynchrony acts like implicit momentum of about 1 - 1/groups, so the
explicit momentum that keeps the total at a target is
max(0, target - (1 - 1/groups)) (`compensated_momentum`); the probes and the
choice are in analysis/omnivore_tuner.py.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from ddlscope.specs.base import ConfigError
from ddlscope.specs.strategies.ps import PSSpec
from ddlscope.specs.strategy import Traits, strategy_spec


def implicit_momentum(groups: int) -> float:
    """The momentum asynchrony across `groups` groups adds, as the Omnivore paper models it: 1 - 1/groups."""
    return 1.0 - 1.0 / groups


def compensated_momentum(target: float, groups: int) -> float:
    """The explicit momentum that keeps explicit + implicit at `target` with `groups` groups (never below 0),
    to 4 decimals. Groups of one worker each are plain asynchrony among the workers (Mitliagkas et al. 2016,
    "Asynchrony begets momentum"): the main study lowers ps-async's momentum by this too."""
    return round(max(0.0, target - implicit_momentum(groups)), 4)


def group_members(workers: int, groups: int) -> list[list[int]]:
    """The ranks of each compute group: `groups` contiguous groups of workers / groups ranks."""
    size = workers // groups
    return [list(range(g * size, (g + 1) * size)) for g in range(groups)]


@strategy_spec
class OmnivoreSpec(PSSpec):
    traits = Traits(family="server", simplicity=6, synchronous=False, local_optimizer=False, hybrid=True)
    description = ("Omnivore: compute groups all-reduce inside, push to the parameter server asynchronously "
                   "across groups (groups = 1: ps-sync, groups = workers: ps-async)")
    advice = ("many workers on a slow or uneven network: synchronous groups keep the gradient fresh, asynchrony "
              "across groups keeps a slow group from holding the others")

    name: Literal["omnivore"] = "omnivore"
    # Default 1 (ps-sync's update): valid for any world size, so `advise`, which validates with the run
    # section's placeholder world of 1, prices it too; its estimator takes the largest divisor of the GPUs.
    groups: int = Field(1, ge=1, description="compute groups: equal, contiguous ranks; must divide "
                                             "cluster.world_size (1: ps-sync's update, world_size: ps-async's)")

    def check_experiment(self, exp: Any) -> None:
        super().check_experiment(exp)
        workers = exp.cluster.world_size
        if self.groups > workers or workers % self.groups:
            raise ConfigError(f"strategy.groups = {self.groups}: must divide cluster.world_size = {workers} "
                              f"(equal compute groups); allowed: "
                              f"{', '.join(str(k) for k in range(1, workers + 1) if workers % k == 0)}")
        if exp.cluster.preemptions:
            raise ConfigError("cluster.preemptions: strategy omnivore cannot lose a worker (its group's all-reduce "
                              "waits for it); use ps-async, ssp or ps-stale-aware")
        if exp.checkpoint_every or exp.checkpoint_every_s or exp.checkpoint_dir:
            raise ConfigError("checkpoint_every: strategy omnivore does not checkpoint yet (only group leaders "
                              "talk to the servers); drop the checkpoint settings")

    def group_size(self, workers: int) -> int:
        return workers // self.groups

    def pushers(self, workers: int) -> list[int]:
        """Only each group's leader (its first rank) pushes to the servers."""
        return [members[0] for members in group_members(workers, self.groups)]
