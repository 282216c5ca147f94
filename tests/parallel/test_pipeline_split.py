"""Splitting a GPT into pipeline chunks, in one process: names, placement, moved (not rebuilt)
modules, and chunks that chained in global order compute exactly the whole model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megascale.config import ConfigError, JobConfig, ModelConfig, ParallelConfig, TrainConfig
from megascale.model import GPT
from megascale.model.flops import flops_per_token
from megascale.parallel.pipeline import split_model
from megascale.parallel.pipeline.split import chunk_sizes


def tiny(layers: int = 8, **kw) -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=61, seq_len=16, layers=layers, hidden=32, heads=4, **kw))


@pytest.mark.parametrize(("p", "v"), [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (2, 4)])
def test_chunks_keep_single_process_names_and_compute_the_model(p, v):
    reference = tiny()
    tokens = torch.randint(0, 61, (2, 16))
    labels = torch.randint(0, 61, (2, 16))
    expected = reference(tokens, labels)
    names = {n: t.clone() for n, t in reference.named_parameters()}

    model = tiny()
    per_rank = [split_model(model, p, v, r) for r in range(p)]
    by_global = {c.index: c for chunks in per_rank for c in chunks}
    assert sorted(by_global) == list(range(p * v))
    seen = {}
    for r, chunks in enumerate(per_rank):
        assert [c.index for c in chunks] == [c * p + r for c in range(v)]
        for chunk in chunks:
            assert len(chunk.layer_ids) == 8 // (p * v)
            for n, t in chunk.named_parameters():
                assert n not in seen
                seen[n] = t
    assert seen.keys() == names.keys()
    assert all(torch.equal(seen[n], names[n]) for n in names)
    with_embed = [g for g, c in by_global.items() if hasattr(c, "embed")]
    with_head = [g for g, c in by_global.items() if hasattr(c, "head")]
    assert with_embed == [0] and with_head == [p * v - 1]

    h = tokens
    for g in range(p * v - 1):
        h = by_global[g](h)
    assert torch.equal(by_global[p * v - 1](h, labels), expected)


def test_existing_submodules_are_moved_not_rebuilt():
    """Tensor parallelism replaces blocks in place before splitting; the chunks keep them."""
    model = tiny()

    class Replaced(nn.Module):  # stands for a tensor-parallel block
        def __init__(self, inner: nn.Module):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    model.blocks[5] = Replaced(model.blocks[5])
    embed, head, block5 = model.embed, model.head, model.blocks[5]
    chunks = {c.index: c for r in range(2) for c in split_model(model, 2, 2, r)}
    assert chunks[0].embed is embed and chunks[3].head is head
    assert chunks[2].blocks["5"] is block5  # global chunk 2 holds layers 4 and 5
    assert "blocks.5.inner.attn.qkv.weight" in dict(chunks[2].named_parameters())


def test_uneven_chunks_compute_the_model():
    reference = tiny()
    tokens, labels = torch.randint(0, 61, (2, 16)), torch.randint(0, 61, (2, 16))
    expected = reference(tokens, labels)
    model = tiny()
    by_global = {c.index: c for r in range(2) for c in split_model(model, 2, 2, r, [1, 3, 2, 2])}
    assert [len(by_global[g].layer_ids) for g in range(4)] == [1, 3, 2, 2]
    h = tokens
    for g in range(3):
        h = by_global[g](h)
    assert torch.equal(by_global[3](h, labels), expected)


def test_auto_split_balances_flops_with_the_head_on_the_last_stage():
    small_vocab = ModelConfig(vocab_size=61, seq_len=16, layers=8, hidden=32, heads=4)
    assert chunk_sizes(small_vocab, 2, 1, "auto") == chunk_sizes(small_vocab, 2, 1, "even") == [4, 4]
    # a 32k vocabulary costs ~10 layers of this width: the last stage keeps one layer
    big_vocab = ModelConfig(vocab_size=32000, seq_len=16, layers=24, hidden=256, heads=4)
    sizes = chunk_sizes(big_vocab, 4, 1, "auto")
    assert sum(sizes) == 24 and sizes[-1] == 1 and max(sizes[:3]) - min(sizes[:3]) <= 1, sizes
    # a head worth two layers: the last stage gives one up to the middle one (max cost 5 layers)
    two = ModelConfig(vocab_size=3072, seq_len=16, layers=12, hidden=128, heads=4)
    flops = flops_per_token(two)
    assert 1.9 < flops.head / ((flops.dense + flops.attention) / 12) < 2.1
    assert chunk_sizes(two, 3, 1, "auto") == [4, 5, 3]


def test_split_errors_name_the_fix():
    with pytest.raises(ConfigError, match=r"model.layers=6 .* = 2 \* 2 = 4 with parallel.pp_split='even'"):
        split_model(tiny(layers=6), 2, 2, 0)
    with pytest.raises(ConfigError, match=r"must list 4 \(pp \* vpp\) chunks"):
        split_model(tiny(), 2, 2, 0, [4, 4])
    with pytest.raises(ConfigError, match="adding up to model.layers=8"):
        split_model(tiny(), 2, 1, 0, [4, 5])
    with pytest.raises(ConfigError, match=">= 1 layer"):
        split_model(tiny(), 2, 1, 0, [8, 0])
    with pytest.raises(ValueError, match="pp_rank=2"):
        split_model(tiny(), 2, 1, 2)


def test_tied_embeddings_are_refused():
    with pytest.raises(ConfigError, match="tie_embeddings"):
        split_model(tiny(tie_embeddings=True), 2, 1, 0)


def test_last_chunk_needs_labels():
    chunk = split_model(tiny(), 1, 1, 0)[0]
    with pytest.raises(ValueError, match="labels"):
        chunk(torch.zeros(1, 16, dtype=torch.long))


def test_config_rejects_layouts_the_schedule_cannot_fill():
    cfg = JobConfig(
        model=ModelConfig(layers=8),
        parallel=ParallelConfig(pp=4, vpp=2),
        train=TrainConfig(global_batch=24, micro_batch=4),
    )  # 6 micro-batches
    with pytest.raises(ConfigError, match="multiple of parallel.pp=4"):
        cfg.validate()
    cfg.parallel.vpp, cfg.model.layers, cfg.parallel.pp_split = 1, 6, "even"
    with pytest.raises(ConfigError, match="model.layers=6"):
        cfg.validate()
    cfg.parallel.pp_split = "auto"  # uneven chunks are fine when the split is not forced even
    cfg.validate()
