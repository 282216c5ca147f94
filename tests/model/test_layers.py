"""The Llama-family options equal their formulas, computed by hand from the same weights, in
both block kinds; parameter and FLOP counts follow them. (tests/interop checks the same layers
against the transformers implementations of Llama, Mistral, Qwen 2 and GPT-NeoX.)"""

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megascale.config import ConfigError, ModelConfig, load_config
from megascale.model import GPT, Block
from megascale.model.attention import band_mask
from megascale.model.flops import flops_per_token, parameter_count


def _rms_norm(x, norm):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight


def _gqa_by_hand(x, attn, heads, kv_heads, window):
    """Separate q, k, v weights cut from the group-major QKV rows; each key/value head repeated
    for its query heads."""
    b, s, h = x.shape
    d, per = h // heads, heads // kv_heads
    rows = attn.qkv.weight.view(kv_heads, per + 2, d, h)
    wq, wk, wv = rows[:, :per].reshape(-1, h), rows[:, per].reshape(-1, h), rows[:, per + 1].reshape(-1, h)
    q = (x @ wq.T).view(b, s, heads, d).transpose(1, 2)
    k = (x @ wk.T).view(b, s, kv_heads, d).transpose(1, 2).repeat_interleave(per, dim=1)
    v = (x @ wv.T).view(b, s, kv_heads, d).transpose(1, 2).repeat_interleave(per, dim=1)
    scores = (q @ k.transpose(-1, -2) / d**0.5).masked_fill(~band_mask(s, window, x.device), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, h) @ attn.proj.weight.T


def _swiglu_by_hand(x, mlp):
    gate, up = mlp.fc.weight[0::2], mlp.fc.weight[1::2]  # interleaved rows
    return (F.silu(x @ gate.T) * (x @ up.T)) @ mlp.proj.weight.T


def _llama_block(block, **extra) -> Block:
    cfg = ModelConfig(
        hidden=32,
        heads=4,
        kv_heads=2,
        ffn_hidden=48,
        norm="rmsnorm",
        mlp="swiglu",
        bias=False,
        positions="learned",
        block=block,
        **extra,
    )
    cfg.validate()
    out = Block(cfg).double()
    torch.manual_seed(7)
    with torch.no_grad():
        for p in out.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return out


@pytest.mark.parametrize("window", [None, 5])
def test_serial_llama_block_equals_formula(window):
    block = _llama_block("serial", window=window)
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    mid = x + _gqa_by_hand(_rms_norm(x, block.ln1), block.attn, 4, 2, window)
    expected = mid + _swiglu_by_hand(_rms_norm(mid, block.ln2), block.mlp)
    torch.testing.assert_close(block(x), expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("norms", [1, 2])
def test_parallel_llama_block_equals_formula_fused_or_not(norms):
    block = _llama_block("parallel", window=5, parallel_norms=norms)
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    h = _rms_norm(x, block.ln1)
    h_mlp = h if norms == 1 else _rms_norm(x, block.ln2)
    expected = x + _swiglu_by_hand(h_mlp, block.mlp) + _gqa_by_hand(h, block.attn, 4, 2, 5)
    torch.testing.assert_close(block(x), expected, rtol=1e-10, atol=1e-10)
    assert block.fusable == (norms == 1)
    if block.fusable:
        block.fuse_gemms = True
        torch.testing.assert_close(block(x), expected, rtol=1e-10, atol=1e-10)


def test_exact_and_tanh_gelu_differ():
    cfg = dict(hidden=32, heads=4, layers=1, seq_len=8)
    torch.manual_seed(0)
    tanh, exact = GPT(ModelConfig(mlp="gelu", **cfg), seed=1), GPT(ModelConfig(mlp="gelu_exact", **cfg), seed=1)
    x = torch.randn(64) * 3
    assert torch.equal(tanh.blocks[0].mlp.activation(x), F.gelu(x, approximate="tanh"))
    assert torch.equal(exact.blocks[0].mlp.activation(x), F.gelu(x))


OPTIONS = list(
    itertools.product(("serial", "parallel"), ("layernorm", "rmsnorm"), ("gelu", "swiglu"), (0, 2), (True, False))
)


@pytest.mark.parametrize(("block", "norm", "mlp", "kv_heads", "bias"), OPTIONS)
def test_parameter_count_matches_the_built_model(block, norm, mlp, kv_heads, bias):
    for norms, qkv_bias, qk_norm in ((1, False, True), (2, True, False)) if block == "parallel" else ((1, True, True),):
        cfg = ModelConfig(
            hidden=32,
            heads=4,
            layers=2,
            seq_len=16,
            block=block,
            norm=norm,
            mlp=mlp,
            kv_heads=kv_heads,
            bias=bias,
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            parallel_norms=norms,
        )
        cfg.validate()
        assert sum(p.numel() for p in GPT(cfg).parameters()) == parameter_count(cfg)


def test_flops_count_swiglu_as_three_matrices_and_gqa_smaller_kv():
    h, f, layers = 64, 96, 2
    base = dict(vocab_size=10, seq_len=8, layers=layers, hidden=h, heads=8, ffn_hidden=f)
    mha_gelu = flops_per_token(ModelConfig(**base)).dense
    gqa_swiglu = flops_per_token(ModelConfig(kv_heads=2, mlp="swiglu", **base)).dense
    assert mha_gelu == layers * 2 * (4 * h * h + 2 * h * f)
    kv = 2 * 2 * (h // 8)  # two key/value heads, each of head dim 8, for K and V
    assert gqa_swiglu == layers * 2 * ((h + kv) * h + h * h + 3 * h * f)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(heads=8, kv_heads=3), r"model.kv_heads=3 must divide model.heads=8"),
        (dict(heads=4, rotary_fraction=0.1), r"even number of rotating dims"),
        (dict(block="serial", parallel_norms=2), r"parallel_norms applies to block='parallel' only"),
    ],
)
def test_impossible_options_are_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(hidden=32, **overrides).validate()


@pytest.mark.parametrize(
    ("preset", "published"),
    [("llama-3-8b", 8_030_261_248), ("llama-3-70b", 70_553_706_496), ("mistral-7b", 7_241_732_096)],
)
def test_presets_have_the_published_parameter_counts(preset, published):
    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / f"{preset}.toml")
    assert parameter_count(cfg.model) == published


BUILD_ON_META = """
import sys, torch
from megascale.config import ModelConfig
from megascale.model import GPT
with torch.device("meta"):
    GPT(ModelConfig(block="parallel", norm="rmsnorm", mlp="swiglu", kv_heads=2))
print("torch._dynamo" in sys.modules)
"""


def test_a_meta_build_runs_no_torch_init_and_imports_no_dynamo():
    # torch's meta random ops are Python refs behind a dynamo guard: one nn.init.normal_ on a
    # meta tensor imported torch._dynamo (1.9 s). GPT sets every value itself, so it skips them
    out = subprocess.run([sys.executable, "-c", BUILD_ON_META], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
