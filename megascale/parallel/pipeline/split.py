"""Cut a GPT into the pipeline chunks one rank holds.

The existing submodules are moved, never rebuilt, so a model whose blocks, embedding or head
were already replaced by tensor-parallel ones (applied before splitting) keeps them. A chunk
keeps the single-process parameter names ("embed.tokens.weight", "blocks.5.attn.qkv.weight",
"head.out.weight"): its blocks live in a ModuleDict keyed by the global layer index, so the
optimizer, checkpoints and resharding see one naming whatever the layout.
"""

from __future__ import annotations

import torch
from torch import nn

from megascale.config.fields import ConfigError
from megascale.config.schema import ModelConfig, check_pipeline_split
from megascale.model.flops import flops_per_token
from megascale.model.gpt import GPT
from megascale.parallel.pipeline.schedule import global_chunk

# The embedding's cost in layers for `auto`: a lookup and its gradient scatter, no GEMM. Small
# but not zero, so that between two equal splits the first stage gets the lighter one.
EMBED_COST_IN_LAYERS = 0.1


class PipelineChunk(nn.Module):
    """Consecutive layers of the model; the embedding on the first global chunk, the head and
    the loss on the last. Forward: tokens (first) or hidden states in; hidden states out, or
    the summed token loss on the last chunk (which then needs `labels`)."""

    def __init__(
        self, index: int, count: int, layers: dict[int, nn.Module], embed: nn.Module | None, head: nn.Module | None
    ) -> None:
        super().__init__()
        self.index = index  # global chunk index, 0 .. count-1
        self.count = count
        if embed is not None:
            self.embed = embed
        self.blocks = nn.ModuleDict({str(i): block for i, block in layers.items()})
        if head is not None:
            self.head = head

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    @property
    def layer_ids(self) -> list[int]:
        return [int(k) for k in self.blocks]

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if self.is_first:
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x)
        if self.is_last:
            if labels is None:
                raise ValueError("the last pipeline chunk computes the loss: pass labels")
            return self.head(x, labels)
        return x

    def extra_repr(self) -> str:
        ids = self.layer_ids
        span = f"layers {ids[0]}..{ids[-1]}" if ids else "no layers"
        return f"chunk {self.index}/{self.count}, {span}"


def chunk_sizes(model: ModelConfig, pp: int, vpp: int, split: str | list[int] = "even") -> list[int]:
    """Layers of each global chunk, in chunk order (`parallel.pp_split`).

    `auto` balances forward FLOPs per token (`model.flops`): every layer costs the same, the
    first chunk also runs the embedding (no FLOPs, but not free) and the last the vocabulary
    projection and loss, which for a large vocabulary outweighs several layers. It minimises the
    most expensive chunk, since the slowest stage sets the pace of the whole pipeline."""
    check_pipeline_split(model.layers, pp, vpp, split)
    chunks = pp * vpp
    if isinstance(split, list):
        return list(split)
    if split == "even":
        return [model.layers // chunks] * chunks
    flops = flops_per_token(model)
    layer = (flops.dense + flops.attention) / model.layers
    extra = [0.0] * chunks
    extra[0] += EMBED_COST_IN_LAYERS * layer
    extra[-1] += flops.head
    # the smallest cap on a chunk's cost that holds every layer, one layer at least per chunk
    caps = sorted({n * layer + e for e in extra for n in range(1, model.layers + 1)})
    for cap in caps:
        sizes = [max(1, int((cap - e) / layer + 1e-9)) for e in extra]
        if sum(sizes) >= model.layers:
            break
    while sum(sizes) > model.layers:  # take the surplus from the costliest chunks
        g = max((i for i in range(chunks) if sizes[i] > 1), key=lambda i: (sizes[i] * layer + extra[i], i))
        sizes[g] -= 1
    return sizes


def chunk_layers(sizes: list[int]) -> list[range]:
    """Global chunk g -> the consecutive layer indices it holds."""
    starts = [sum(sizes[:g]) for g in range(len(sizes) + 1)]
    return [range(starts[g], starts[g + 1]) for g in range(len(sizes))]


def split_model(
    model: GPT, pp: int, vpp: int, pp_rank: int, split: str | list[int] = "even", v_shape: bool = False
) -> list[nn.Module]:
    """The `vpp` chunks of pipeline rank `pp_rank`: local chunk c is global chunk c*pp + rank
    (interleaved), or with `v_shape` (ZB-V, vpp = 2) rank and 2*pp-1-rank, holding the layers
    `split` gives it (`chunk_sizes`). In a V rank 0 holds both the embedding and the head.

    Moves `model.embed`, `model.blocks[i]` and `model.head` into the chunks; the model object
    should not be used afterwards."""
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank={pp_rank} out of range for parallel.pp={pp}")
    head_weight = getattr(getattr(model.head, "out", None), "weight", None)
    embed_weight = getattr(getattr(model.embed, "tokens", None), "weight", None)
    if pp > 1 and head_weight is not None and head_weight is embed_weight:
        raise ConfigError(
            "model.tie_embeddings=true needs parallel.pp=1 (the embedding and the head live on "
            "different pipeline stages); set model.tie_embeddings=false"
        )
    if v_shape and vpp != 2:
        raise ConfigError(f"chunks placed in a V (parallel.schedule='zbv') need parallel.vpp=2, got {vpp}")
    ranges = chunk_layers(chunk_sizes(model.cfg, pp, vpp, split))
    count = pp * vpp
    chunks: list[nn.Module] = []
    for c in range(vpp):
        g = global_chunk(pp, pp_rank, c, v_shape)
        chunks.append(
            PipelineChunk(
                g,
                count,
                {i: model.blocks[i] for i in ranges[g]},
                model.embed if g == 0 else None,
                model.head if g == count - 1 else None,
            )
        )
    return chunks
