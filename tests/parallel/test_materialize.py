"""A rank that builds on the meta device and materializes only its part gets exactly the values
the single-process model has (the layout parity tests then cover the whole training run)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from megascale.config import ModelConfig
from megascale.layout.shard import shard_spec, tp_slice
from megascale.model import GPT
from megascale.model.init import SeededValues
from megascale.parallel.materialize import materialize
from megascale.parallel.pipeline import split_model
from megascale.parallel.tensor import parallelize
from megascale.parallel.tp_comm import TPContext

CFG = ModelConfig(vocab_size=64, seq_len=16, layers=4, hidden=32, heads=4)
SEED = 1234


def _meta(cfg: ModelConfig) -> GPT:
    with torch.device("meta"):
        return GPT(cfg)


@pytest.mark.parametrize("tie", [False, True])
def test_one_process_matches_the_eagerly_built_model(tie):
    cfg = replace(CFG, tie_embeddings=tie)
    want = dict(GPT(cfg, seed=SEED).named_parameters())
    model = _meta(cfg)
    made = materialize([model], SeededValues(cfg, SEED), torch.device("cpu"))
    got = dict(model.named_parameters())
    assert made == len(want) == len(got)
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    assert (model.head.out.weight is model.embed.tokens.weight) == tie


def test_the_seed_decides_the_values():
    a, b = GPT(CFG, seed=1), GPT(CFG, seed=2)
    assert not torch.equal(a.blocks[0].attn.qkv.weight, b.blocks[0].attn.qkv.weight)
    torch.manual_seed(7)
    c = GPT(CFG)
    assert torch.equal(c.blocks[0].mlp.fc.weight, GPT(CFG, seed=7).blocks[0].mlp.fc.weight)


@pytest.mark.parametrize(("tp_rank", "pp_rank"), [(0, 0), (1, 1)])
def test_tensor_and_pipeline_slices_are_cut_from_the_whole(tp_rank, pp_rank):
    whole = dict(GPT(CFG, seed=SEED).named_parameters())
    model = _meta(CFG)
    parallelize(model, TPContext(group=None, rank=tp_rank, size=2, sequence_parallel=True))
    chunks = split_model(model, pp=2, vpp=1, pp_rank=pp_rank)
    made = materialize(chunks, SeededValues(CFG, SEED), torch.device("cpu"))

    local = dict(chunks[0].named_parameters())
    assert made == len(local) < len(whole)  # only this stage's parameters
    assert all(not p.is_meta for p in local.values())
    for name, p in local.items():
        spec = shard_spec(p)
        assert spec.global_shape == tuple(whole[name].shape), name
        assert torch.equal(p, tp_slice(whole[name], spec)), name
    sliced = [n for n, p in local.items() if shard_spec(p).tp_dim is not None]
    assert sliced and all(shard_spec(local[n]).tp_rank == tp_rank for n in sliced)
    layer = CFG.layers // 2 * pp_rank
    assert shard_spec(local[f"blocks.{layer}.ln1.weight"]).sp_partial  # the whole spec is kept


def test_real_parameters_are_left_alone():
    model = GPT(CFG, seed=SEED)
    before = model.blocks[0].attn.qkv.weight
    assert materialize([model], SeededValues(CFG, 99), torch.device("cpu")) == 0
    assert model.blocks[0].attn.qkv.weight is before
