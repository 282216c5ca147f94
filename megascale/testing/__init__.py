"""Helpers for testing parallel code: run a function on N local ranks with a torchrun-style
environment (what this project's multi-process tests and benchmarks use)."""

from megascale.testing.launch import run_local, run_with_stores

__all__ = ["run_local", "run_with_stores"]
