"""Workloads: models + datasets + metrics, one registry."""

from __future__ import annotations

from typing import TypeVar

from ddlscope.specs.registry import Registry
from ddlscope.workloads.base import Dataset, EvalResult, Task, TensorDataset, Workload

T = TypeVar("T")


class WorkloadRegistry(Registry[T]):
    """Workloads by name, where a model source is registered once as `SOURCE:NAME` (e.g.
    `torchvision:NAME`) and answers for every `torchvision:...` name."""

    def get(self, name: str) -> T:
        source, sep, _ = name.partition(":")
        if sep:
            for key in self.names():
                if key.partition(":")[0] == source and ":" in key:
                    return super().get(key)
        return super().get(name)

    def __contains__(self, name: object) -> bool:
        if isinstance(name, str) and ":" in name:
            return any(key.partition(":")[0] == name.partition(":")[0] for key in self.names() if ":" in key)
        return super().__contains__(name)


WORKLOADS: WorkloadRegistry[type[Workload]] = WorkloadRegistry("workload")

# Importing a module registers its workloads.
from ddlscope.workloads import digits, graph, sources, text, vision  # noqa: E402,F401

__all__ = ["WORKLOADS", "Dataset", "EvalResult", "Task", "TensorDataset", "Workload"]
