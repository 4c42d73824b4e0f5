"""Parsers of model answers chosen by name on the server's command line (tool calls, reasoning)."""
from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class ParserRegistry(Generic[T]):
    """Classes registered by their `name`; a new model family's format is a new registered class."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._classes: dict[str, type[T]] = {}

    def register(self, cls: type[T]) -> type[T]:
        name = getattr(cls, "name", "")
        if not name:
            raise TypeError(f"a {self.kind} needs a name, got {cls!r}")
        self._classes[name] = cls
        return cls

    def names(self) -> list[str]:
        return sorted(self._classes)

    def get(self, name: str) -> type[T]:
        if name not in self._classes:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}")
        return self._classes[name]
