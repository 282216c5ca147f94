"""The whole round trip a user makes: a transformers Llama (GQA) with its tokenizer -> `megascale
import` -> `megascale train` on tp=2 pp=2 (4 local ranks, 5 steps, from the imported weights) ->
`megascale export` -> transformers loads the export (and its tokenizer) with no remote code, its
logits equal the megascale checkpoint's, and greedy generation of 20 tokens gives the same tokens
as `megascale generate` (from the checkpoint and from the export). The one multi-process test of
the interop suite."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import transformers
from safetensors.torch import load_file

from megascale.cli import main
from megascale.data.prep import prepare
from megascale.interop.generate import load_checkpoint
from tests.data.conftest import bpe_tokenizer
from tests.interop.conftest import close, saved

pytestmark = pytest.mark.timeout(600)

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "wizards",
    "quietly",
    "hex",
    "bold",
    "jugglers",
]


def _corpus(lines: int) -> list[str]:
    g = torch.Generator().manual_seed(0)
    return [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (12,), generator=g)) for _ in range(lines)]


def _generated(argv: list[str], capsys) -> list[int]:
    assert main(argv) == 0
    return [int(i) for i in capsys.readouterr().out.strip().splitlines()[-1].split()]


@pytest.mark.slow
def test_import_train_tp2_pp2_export_and_generate(tmp_path, capsys):
    corpus = _corpus(300)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe_tokenizer(corpus, vocab=300), eos_token="<|endoftext|>"
    )
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        max_position_embeddings=64,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    hf_dir = saved(transformers.AutoModelForCausalLM.from_config(config), tmp_path / "hf")
    tokenizer.save_pretrained(hf_dir)
    (tmp_path / "corpus.txt").write_text("\n".join(corpus))
    tokens = tmp_path / "tokens"
    prepare(
        [str(tmp_path / "corpus.txt")],
        tokens,
        str(hf_dir / "tokenizer.json"),
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
                "--parallel.tp=2",
                "--parallel.pp=2",
                "--train.steps=5",
                "--train.global_batch=4",
                "--train.micro_batch=1",
                "--optim.lr=1e-2",
                "--optim.warmup_steps=1",
                f"--data.path={tokens}",
                "--train.eval_every=0",
                "--train.tensorboard=false",
                "--diagnostics.timers=false",
            ]
        )
        == 0
    )
    capsys.readouterr()
    ran = subprocess.run(
        [sys.executable, "-m", "megascale.cli", "train", "--config", str(job / "config.toml")],
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (job / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 5 and losses[-1] < losses[0]

    out = tmp_path / "export"
    assert main(["export", str(job / "run" / "checkpoints"), "--out", str(out)]) == 0
    assert "as llama" in capsys.readouterr().out
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    trained, _ = load_checkpoint(str(job / "run" / "checkpoints"))
    before = load_file(hf_dir / "model.safetensors")["model.layers.0.self_attn.k_proj.weight"]
    after = hf.state_dict()["model.layers.0.self_attn.k_proj.weight"]
    assert not torch.equal(before, after) and torch.allclose(before, after, atol=0.1)  # trained from the import

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    prompt = "the lazy dog"
    ids = hf_tokenizer(prompt, add_special_tokens=False).input_ids
    with torch.no_grad():
        sample = torch.tensor([ids + ids[::-1] * 4])
        close(hf(sample).logits, trained.eval()(sample))
        want = hf.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, pad_token_id=0)[0, len(ids) :]
    from_checkpoint = _generated(
        ["generate", str(job / "run" / "checkpoints"), "--prompt", prompt, "--max-new-tokens", "20", "--ids"], capsys
    )
    from_export = _generated(["generate", str(out), "--prompt", prompt, "--max-new-tokens", "20", "--ids"], capsys)
    assert from_checkpoint == from_export == want.tolist()
