"""Per-strategy estimators: one module each, registered against the strategy's spec class.

An estimator prices its strategy twice: on a GPU cluster from the hardware
catalogue (`cluster`, what advise ranks) and on this machine from its
calibration (`local`, what `predict --against RUN` compares with a run).
Importing this package imports every module in it.
"""

from ddlscope.predict.estimators.base import ClusterCase, Estimator, LocalCase, LocalComm, LocalStep
from ddlscope.specs import StrategySpec
from ddlscope.specs.registry import ImplementationRegistry, import_submodules

ESTIMATORS: ImplementationRegistry[type[Estimator]] = ImplementationRegistry("estimator")


def estimator_for(spec: StrategySpec) -> Estimator:
    """The estimator of `spec`'s strategy."""
    return ESTIMATORS.get(type(spec))()


import_submodules("ddlscope.predict.estimators")

__all__ = ["ESTIMATORS", "ClusterCase", "Estimator", "LocalCase", "LocalComm", "LocalStep", "estimator_for"]
