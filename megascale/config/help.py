"""`--help` for config keys, generated from the schema: every key, its type, default and the
one-line description its field carries (`schema.opt`), grouped by section."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Iterator
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from megascale.config.loader import default_config_path, load_config, to_dict
from megascale.config.schema import JobConfig


@dataclasses.dataclass(frozen=True)
class Key:
    name: str  # dotted: model.rope_scaling.factor
    type: str
    default: Any
    doc: str


def sections() -> dict[str, str]:
    """Section name -> its one-line description (the section class's docstring)."""
    hints = get_type_hints(JobConfig)
    return {f.name: _first_line(hints[f.name]) for f in dataclasses.fields(JobConfig)}


def keys(cls: type = JobConfig, prefix: str = "") -> Iterator[Key]:
    """Every settable key under `cls`, depth first, in declaration order."""
    hints = get_type_hints(cls)
    instance = cls()
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            yield from keys(tp, f"{prefix}{f.name}.")
            continue
        yield Key(f"{prefix}{f.name}", describe_type(tp), getattr(instance, f.name), f.metadata.get("doc", ""))


def non_defaults(cfg: JobConfig) -> list[str]:
    """`key=value` for every key whose value differs from the built-in default (secrets redacted)."""
    defaults = {k.name: k.default for k in keys()}
    values = _flatten(to_dict(cfg))
    return [f"{k}={_show(v)}" for k, v in values.items() if v != defaults.get(k)]


def packaged_default_line() -> str:
    """What `megascale train` without `--config` runs differently from the defaults listed."""
    changed = ", ".join(f"`{item.replace('=', ' = ', 1)}`" for item in non_defaults(load_config(default_config_path())))
    return (
        f"`megascale train` without `--config` runs the packaged default ({default_config_path().name}), "
        f"which differs from these defaults only in: {changed}"
    )


def _flatten(raw: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in raw.items():
        if isinstance(v, dict) and f"{prefix}{k}" not in _TABLES:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


_TABLES = {"data.mixture"}  # keys whose value is itself a table


def describe_type(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "|".join(str(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return "|".join("none" if a is type(None) else describe_type(a) for a in get_args(tp))
    if origin is list:
        return f"list of {describe_type(get_args(tp)[0])}"
    if origin is dict:
        return "table"
    return {bool: "bool", int: "int", float: "float", str: "str"}.get(tp, getattr(tp, "__name__", str(tp)))


def config_help(section: str | None = None) -> str:
    """The text `megascale train --help [SECTION]` prints after the command's own options."""
    known = sections()
    if section is not None and section not in known:
        return f"unknown section {section!r}; choose one of: {', '.join(known)}"
    lines = ["config keys (set with --section.key=value or --section.key value; defaults shown):"]
    for name, doc in known.items():
        if section not in (None, name):
            continue
        lines += ["", f"[{name}]  {doc}"]
        for key in keys():
            if key.name.split(".")[0] == name:
                lines.append(f"  --{key.name} {key.type}  (default {_show(key.default)})")
                lines.append(f"      {key.doc}")
    if section is None:
        lines += ["", packaged_default_line().replace("`", ""), "one section only: --help SECTION (e.g. --help model)"]
    return "\n".join(lines)


def markdown_reference() -> str:
    """The key reference of docs/configuration.md, one table per section (regenerate it with
    `python -m megascale.config.help` when a key changes; a test checks the doc lists them all)."""
    out = []
    for name, doc in sections().items():
        out += [f"### `{name}`", "", doc, "", "| key | type | default | meaning |", "|---|---|---|---|"]
        out += [
            f"| `{k.name}` | {k.type.replace('|', ' or ')} | {_show(k.default)} | {k.doc.replace('|', '&#124;')} |"
            for k in keys()
            if k.name.split(".")[0] == name
        ]
        out.append("")
    out.append(packaged_default_line() + ".")
    return "\n".join(out)


def _show(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, str):
        return repr(value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def _first_line(cls: type) -> str:
    return (cls.__doc__ or "").strip().splitlines()[0]


if __name__ == "__main__":
    print(markdown_reference())
