"""The few collectives checkpointing needs, on the checkpoint group (gloo, its own links).

With one process every call is local, so the same code paths run in a single-process job.
The checkpoint group spans the world, so a group rank is the global rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class Comm:
    def __init__(self, group: dist.ProcessGroup | None, rank: int, world: int):
        self.group, self.rank, self.world = group, rank, world

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's object, on every rank (small metadata only)."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's object, on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def exchange(self, chunks: list[torch.Tensor], recv_sizes: list[int]) -> list[torch.Tensor]:
        """All-to-all of byte buffers: chunks[d] goes to rank d; returns what each rank sent."""
        if self.world == 1:
            return chunks
        send = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
        recv = torch.empty(sum(recv_sizes), dtype=torch.uint8)
        dist.all_to_all_single(recv, send, recv_sizes, [c.numel() for c in chunks],
                               group=self.group)
        return list(recv.split(recv_sizes))
