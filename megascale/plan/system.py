"""Training systems as the planner sees them: which optimisations are on, and how fast their code runs.

A system preset (`configs/systems/<name>.toml`, or a path; `extends` works as for clusters) says
which of MegaScale's optimisations a system uses -- parallel block, sliding-window attention,
TP/PP/DP overlap, fused operators, LAMB's larger batch, the ZeRO stage -- and the constants of
its implementation (`layout.Implementation`: launch gaps, per-chunk overhead, per-step host
work, jitter, the gradients' wire dtype). `megascale` is this project's target; `megatron` is
Megatron-LM as MegaScale measured it (commit 285068c8, January 2023). The sources of every value
are in the preset files and docs/planning.md ("Systems").

`ablation_steps` lists the switches that turn one system into another, in MegaScale's Table 3
order, so `--ablate` can walk from a baseline to all-on on one fixed layout.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from megascale.config.fields import ConfigError
from megascale.plan.cluster import find_preset, read_preset
from megascale.plan.layout import Effects, Features, Implementation, Workload
from megascale.plan.stragglers import Jitter

SYSTEM_DIR = Path(__file__).resolve().parents[2] / "configs" / "systems"
ATTENTION_KERNELS = ("flash2", "flash1", "unfused")


@dataclass(frozen=True)
class SystemSpec:
    name: str
    block: str  # "parallel" (PTB) or "serial"
    window: int | None  # sliding-window span; None = full causal attention
    optimizer: str  # "lamb" or "adamw"
    lamb_scale: int  # batch growth LAMB allows without loss (MegaScale 3.1: up to 4x)
    zero: int
    features: Features
    notes: str = ""

    def apply(self, work: Workload) -> Workload:
        """The job's model under this system's algorithmic choices (block, window, optimizer)."""
        window = None if self.window is None else min(self.window, work.model.seq_len)
        return replace(work.with_model(block=self.block, window=window), optimizer=self.optimizer)

    def with_effects(self, effects: Effects) -> SystemSpec:
        return replace(self, features=replace(self.features, effects=effects))


def list_systems() -> list[str]:
    return sorted(p.stem for p in SYSTEM_DIR.glob("*.toml"))


def load_system(name_or_path: str) -> SystemSpec:
    """A preset name (`megatron`) or a TOML path; errors name the key that is wrong."""
    path = find_preset(name_or_path, SYSTEM_DIR, "system")
    return system_from_dict(read_preset(path, SYSTEM_DIR), default_name=path.stem)


def system_from_dict(raw: dict[str, Any], default_name: str = "system") -> SystemSpec:
    model, optim, par, ops, impl = (
        raw.get(k, {}) for k in ("model", "optim", "parallel", "operators", "implementation")
    )
    known = {
        "model": {"block", "window"},
        "optim": {"name", "lamb_scale"},
        "parallel": {"zero", "tp_overlap", "tp_chunks", "pp_overlap", "dp_overlap", "data_overlap"},
        "operators": {"attention", "fused_elementwise"},
        "implementation": {f for f in Implementation.__dataclass_fields__ if f != "jitter"} | {"jitter_cv"},
    }
    for section, table in zip(known, (model, optim, par, ops, impl), strict=True):
        extra = sorted(set(table) - known[section])
        if extra:
            raise ConfigError(f"system [{section}] has unknown key(s) {extra}; known: {sorted(known[section])}")
    block = model.get("block", "parallel")
    if block not in ("parallel", "serial"):
        raise ConfigError(f"system model.block must be 'parallel' or 'serial', got {block!r}")
    window = int(model.get("window", 0)) or None
    attention = ops.get("attention", "flash2")
    if attention not in ATTENTION_KERNELS:
        raise ConfigError(f"system operators.attention must be one of {ATTENTION_KERNELS}, got {attention!r}")
    optimizer = optim.get("name", "lamb")
    if optimizer not in ("lamb", "adamw"):
        raise ConfigError(f"system optim.name must be 'lamb' or 'adamw', got {optimizer!r}")
    zero = int(par.get("zero", 2))
    if zero not in (0, 1, 2, 3):
        raise ConfigError(f"system parallel.zero must be 0-3, got {zero}")
    values = {k: float(v) for k, v in impl.items() if k not in ("jitter_cv", "grad_wire_bytes")}
    if any(v < 0 for v in values.values()) or float(impl.get("jitter_cv", 0)) < 0:
        raise ConfigError("system [implementation] values must be >= 0")
    implementation = Implementation(
        **values,
        grad_wire_bytes=int(impl.get("grad_wire_bytes", 0)),
        jitter=Jitter(cv=float(impl.get("jitter_cv", 0.0)), source="preset"),
    )
    features = Features(
        tp_overlap=bool(par.get("tp_overlap", True)),
        tp_chunks=int(par.get("tp_chunks", 2)),
        pp_overlap=bool(par.get("pp_overlap", True)),
        dp_overlap=bool(par.get("dp_overlap", True)),
        data_overlap=bool(par.get("data_overlap", True)),
        attention=attention,
        fused_elementwise=bool(ops.get("fused_elementwise", True)),
        impl=implementation,
    )
    return SystemSpec(
        name=str(raw.get("name", default_name)),
        block=block,
        window=window,
        optimizer=optimizer,
        lamb_scale=int(optim.get("lamb_scale", 1)),
        zero=zero,
        features=features,
        notes=str(raw.get("notes", "")),
    )


# Each optimisation as (name, what it changes): model fields, Features fields, Implementation
# fields. The order is MegaScale's Table 3; LAMB (the batch growth) comes last.
ABLATION = (
    ("parallel block", ("block",), (), ()),
    ("sliding window", ("window",), (), ()),
    ("TP overlap", (), ("tp_overlap", "tp_chunks"), ()),
    ("PP overlap", (), ("pp_overlap",), ("chunk_overhead_us",)),
    ("DP overlap", (), ("dp_overlap", "data_overlap"), ("grad_wire_bytes",)),
    ("efficient operators", (), ("attention", "fused_elementwise"), ("launch_gap_us",)),
    ("data pipeline, GC, stragglers", (), (), ("host_overhead_s", "jitter", "overlap_contention")),
)


def switch_on(current: SystemSpec, target: SystemSpec, step: str) -> SystemSpec:
    """`current` with the switches and constants of one ABLATION step taken from `target`."""
    model_keys, feature_keys, impl_keys = next(a[1:] for a in ABLATION if a[0] == step)
    impl = replace(current.features.impl, **{k: getattr(target.features.impl, k) for k in impl_keys})
    features = replace(current.features, impl=impl, **{k: getattr(target.features, k) for k in feature_keys})
    return replace(current, features=features, **{k: getattr(target, k) for k in model_keys})


def ablation_steps(base: SystemSpec, target: SystemSpec) -> list[tuple[str, SystemSpec]]:
    """(name, system) after each optimisation of `target` is switched on over `base`, in order;
    LAMB's batch growth is left to the caller (it changes the batch, not the system)."""
    out, current = [], base
    for name, *_ in ABLATION:
        current = switch_on(current, target, name)
        out.append((name, current))
    return out
