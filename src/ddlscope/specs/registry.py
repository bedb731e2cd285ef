"""Tiny plugin registries: one by name per plugin kind (workloads, strategies, studies), and one
by spec class per layer that implements a strategy (runtime classes, estimators).

Adding a plugin is one new module plus one decorator::

    @WORKLOADS.register("mlp-digits")
    class MlpDigits(Workload): ...
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class UnknownPluginError(KeyError):
    """Raised for a name that no plugin of this kind registered."""

    def __init__(self, kind: str, name: str, known: list[str]):
        self.kind, self.name, self.known = kind, name, known
        super().__init__(f"unknown {kind} {name!r}; known: {', '.join(known)}")

    def __str__(self) -> str:  # KeyError quotes its message otherwise
        return self.args[0]


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorate(item: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = item
            setattr(item, "registered_name", name)
            return item

        return decorate

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise UnknownPluginError(self.kind, name, self.names()) from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def items(self) -> list[tuple[str, T]]:
        return sorted(self._items.items())

    def __contains__(self, name: object) -> bool:
        return name in self._items


class ImplementationRegistry(Generic[T]):
    """What implements a spec class in one layer (its runtime class, its estimator), keyed by the class.

    A lookup walks the spec class's bases, so a family that shares one
    implementation registers it once against the family's base spec.
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[type, T] = {}

    def register(self, *spec_classes: type) -> Callable[[T], T]:
        def decorate(item: T) -> T:
            for spec_class in spec_classes:
                if spec_class in self._items:
                    raise ValueError(f"{spec_class.__name__} has two {self.kind}s")
                self._items[spec_class] = item
            return item

        return decorate

    def find(self, spec_class: type) -> T | None:
        return next((self._items[c] for c in spec_class.__mro__ if c in self._items), None)

    def get(self, spec_class: type) -> T:
        item = self.find(spec_class)
        if item is None:
            raise LookupError(f"no {self.kind} is registered for {spec_class.__name__}")
        return item


def import_submodules(package_name: str) -> list[str]:
    """Import every module of a package, so that each registers its plugins: adding a plugin is
    adding a file, with no import list to keep."""
    package = importlib.import_module(package_name)
    names = sorted(info.name for info in pkgutil.iter_modules(package.__path__) if not info.name.startswith("_"))
    for name in names:
        importlib.import_module(f"{package_name}.{name}")
    return names
