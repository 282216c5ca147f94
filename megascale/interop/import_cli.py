"""`megascale import HF_DIR --out DIR`: the megascale config that trains on from a Hugging Face checkpoint.

Reads config.json and the safetensors headers (no weights), refuses in one line what megascale
cannot express, and writes DIR/config.toml: the matching model options, `checkpoint.init_from`
(the weights, read by every rank for its own part when training starts) and `data.tokenizer`
(the checkpoint's tokenizer.json, so that data prepared with another tokenizer is refused).
`--section.key=value` overrides go into the written config (a layout, a sequence length).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megascale.config import ConfigError, JobConfig, dump_config, load_config
from megascale.interop.hf_files import InteropError
from megascale.interop.pretrained import Pretrained, init_source
from megascale.interop.tokenizer_files import tokenizer_spec
from megascale.model.flops import parameter_count


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint",
        help="a local transformers checkpoint directory (config.json + "
        "model.safetensors or sharded safetensors with their index)",
    )
    parser.add_argument("--out", required=True, help="directory to write config.toml into")
    parser.epilog = (
        "Overrides go into the written config, e.g. --model.seq_len=2048 --parallel.tp=2; "
        "model options that change the weights are refused"
    )


def run(args: argparse.Namespace) -> int:
    try:
        source = Pretrained(args.checkpoint)
        cfg = imported_config(source, Path(args.out), args.overrides)
        init_source(cfg.checkpoint.init_from, cfg.model)  # an override must not change what the weights are
    except (InteropError, ConfigError) as exc:
        print(f"megascale import: {exc}", file=sys.stderr)
        return 2
    path = Path(args.out) / "config.toml"
    dump_config(cfg, path)
    print(summary(source, cfg, path))
    return 0


def imported_config(source: Pretrained, out: Path, overrides: list[str]) -> JobConfig:
    """Defaults, the checkpoint's model, its weights and tokenizer, a run directory under `out`, then
    the overrides; validated."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = JobConfig(model=source.model)
    cfg.checkpoint.init_from = str(source.dir.path.resolve())
    tokenizer = source.dir.path / "tokenizer.json"
    if tokenizer.is_file():
        cfg.data.tokenizer = tokenizer_spec(tokenizer)
    cfg.train.run_dir = str(out / "run")
    if not overrides:
        cfg.validate()
        return cfg
    draft = out / "config.toml"
    dump_config(cfg, draft)
    return load_config(draft, overrides)


def summary(source: Pretrained, cfg: JobConfig, path: Path) -> str:
    m = cfg.model
    attention = f"{m.heads} heads" + (f" / {m.kv_groups} key-value heads" if m.kv_groups != m.heads else "")
    lines = [
        f"megascale import: {source.architecture} checkpoint {source.dir.path} -- {parameter_count(m) / 1e6:.1f}M "
        f"parameters, {m.layers} layers, hidden {m.hidden}, {attention}, {m.block} block, {m.norm}, {m.mlp}, "
        f"{m.positions} positions" + (f", window {m.window}" if m.window else ""),
        f"wrote {path} (checkpoint.init_from = {cfg.checkpoint.init_from})",
    ]
    limit = source.dir.config.get("max_position_embeddings")
    if m.positions == "rotary" and limit and limit != m.seq_len:
        lines.append(f"model.seq_len = {m.seq_len} (the checkpoint allows {limit}): set it to your training length")
    tokenizer = cfg.data.tokenizer or "bytes"
    lines += [
        f"next: megascale prep INPUTS --out TOKENS --tokenizer {tokenizer}",
        f"      megascale train --config {path} --data.path=TOKENS",
    ]
    return "\n".join(lines)
