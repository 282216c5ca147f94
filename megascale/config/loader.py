"""TOML files and `--section.key=value` overrides into a checked `JobConfig`.

Types come from the dataclass annotations, so a new field needs no parsing code. Every error
names the full key (`model.heads`) and what it accepts.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import tomli_w

from megascale.config.fields import ConfigError
from megascale.config.private_files import write_private
from megascale.config.schema import JobConfig, redacted_url

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def default_config_path() -> Path:
    """The config shipped with the package: the small CPU job `megascale train` runs by default."""
    return Path(str(resources.files("megascale.config") / "default.toml"))


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Build a validated config from the built-in defaults, an optional TOML file over them, then
    `--a.b=v` overrides."""
    text = ""
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        text = path.read_text()
    return config_from_toml(text, f"config file {path}", overrides)


def config_from_toml(text: str, source: str, overrides: list[str] | None = None) -> JobConfig:
    """A validated config from TOML text (`source` names it in errors), then `--a.b=v` overrides."""
    cfg = typed_config(text, source, overrides)
    cfg.validate()
    return cfg


def typed_config(text: str, source: str, overrides: list[str] | None = None) -> JobConfig:
    """As `config_from_toml`, with every key and type checked but the values not validated yet
    (for a caller that changes the config first)."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source} is not valid TOML: {exc}") from exc
    for item in overrides or []:
        key, value = parse_override(item)
        set_dotted(raw, key, value)
    return from_dict(JobConfig, raw, prefix="")


def parse_override(item: str) -> tuple[str, Any]:
    """`--model.layers=4` -> ("model.layers", 4); the value is read as TOML, else a string."""
    text = item[2:] if item.startswith("--") else item
    if "=" not in text:
        raise ConfigError(f"override {item!r} must look like --section.key=value")
    key, value = text.split("=", 1)
    try:
        parsed = tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value
    return key.strip(), parsed


def from_dict(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'} must be a table, got {data!r}")
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        key = f"{prefix}{unknown[0]}"
        raise ConfigError(f"unknown config key {key!r}; allowed in this section: {sorted(names)}")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(hints[name], value, f"{prefix}{name}")
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, key: str) -> Any:
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return from_dict(tp, value, prefix=f"{key}.")
    origin = get_origin(tp)
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{key} must be one of {list(allowed)}, got {value!r}")
        return value
    if origin in (Union, types.UnionType):
        options = get_args(tp)
        if (value is None or (isinstance(value, str) and value.lower() == "none")) and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(option, value, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key} must be {_describe(tp)}, got {value!r}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return [_coerce(get_args(tp)[0], v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        key_t, val_t = get_args(tp)
        if isinstance(value, str):
            value = _pairs(value, key)
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a table, got {value!r}")
        return {_coerce(key_t, k, key): _coerce(val_t, v, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str and isinstance(value, str):
        return value
    raise ConfigError(f"{key} must be {_describe(tp)}, got {value!r} ({type(value).__name__})")


def _pairs(text: str, key: str) -> dict[str, Any]:
    """A table written on the command line without TOML's quotes: `a/b=3,c/d=1` or `{a/b=3, c/d=1}`."""
    table: dict[str, Any] = {}
    for item in text.strip().removeprefix("{").removesuffix("}").split(","):
        name, _, value = item.strip().rpartition("=")
        name = name.strip().strip("'\"")
        if not name or not value.strip():
            raise ConfigError(
                f"{key} must be a table, got {text!r}; write --{key}=PATH=WEIGHT,PATH=WEIGHT "
                f"(e.g. --{key}=data/a=3,data/b=1) or, in TOML, {key.rpartition('.')[2]} = "
                f'{{"data/a" = 3.0, "data/b" = 1.0}}'
            )
        table[name] = parse_override(f"v={value.strip()}")[1]
    return table


def _describe(tp: Any) -> str:
    if get_origin(tp) in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(tp))
    if tp is type(None):
        return "absent/none"
    return getattr(tp, "__name__", str(tp))


def set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key!r}: {part!r} is not a section")
    node[parts[-1]] = value


def to_dict(cfg: Any) -> dict[str, Any]:
    """A TOML-serialisable dict (None values are dropped: TOML has no null). A password in a
    Redis URL is redacted: these dicts are written to RUN_DIR/config.toml and checkpoints."""

    def clean(obj: Any) -> Any:
        if isinstance(obj, dict):
            return {k: redacted_url(v) if k == "redis_url" else clean(v) for k, v in obj.items() if v is not None}
        return obj

    return clean(dataclasses.asdict(cfg))


def dump_config(cfg: JobConfig, path: str | Path) -> None:
    """Write RUN_DIR/config.toml: atomically (ranks and tools may read it meanwhile) and 0600."""
    write_private(path, tomli_w.dumps(to_dict(cfg)))


__all__ = ["load_config", "config_from_toml", "dump_config", "to_dict", "parse_override"]
