"""Tokenizer directories in the style of four model families, built with `tokenizers` and saved with
`transformers`' own classes, so that each has that family's saved settings: which EOS its
tokenizer_config.json names and whether its post-processor puts a BOS before a sequence.

- llama3: byte-level BPE with Llama 3's split pattern, <|begin_of_text|> added by a template,
  EOS <|end_of_text|> (PreTrainedTokenizerFast, as Meta's repository has it);
- mistral: SentencePiece-style BPE (Metaspace, byte fallback) saved by `LlamaTokenizer` with
  add_bos_token=True: <s> before each sequence, EOS </s>;
- qwen2: byte-level BPE saved by `Qwen2Tokenizer` as the instruct models are: no BOS, EOS <|im_end|>
  (not the <|endoftext|> that also is in the vocabulary);
- deepseek: byte-level BPE with DeepSeek V3's full-width special tokens (which no name guess
  finds), BOS by a template, tokenizer_config.json written as DeepSeek's (AddedToken objects).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DS_BOS, DS_EOS, DS_PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
FAMILIES = ("llama3", "mistral", "qwen2", "deepseek")


def corpus(n: int = 200) -> list[str]:
    words = [
        "the",
        "model",
        "reads",
        "tokens",
        "and",
        "writes",
        "text",
        "über",
        "café",
        "東京",
        "naïve",
        "2024",
        "it's",
        "we'll",
        "data",
        "shards",
        "prep",
        "train",
        "export",
        "generate",
    ]
    return [
        " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(5 + i % 23)) + ("\n" if i % 4 else "")
        for i in range(n)
    ]


def _byte_bpe(specials: list[str], split: str | None = None, vocab: int = 400) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None)
    tok.pre_tokenizer = (
        level if split is None else pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), "isolated"), level])
    )
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        corpus(),
        trainers.BpeTrainer(
            vocab_size=vocab,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    return tok


def _with_bos_template(tok: Tokenizer, bos: str) -> None:
    bos_id = tok.token_to_id(bos)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
            ),
        ]
    )


def _vocab_merges(tok: Tokenizer) -> tuple[dict, list]:
    model = json.loads(tok.to_str())["model"]
    return model["vocab"], [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]


def build(family: str, out: Path) -> Path:
    """`out` holding the family's tokenizer.json and tokenizer_config.json; returns `out`."""
    import transformers

    if family == "llama3":
        tok = _byte_bpe(["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>"], LLAMA3_SPLIT)
        _with_bos_template(tok, "<|begin_of_text|>")
        transformers.PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>"
        ).save_pretrained(out)
    elif family == "mistral":
        sp = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
        sp.pre_tokenizer = pre_tokenizers.Metaspace()
        sp.train_from_iterator(
            corpus(), trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
        )
        vocab, merges = _vocab_merges(sp)
        transformers.LlamaTokenizer(
            vocab=vocab, merges=merges, add_bos_token=True, add_eos_token=False
        ).save_pretrained(out)
    elif family == "qwen2":
        vocab, merges = _vocab_merges(_byte_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]))
        transformers.Qwen2Tokenizer(
            vocab=vocab, merges=merges, eos_token="<|im_end|>", pad_token="<|endoftext|>"
        ).save_pretrained(out)
    elif family == "deepseek":
        tok = _byte_bpe([DS_BOS, DS_EOS, DS_PAD])
        _with_bos_template(tok, DS_BOS)
        out.mkdir(parents=True, exist_ok=True)
        tok.save(str(out / "tokenizer.json"))

        def added(content: str) -> dict:
            return {
                "__type": "AddedToken",
                "content": content,
                "lstrip": False,
                "normalized": True,
                "rstrip": False,
                "single_word": False,
            }

        (out / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "add_bos_token": True,
                    "add_eos_token": False,
                    "bos_token": added(DS_BOS),
                    "clean_up_tokenization_spaces": False,
                    "eos_token": added(DS_EOS),
                    "legacy": True,
                    "model_max_length": 16384,
                    "pad_token": added(DS_EOS),
                    "sp_model_kwargs": {},
                    "unk_token": None,
                    "tokenizer_class": "LlamaTokenizerFast",
                },
                indent=2,
            )
        )
    else:
        raise ValueError(family)
    return out
