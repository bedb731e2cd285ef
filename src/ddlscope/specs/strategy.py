"""What a strategy is, torch-free: its knobs (a pydantic spec) and its traits.

Every layer reads the traits, never a list of names: the runtime (who
evaluates, who steps the optimizer), the predictor (which machine probes
hold a step's waits), the advisor (synchronous or not, which to prefer among
near-ties), studies and reports. A strategy's spec is one module in
specs/strategies/ with one decorator::

    @strategy_spec
    class MineSpec(StrategySpec):
        traits = Traits(family="collective", simplicity=10)
        description = "one line for `ddlscope strategies`"
        advice = "when advise recommends it, why"
        name: Literal["mine"] = "mine"
        period: int = Field(4, ge=1, description="...")

Its runtime class (strategies/) and its estimator (predict/estimators/) are
registered against the spec class; tests/test_contract.py checks that each
registered spec has both, and a paragraph in docs/strategies.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import Field

from ddlscope.specs.base import Spec, remember_spec_class
from ddlscope.specs.registry import Registry

Family = Literal["single", "collective", "server", "decentralized", "pipeline", "tensor", "federated"]


@dataclass(frozen=True)
class Traits:
    """How a strategy uses the cluster; checked before any process starts and read by every layer."""

    family: Family
    # Lower is simpler: among strategies within a few percent of each other, advise prefers the simpler.
    simplicity: int
    synchronous: bool = True  # every worker applies the same update each step
    collective_forward: bool = False  # a forward pass needs every rank (sharded parameters): all evaluate
    local_optimizer: bool = True  # False: the optimizer steps elsewhere (a server); workers only zero gradients
    splits_global_batch: bool = True  # each rank takes batch_size / world_size samples
    single_process: bool = False  # only world_size 1 makes sense
    shards_model_states: bool = False  # parameters, gradients and optimizer state split over the ranks
    # Synchronises through a collective inside groups of workers and through a server across them
    # (Omnivore): neither the main study's parameter servers nor its collectives.
    hybrid: bool = False

    @property
    def stages_model(self) -> bool:
        """The model cut into consecutive stages, one per rank, each rank holding only its stage's states
        (the pipeline family)."""
        return self.family == "pipeline"

    @property
    def splits_layers(self) -> bool:
        """Each rank runs only its share of the model's layers (pipeline stages, tensor-parallel heads), so
        it keeps about 1 / world of the activations."""
        return self.family in ("pipeline", "tensor")


class StrategySpec(Spec):
    """Fields shared by every strategy; subclasses add their knobs and declare their traits."""

    traits: ClassVar[Traits]
    description: ClassVar[str]  # one line for `ddlscope strategies`
    registered_name: ClassVar[str]  # set by the registry (strategy_spec): the name a config gives
    advice: ClassVar[str]  # what the main study's decision framework says of it (advise's recommendation)

    name: str = Field(description="registered strategy name")

    def extra_ranks(self) -> int:
        """Processes beyond cluster.world_size training ranks (e.g. parameter servers)."""
        return 0

    def check_experiment(self, exp: Any) -> None:
        """Refuse (ConfigError, one line) what this strategy cannot run with the experiment's workload
        and cluster; called by specs.experiment.check_consistency before any process starts."""


STRATEGY_SPECS: Registry[type[StrategySpec]] = Registry("strategy")

S = TypeVar("S", bound=type[StrategySpec])


def strategy_spec(cls: S) -> S:
    """Register a strategy's spec under the default of its `name` field."""
    name = cls.model_fields["name"].default
    if not isinstance(name, str) or not name:
        raise TypeError(f"{cls.__name__} needs a `name: Literal[...] = ...` default")
    remember_spec_class(cls)
    return STRATEGY_SPECS.register(name)(cls)


def strategy_specs() -> list[type[StrategySpec]]:
    """Every registered strategy spec, simplest first."""
    return sorted((cls for _, cls in STRATEGY_SPECS.items()), key=lambda c: (c.traits.simplicity, c.__name__))


def traits_of(name: str) -> Traits | None:
    """A registered strategy's traits, None for a name no spec registers (e.g. an old stored run's)."""
    return STRATEGY_SPECS.get(name).traits if name in STRATEGY_SPECS else None


def baseline_strategy() -> str:
    """The registered one-process strategy (`single_process`), the simplest if several: what a one-rank
    experiment runs when it names none."""
    return next(cls.registered_name for cls in strategy_specs() if cls.traits.single_process)


def is_baseline(name: str) -> bool:
    """Whether runs of this strategy are the one-process baseline that speedups divide by."""
    traits = traits_of(name)
    return traits is not None and traits.single_process
