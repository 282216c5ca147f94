"""What every config section is built from: the error that names a key, the field with its
documentation, and the common range checks."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import MISSING, field
from typing import Any


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type or impossible. Names the key."""


def opt(default: Any = MISSING, doc: str = "", *, factory: Callable[[], Any] | None = None) -> Any:
    """A config field and its one-line description: the one source `megascale train --help`
    and the documentation check read."""
    if factory is not None:
        return field(default_factory=factory, metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


def at_least(section: object, name: str, keys: Iterable[str], low: float, *, strict: bool = False) -> None:
    """Each of `keys` of the section called `name` is >= `low` (> `low` when `strict`); the error
    names the first that is not, the bound and its value."""
    for key in keys:
        value = getattr(section, key)
        if value < low or (strict and value == low):
            raise ConfigError(f"{name}.{key} must be {'>' if strict else '>='} {low:g}, got {value}")


def positive(section: object, name: str, keys: Iterable[str]) -> None:
    """Counts and sizes: each at least 1."""
    at_least(section, name, keys, 1)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
