"""Two-stage checkpointing: host snapshot, background write, atomic commit, read-once recovery.

`CheckpointManager` is imported lazily so that the stage-2 writer process, which imports
`megascale.checkpoint.writer`, starts without importing torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CheckpointManager"]


def __getattr__(name: str) -> Any:
    if name == "CheckpointManager":
        from megascale.checkpoint.manager import CheckpointManager

        return CheckpointManager
    raise AttributeError(f"module 'megascale.checkpoint' has no attribute {name!r}")
