"""The real stage-2 writer, paused at one point of rank 0's commit so that a test can SIGKILL it
there: `python -m tests.checkpoint.paused_writer POINT MARKER_FILE` (points: writer.COMMIT_HOOK)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from megascale.checkpoint import writer


def pause_at(point: str, marker: Path):
    def hook(reached: str) -> None:
        if reached == point:
            marker.write_text(point)
            time.sleep(3600)  # until the test kills this process

    return hook


if __name__ == "__main__":
    writer.COMMIT_HOOK = pause_at(sys.argv[1], Path(sys.argv[2]))
    writer.serve()
