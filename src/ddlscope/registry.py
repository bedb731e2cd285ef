"""A tiny plugin registry: one per plugin kind (workloads, strategies, studies).

Adding a plugin is one new module plus one decorator::

    @WORKLOADS.register("mlp-digits")
    class MlpDigits(Workload): ...
"""

from __future__ import annotations

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
