"""A tiny name -> object registry (advantage estimators, policy losses, aggregations, KL estimators)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to objects (usually functions); ``kind`` only appears in error messages.

    >>> R = Registry("thing")
    >>> @R.register("a")
    ... def a(): ...
    >>> R.get("a") is a
    True
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: register the decorated object under ``name`` (a name may be registered once)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"name: a {self.kind} name must be a non-empty string, got {name!r}")

        def deco(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"name: {self.kind} {name!r} is already registered")
            self._items[name] = obj
            return obj

        return deco

    def get(self, name: str) -> T:
        """The object registered as ``name``; KeyError naming it and listing the known names otherwise."""
        try:
            return self._items[name]
        except (KeyError, TypeError):
            known = ", ".join(self.names()) or "(none)"
            raise KeyError(f"unknown {self.kind} {name!r}; known: {known}") from None

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"
