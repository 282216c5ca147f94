"""Each supported architecture both ways, against transformers itself (fp32, in-process):

- a random transformers model, saved by `save_pretrained`, imported: megascale's logits equal
  transformers' (1e-5), for every option variant in `CASES`;
- that megascale model exported: `AutoModelForCausalLM.from_pretrained` (no remote code) loads the
  original architecture, every tensor equal to the original's, logits equal megascale's;
- a model no standard architecture computes (the parallel block with SWA, ...) exported as remote
  code: loads with `trust_remote_code=True`, logits equal; reads back into megascale unchanged.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from megascale.config import ModelConfig
from megascale.config.schema import RopeScaling
from megascale.interop.export import write_export
from megascale.interop.generate import generate
from megascale.interop.pretrained import load_pretrained
from megascale.interop.tokenizer_files import tokenizer_spec
from megascale.model import GPT
from tests.interop.conftest import CASES, VOCAB, close, random_hf_model, saved

TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))


def _weights(model: GPT) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in model.named_parameters()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_import_then_export_equals_transformers(case, tmp_path):
    model_type, make_config = CASES[case]
    hf = random_hf_model(make_config())
    ours, source = load_pretrained(saved(hf, tmp_path / "hf"))
    assert source.architecture == model_type
    with torch.no_grad():
        want = hf(TOKENS).logits
        close(ours(TOKENS), want)

    done = write_export(ours.cfg, _weights(ours), tmp_path / "out", "bytes", step=0)
    assert done.model_type == model_type and not (tmp_path / "out" / "modeling_megascale.py").exists()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back) is type(hf)
    original = hf.state_dict()
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, original[name]), name
    with torch.no_grad():
        close(back(TOKENS).logits, want)


def test_greedy_generation_equals_transformers(tmp_path):
    hf = random_hf_model(CASES["llama-gqa-llama3-rope"][1](), seed=5)
    ours, _ = load_pretrained(saved(hf, tmp_path / "hf"))
    prompt = TOKENS[0, :6]
    want = hf.generate(prompt[None], max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert generate(ours, prompt.tolist(), 20) == want[0, 6:].tolist()


REMOTE = {
    # MegaScale's block: parallel, one norm, sliding window (the default config's kind)
    "parallel-swa": ModelConfig(vocab_size=VOCAB, seq_len=32, layers=2, hidden=32, heads=4, window=6),
    # Llama layers in the parallel block, with learned positions, tied, QKV bias, GQA, query/key
    # head norms
    "parallel-llama-learned": ModelConfig(
        vocab_size=VOCAB,
        seq_len=32,
        layers=2,
        hidden=32,
        heads=4,
        kv_heads=2,
        norm="rmsnorm",
        mlp="swiglu",
        bias=False,
        qkv_bias=True,
        qk_norm=True,
        positions="learned",
        tie_embeddings=True,
    ),
    # a norm per branch with RMSNorm and exact GeLU, partial rotary with Llama-3 scaling
    "two-norms-rope-scaled": ModelConfig(
        vocab_size=VOCAB,
        seq_len=32,
        layers=2,
        hidden=32,
        heads=4,
        parallel_norms=2,
        norm="rmsnorm",
        mlp="gelu_exact",
        rotary_fraction=0.5,
        rope_scaling=RopeScaling("llama3", 4.0, 1.0, 4.0, 8),
    ),
}


@pytest.mark.parametrize("case", sorted(REMOTE))
def test_models_without_an_architecture_export_as_remote_code(case, tmp_path):
    cfg = REMOTE[case]
    cfg.validate()
    ours = GPT(cfg, seed=1)
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0.0, 0.2)
    done = write_export(cfg, _weights(ours), tmp_path / "out", "bytes", step=7)
    assert done.model_type == "megascale" and (tmp_path / "out" / "modeling_megascale.py").exists()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True).eval()
    with torch.no_grad():
        want = ours(TOKENS)
        close(hf(TOKENS).logits, want)
        greedy = hf.generate(TOKENS[:1, :5], max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert generate(ours, TOKENS[0, :5].tolist(), 8) == greedy[0, 5:].tolist()
    back, source = load_pretrained(tmp_path / "out")
    assert source.architecture == "megascale" and back.cfg == cfg
    for name, value in back.named_parameters():
        assert torch.equal(value, dict(ours.named_parameters())[name]), name


def test_megascale_block_without_window_exports_as_gpt_neox(tmp_path):
    """The parallel block's one LayerNorm is written as both of GPT-NeoX's norms."""
    cfg = ModelConfig(vocab_size=VOCAB, seq_len=32, layers=2, hidden=32, heads=4, rotary_fraction=0.5)
    ours = GPT(cfg, seed=2)
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0.0, 0.2)
    assert write_export(cfg, _weights(ours), tmp_path / "out", "bytes", step=0).model_type == "gpt_neox"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        close(hf(TOKENS).logits, ours(TOKENS))


def test_sharded_checkpoints_both_ways(tmp_path):
    """transformers' sharded files (with their index) import; megascale's shards load in transformers."""
    hf = random_hf_model(CASES["mistral-swa"][1]())
    saved(hf, tmp_path / "hf", max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    ours, _ = load_pretrained(tmp_path / "hf")
    done = write_export(ours.cfg, _weights(ours), tmp_path / "out", "bytes", step=0, max_shard_bytes=30_000)
    assert len(done.files) > 2 and (tmp_path / "out" / "model.safetensors.index.json").exists()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        close(back(TOKENS).logits, hf(TOKENS).logits)


def test_byte_level_tokenizer_ships_as_an_equivalent_tokenizer_json(tmp_path):
    """AutoTokenizer reads the export's tokenizer with the ids megascale's byte tokenizer gives,
    and importing the export sets data.tokenizer back to 'bytes'."""
    cfg = ModelConfig(vocab_size=257, seq_len=16, layers=1, hidden=32, heads=4)
    write_export(cfg, _weights(GPT(cfg, seed=0)), tmp_path / "out", "bytes", step=0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    text = "héllo wörld\n\tdef f(x): return x ** 2  # ünïcode ✓"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert ids == list(text.encode()) and tokenizer.decode(ids) == text
    assert tokenizer.eos_token_id == 256
    assert tokenizer_spec(tmp_path / "out" / "tokenizer.json") == "bytes"


def test_a_mixture_of_experts_mixtral_cannot_express_is_refused_on_export(tmp_path):
    """An ungated shared expert is neither Mixtral nor Qwen2-MoE, and the remote-code model has no
    MoE layers."""
    from megascale.config.schema import MoEConfig
    from megascale.interop.hf_files import InteropError

    cfg = ModelConfig(
        vocab_size=VOCAB,
        seq_len=32,
        layers=2,
        hidden=32,
        heads=4,
        block="serial",
        norm="rmsnorm",
        mlp="swiglu",
        bias=False,
        moe=MoEConfig(experts=4, shared_ffn_hidden=8),
    )
    with pytest.raises(InteropError, match="a mixture-of-experts model exports as mixtral or qwen2_moe only"):
        write_export(cfg, _weights(GPT(cfg, seed=1)), tmp_path / "out", "bytes", step=0)
