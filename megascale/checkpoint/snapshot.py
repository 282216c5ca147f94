"""Stage 1: copy a rank's checkpoint tensors into one reusable host buffer.

The buffer is POSIX shared memory (a `shm.Segment`, named per job and rank) so the stage-2
writer process reads it without a copy; on CUDA it is also page-locked (`cudaHostRegister`)
so the device-to-host copies run at full speed. Once `capture` returns, the snapshot is
independent of the live tensors: the next optimizer step cannot change it.
"""

from __future__ import annotations

import torch

from megascale.checkpoint.shm import Segment

ALIGN = 64


def layout(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """Byte offset of each tensor in the buffer (aligned), and the buffer's size."""
    offsets, size = [], 0
    for tensor in tensors:
        size = -(-size // ALIGN) * ALIGN
        offsets.append(size)
        size += tensor.numel() * tensor.element_size()
    return offsets, size


class HostBuffer:
    """Shared (and on CUDA pinned) host memory, reused by every save of the same layout."""

    def __init__(self, nbytes: int, pin: bool, name: str):
        self.nbytes = nbytes
        self.segment = Segment(name, size=max(nbytes, 1), create=True)
        self.bytes = torch.frombuffer(self.segment.buf, dtype=torch.uint8, count=max(nbytes, 1))
        self.pinned = False
        if pin and nbytes:
            err = torch.cuda.cudart().cudaHostRegister(self.bytes.data_ptr(), nbytes, 0)
            self.pinned = int(err) == 0

    @property
    def name(self) -> str:
        return self.segment.name

    def capture(self, tensors: list[torch.Tensor], offsets: list[int]) -> None:
        """Copy every tensor into its slot; returns when the copies are complete."""
        on_cuda = False
        for tensor, offset in zip(tensors, offsets, strict=True):
            nbytes = tensor.numel() * tensor.element_size()
            slot = self.bytes[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
            slot.copy_(tensor.detach(), non_blocking=tensor.is_cuda and self.pinned)
            on_cuda |= tensor.is_cuda
        if on_cuda:
            torch.cuda.synchronize()

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())
        del self.bytes
        self.segment.close(unlink=True)
