"""What an export keeps of the model it started from: a transformers Mistral (a position limit of 256,
its BOS/EOS ids, a Mistral-style tokenizer that adds <s>) -> `megascale import` -> `megascale train`
with optim.lr=0 (an evaluation run: the weights stay) at seq_len 32 -> `megascale export RUN_DIR`:
the export's config is the imported one, key for key, and so are its weights."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from megascale.cli import main
from megascale.data.prep import prepare
from megascale.data.tokenizer import load_tokenizer
from tests.data.families import build, corpus
from tests.interop.conftest import random_hf_model, saved

pytestmark = pytest.mark.timeout(300)
VERSIONED = {"transformers_version", "_name_or_path"}  # which library wrote it, and where


def test_export_of_an_imported_model_keeps_its_settings(tmp_path, capsys):
    hf_dir = build("mistral", tmp_path / "hf")
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    config = transformers.MistralConfig(
        vocab_size=len(tok),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        max_position_embeddings=256,
        sliding_window=16,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
        rope_theta=20000.0,
    )
    saved(random_hf_model(config), hf_dir)
    (tmp_path / "corpus.txt").write_text("\n".join(corpus(300)))
    tokens = tmp_path / "tokens"
    prepare(
        [str(tmp_path / "corpus.txt")],
        tokens,
        str(hf_dir / "tokenizer.json"),
        options=_lines(),
        workers=1,
        progress=False,
        say=lambda _: None,
    )

    job = tmp_path / "job"
    assert (
        main(
            [
                "import",
                str(hf_dir),
                "--out",
                str(job),
                "--model.seq_len=32",
                "--train.steps=1",
                "--train.global_batch=2",
                "--train.micro_batch=1",
                "--optim.lr=0",
                f"--data.path={tokens}",
                "--train.eval_every=0",
                "--train.tensorboard=false",
                "--diagnostics.timers=false",
            ]
        )
        == 0
    ), capsys.readouterr().err
    assert main(["train", "--config", str(job / "config.toml")]) == 0
    out = tmp_path / "export"
    assert main(["export", str(job / "run"), "--out", str(out)]) == 0, capsys.readouterr().err  # the run dir

    original = json.loads((hf_dir / "config.json").read_text())
    exported = json.loads((out / "config.json").read_text())
    assert {k: exported.get(k) for k in original if k not in VERSIONED} == {
        k: v for k, v in original.items() if k not in VERSIONED
    }
    loaded = [transformers.AutoConfig.from_pretrained(d).to_dict() for d in (hf_dir, out)]
    assert [{k: v for k, v in c.items() if k not in VERSIONED} for c in loaded] == [
        {k: v for k, v in loaded[0].items() if k not in VERSIONED}
    ] * 2
    before, after = load_file(hf_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)  # lr=0
    assert transformers.AutoTokenizer.from_pretrained(out)("the model")["input_ids"][0] == tok.bos_token_id


def test_export_of_a_model_trained_from_scratch_names_its_bos(tmp_path):
    from megascale.config.schema import ModelConfig
    from megascale.interop.export import write_export
    from megascale.model import GPT

    cfg = ModelConfig(
        vocab_size=257,
        layers=1,
        hidden=32,
        heads=4,
        seq_len=16,
        positions="learned",
        bias=True,
        block="serial",
        norm="layernorm",
        mlp="gelu",
    )
    weights = dict(GPT(cfg, seed=0).state_dict())
    write_export(cfg, weights, tmp_path / "bytes", "bytes", step=0)
    got = transformers.AutoConfig.from_pretrained(tmp_path / "bytes")
    assert (got.bos_token_id, got.eos_token_id) == (None, 256)  # not GPT-2's 50256 filled in by transformers
    family = build("llama3", tmp_path / "l3")
    tok = load_tokenizer(str(family / "tokenizer.json"))
    write_export(cfg, weights, tmp_path / "l3-export", tok, step=0)
    got = transformers.AutoConfig.from_pretrained(tmp_path / "l3-export")
    assert (got.bos_token_id, got.eos_token_id) == (tok.bos, tok.eod) == (0, 1)


def _lines():
    from megascale.data.prep import Options

    return Options(kind="lines")
