"""Speed-only transformations of built blocks: recomputation, compilation, fused GEMMs.

None of them changes what the model computes (tests check parity against the plain blocks);
they trade memory for compute (recomputation) or fuse kernels (torch.compile fuses LayerNorm,
GeLU and the residual adds of a block into a few Triton kernels on GPU). They apply to whatever
block modules the model holds -- plain, or already replaced by tensor-parallel ones -- so the
engine applies them last.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from megascale.model.gpt import Attention, Block


def apply_recompute(blocks: nn.ModuleDict | nn.ModuleList, mode: str) -> None:
    """`full`: recompute whole blocks in backward, keeping only their inputs. `selective`:
    recompute only the attention core (softmax over s x s scores: much memory, little compute;
    Korthikanti et al. 2022). Forwards are wrapped in place, so parameter names do not change."""
    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise ValueError(f"train.recompute must be none, full or selective, got {mode!r}")
    for _, block in _items(blocks):
        if mode == "full":
            block.forward = _recomputed(block.forward)
        else:
            attn = _find(block, Attention)
            attn.attend = _recomputed(attn.attend)


def _recomputed(fn):
    def run(*args):
        if not torch.is_grad_enabled():
            return fn(*args)
        return checkpoint(fn, *args, use_reentrant=False)

    return run


def apply_compile(blocks: nn.ModuleDict | nn.ModuleList) -> None:
    """Compile each block separately: small graphs compile fast and are reused by every layer."""
    for _, block in _items(blocks):
        block.compile(dynamic=False)


def fuse_parallel_gemms(blocks: nn.ModuleDict | nn.ModuleList) -> None:
    """Parallel blocks run QKV and the MLP up-projection as one GEMM, and both output
    projections as one (`Block.fuse_gemms`); serial blocks, and parallel blocks with a norm per
    branch, have nothing to fuse."""
    for _, block in _items(blocks):
        if isinstance(block, Block) and block.fusable:
            block.fuse_gemms = True


def set_attention_kernel(module: nn.Module, kernel: str) -> None:
    """`auto`, `sdpa` or `flex` for every attention layer (train.attention)."""
    for sub in module.modules():
        if isinstance(sub, Attention):
            sub.kernel = kernel


def set_loss_chunk(module: nn.Module, tokens: int) -> None:
    """Tokens per chunk of the head and loss (train.loss_chunk) for every head in `module`: the
    model's `Head` or the tensor-parallel one, both of which carry `loss_chunk`."""
    for sub in module.modules():
        if hasattr(sub, "loss_chunk"):
            sub.loss_chunk = tokens


def _items(blocks):
    return list(blocks.items()) if isinstance(blocks, nn.ModuleDict) else list(enumerate(blocks))


def _find(module: nn.Module, kind: type) -> nn.Module:
    for sub in module.modules():
        if isinstance(sub, kind):
            return sub
    raise TypeError(f"no {kind.__name__} inside {type(module).__name__}")
