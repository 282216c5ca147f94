"""A pretrained Hugging Face checkpoint as the values megascale's parameters start from.

`Pretrained` reads a directory's config.json into the megascale `ModelConfig` it describes and
serves each parameter, by its single-process name, joined from the checkpoint's tensors -- a
`ValueSource` for materialization. Every rank of any (dp, tp, pp, v) layout asks only for the
parameters it holds and cuts its slices from them as it would from seeded values, so a job starts
from the pretrained weights on any layout, with a fresh optimizer (`checkpoint.init_from`).
Everything is checked before a tensor is read: that each parameter's sources exist and join to
the right shape, and that the job's model config is the checkpoint's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from megascale.config.fields import ConfigError
from megascale.config.loader import from_dict
from megascale.config.schema import ModelConfig
from megascale.interop.architectures import architecture_of
from megascale.interop.hf_files import HFDirectory, InteropError
from megascale.interop.rules import Rule, same
from megascale.model import GPT
from megascale.parallel.materialize import materialize

MEGASCALE_TYPE = "megascale"  # model_type of an export that no standard architecture expresses
MODEL_KEY = "megascale_model"  # its ModelConfig, in config.json
# Options a job may set differently from the checkpoint it starts from: they change no weight.
FREE_OPTIONS = {"seq_len", "window", "init_std"}


class Pretrained:
    """The parameters of a transformers checkpoint directory, by megascale name (lazily read)."""

    def __init__(self, path: str | Path) -> None:
        self.dir = HFDirectory(path)
        if self.dir.model_type == MEGASCALE_TYPE:
            self.model = exported_model_config(self.dir.config)
            self.architecture = MEGASCALE_TYPE
            rules, prefix = {name: same(name) for name, _ in _parameters(self.model)}, ""
        else:
            arch = architecture_of(self.dir.config)
            self.model, self.architecture = arch.read(self.dir.config), arch.model_type
            rules, prefix = arch.names(self.model), arch.prefix
        self.rules: dict[str, Rule] = rules
        self.stored = self._resolve(prefix)

    def _resolve(self, prefix: str) -> dict[str, str]:
        """Each source name as stored, after checking that every parameter can be made."""
        stored: dict[str, str] = {}
        for name, shape in _parameters(self.model):
            rule = self.rules[name]
            for source in rule.sources:
                found = self.dir.resolve(source, prefix)
                if found is None:
                    raise InteropError(
                        f"{self.dir.path}: {source} (for megascale's {name}) is not in the checkpoint's "
                        f"safetensors; the files do not match config.json"
                    )
                stored[source] = found
            shapes = [self.dir.shape(stored[s]) for s in rule.sources]
            try:
                joined = tuple(rule.join([torch.empty(s, device="meta") for s in shapes]).shape)
            except RuntimeError:
                joined = None
            if joined != shape:
                found = ", ".join(f"{s} {tuple(sh)}" for s, sh in zip(rule.sources, shapes, strict=True))
                raise InteropError(
                    f"{self.dir.path}: {found} do not make megascale's {name} {shape}, the shape config.json describes"
                )
        return stored

    def __call__(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        rule = self.rules[name]
        return rule.join([self.dir.tensor(self.stored[s]) for s in rule.sources])


def _parameters(model: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    with torch.device("meta"):
        return [(name, tuple(p.shape)) for name, p in GPT(model).named_parameters()]


def exported_model_config(config: dict) -> ModelConfig:
    try:
        model = from_dict(ModelConfig, config[MODEL_KEY], prefix="model.")
        model.validate()
    except (KeyError, ConfigError) as exc:
        raise InteropError(f"config.json of model_type {MEGASCALE_TYPE!r} needs a valid {MODEL_KEY}: {exc}") from exc
    return model


def differences(wanted: ModelConfig, have: ModelConfig) -> list[str]:
    """The model options of `have` that would not hold the checkpoint `wanted` describes."""
    free = FREE_OPTIONS - ({"seq_len"} if wanted.positions == "learned" else set())
    return [
        f.name
        for f in dataclasses.fields(ModelConfig)
        if f.name not in free and getattr(wanted, f.name) != getattr(have, f.name)
    ]


def init_source(init_from: str, model: ModelConfig) -> Pretrained:
    """`checkpoint.init_from` checked against the job's model config (one line naming a
    difference and the command that writes the matching config)."""
    source = Pretrained(init_from)
    wrong = differences(source.model, model)
    if wrong:
        key = wrong[0]
        raise InteropError(
            f"checkpoint.init_from={init_from}: model.{key} is {getattr(model, key)!r} here but "
            f"{getattr(source.model, key)!r} in that checkpoint ({len(wrong)} option(s) differ: {', '.join(wrong)}); "
            f"`megascale import {init_from} --out DIR` writes the matching config"
        )
    return source


def load_pretrained(path: str | Path) -> tuple[GPT, Pretrained]:
    """A single-process model with a checkpoint directory's weights (generation, tests)."""
    source = Pretrained(path)
    with torch.device("meta"):
        model = GPT(source.model)
    materialize([model], source, torch.device("cpu"))
    return model, source
