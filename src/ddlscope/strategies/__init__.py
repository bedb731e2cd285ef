"""Strategies' runtime classes: one module each, registered against the strategy's spec class.

Importing this package imports every module in it, so adding a strategy's
runtime is one new module and one `@RUNTIMES.register(MySpec)`.
"""

from ddlscope.specs import StrategySpec
from ddlscope.specs.registry import ImplementationRegistry, import_submodules
from ddlscope.strategies.base import RunContext, Strategy
from ddlscope.strategies.comm import CommRecorder, CommStats

RUNTIMES: ImplementationRegistry[type[Strategy]] = ImplementationRegistry("runtime class")


def runtime_class(spec: StrategySpec) -> type[Strategy]:
    """The runtime class that trains with `spec`."""
    return RUNTIMES.get(type(spec))


import_submodules("ddlscope.strategies")

__all__ = ["RUNTIMES", "CommRecorder", "CommStats", "RunContext", "Strategy", "runtime_class"]
