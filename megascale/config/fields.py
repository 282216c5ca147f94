"""What every config section is built from: the error that names a key, the field with its
documentation, and the common range checks."""

from __future__ import annotations

from collections.abc import Callable
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


def positive(section: object, name: str, keys: list[str]) -> None:
    for key in keys:
        value = getattr(section, key)
        if value < 1:
            raise ConfigError(f"{name}.{key} must be >= 1, got {value}")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
