"""A cache for values a model recomputes from its shapes alone (masks, rotary tables).

Eager runs reuse them. Inside a graph that `torch.compile` is tracing the cache is skipped and
the value is computed in-graph (cheap, fused): Dynamo would ignore an `lru_cache` anyway, and
warn about it on every compile.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def eager_cache(maxsize: int) -> Callable[[F], F]:
    def wrap(fn: F) -> F:
        cached = functools.lru_cache(maxsize=maxsize)(fn)

        @functools.wraps(fn)
        def call(*args):
            return fn(*args) if torch.compiler.is_compiling() else cached(*args)

        return call  # type: ignore[return-value]

    return wrap
