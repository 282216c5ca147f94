"""A cluster as the planner sees it: GPU, node and three-tier Clos network, loaded from TOML.

Presets live in `configs/clusters/<name>.toml`; `load_cluster` accepts a preset name or a path.
Every bandwidth is stored in bytes/s and every latency in seconds, whatever units the TOML uses
(GB/s, Gbit/s, microseconds), so the cost model never converts units.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from megascale.config.fields import ConfigError
from megascale.diagnostics.mfu import PEAK_FLOPS
from megascale.plan.stragglers import SlowHosts

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PRESET_DIR = Path(__file__).resolve().parents[2] / "configs" / "clusters"
GIB = 1024**3


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator: peak FLOP/s per dtype and the achievable fractions of it."""

    name: str
    peak_flops: dict[str, float]
    memory_bytes: float
    hbm_bytes_per_s: float
    gemm_efficiency: float  # best large-GEMM fraction of peak (see docs/planning.md)
    attention_efficiency: float  # best fused-attention fwd+bwd fraction of peak
    reserved_bytes: float = 3 * GIB  # context, cuBLAS/NCCL workspaces, allocator slack
    kernel_overhead_s: float = 0.0  # exposed launch cost per kernel (0: hidden by async launch)

    def peak(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise ConfigError(f"cluster gpu {self.name!r} has no peak for dtype {dtype!r}")
        return self.peak_flops[dtype]


@dataclass(frozen=True)
class NodeSpec:
    gpus: int
    nvlink_bytes_per_s: float  # per GPU, one direction, achievable (NCCL bus bandwidth)
    nvlink_latency_s: float  # per ring step inside a node
    nics: int
    nic_bytes_per_s: float  # per NIC, one direction, line rate

    @property
    def network_bytes_per_gpu(self) -> float:
        """Line-rate network bandwidth one GPU gets when all GPUs of the node send at once."""
        return self.nics * self.nic_bytes_per_s / self.gpus


@dataclass(frozen=True)
class NetworkSpec:
    """Three-tier Clos: nodes under a ToR, ToRs under a pod's aggregation layer, pods under core."""

    nodes_per_tor: int
    tors_per_pod: int
    oversubscription: tuple[float, float] = (1.0, 1.0)  # (ToR, aggregation) downlink:uplink
    efficiency: float = 0.85  # achievable fraction of line rate for a collective (RoCE/IB)
    hop_latency_s: float = 8e-6  # per ring step across the network (NIC + switches + software)
    uplinks_per_tor: int = 32  # per ToR switch (per rail switch when multi-rail)
    split_downlinks: bool = True  # a 400G port split into 2x200G downlinks (MegaScale)
    rails: int = 1  # NIC k of every node goes to ToR switch k of its rail group (multi-rail)
    flows_per_connection: int = 2  # independently hashed flows per ring hop (NCCL channels x QPs)


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    gpu: GPUSpec
    node: NodeSpec
    network: NetworkSpec
    notes: str = ""
    slow_hosts: SlowHosts = SlowHosts()  # the fleet's persistently slow hosts (stragglers.py)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def gpus_per_node(self) -> int:
        return self.node.gpus

    def nodes_for(self, gpus: int) -> int:
        if gpus % self.node.gpus and gpus > self.node.gpus:
            raise ConfigError(f"--gpus={gpus} is not a whole number of {self.node.gpus}-GPU nodes of {self.name}")
        return max(1, gpus // self.node.gpus)

    def with_network(self, **changes: Any) -> ClusterSpec:
        return replace(self, network=replace(self.network, **changes))


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def load_cluster(name_or_path: str) -> ClusterSpec:
    """A preset name (`a100-8x200g`) or a TOML path; errors name the key that is wrong."""
    path = find_preset(name_or_path, PRESET_DIR, "cluster")
    return cluster_from_dict(read_preset(path, PRESET_DIR), default_name=path.stem)


def find_preset(name_or_path: str, preset_dir: Path, kind: str) -> Path:
    """A TOML file, else `<preset_dir>/<name>.toml`; the error lists the presets."""
    path = Path(name_or_path)
    if not path.is_file():
        path = preset_dir / f"{name_or_path}.toml"
    if not path.is_file():
        presets = sorted(p.stem for p in preset_dir.glob("*.toml"))
        raise ConfigError(f"{kind} {name_or_path!r} is neither a file nor a preset; presets: {presets}")
    return path


def read_preset(path: Path, preset_dir: Path, depth: int = 0) -> dict[str, Any]:
    """TOML with `extends = "<preset in preset_dir>"`: the variant overrides only the keys it
    names (tables merge key by key). Used for cluster and system presets alike."""
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from exc
    base_name = raw.pop("extends", None)
    if base_name is None:
        return raw
    base_path = preset_dir / f"{base_name}.toml"
    if depth > 4 or not base_path.is_file():
        raise ConfigError(f"{path}: extends={base_name!r} is not a preset in {preset_dir} (or extends too deep)")
    merged = read_preset(base_path, preset_dir, depth + 1)
    merged.pop("notes", None)
    for key, value in raw.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def cluster_from_dict(raw: dict[str, Any], default_name: str = "cluster") -> ClusterSpec:
    gpu_raw, node_raw, net_raw = (_section(raw, k) for k in ("gpu", "node", "network"))
    peak = gpu_raw.get("peak_flops")
    if isinstance(peak, str):
        if peak not in PEAK_FLOPS:
            raise ConfigError(f"gpu.peak_flops={peak!r} is not a known device {list(PEAK_FLOPS)}")
        peak = PEAK_FLOPS[peak]
    if not isinstance(peak, dict) or not peak:
        raise ConfigError("gpu.peak_flops must be a device name or a table {dtype = FLOP/s}")
    gpu = GPUSpec(
        name=str(gpu_raw.get("name", "gpu")),
        peak_flops={str(k): float(v) for k, v in peak.items()},
        memory_bytes=_num(gpu_raw, "gpu.memory_gib") * GIB,
        hbm_bytes_per_s=_num(gpu_raw, "gpu.hbm_gbps") * 1e9,
        gemm_efficiency=_frac(gpu_raw, "gpu.gemm_efficiency"),
        attention_efficiency=_frac(gpu_raw, "gpu.attention_efficiency"),
        reserved_bytes=float(gpu_raw.get("reserved_gib", 3.0)) * GIB,
        kernel_overhead_s=float(gpu_raw.get("kernel_overhead_us", 0.0)) * 1e-6,
    )
    node = NodeSpec(
        gpus=int(_num(node_raw, "node.gpus")),
        nvlink_bytes_per_s=_num(node_raw, "node.nvlink_gbps") * 1e9,
        nvlink_latency_s=float(node_raw.get("nvlink_latency_us", 3.0)) * 1e-6,
        nics=int(_num(node_raw, "node.nics")),
        nic_bytes_per_s=_num(node_raw, "node.nic_gbits") * 1e9 / 8,
    )
    over = net_raw.get("oversubscription", [1.0, 1.0])
    if not (isinstance(over, list) and len(over) == 2 and all(float(o) >= 1 for o in over)):
        raise ConfigError("network.oversubscription must be [tor, aggregation], each >= 1")
    network = NetworkSpec(
        nodes_per_tor=int(_num(net_raw, "network.nodes_per_tor")),
        tors_per_pod=int(_num(net_raw, "network.tors_per_pod")),
        oversubscription=(float(over[0]), float(over[1])),
        efficiency=_frac(net_raw, "network.efficiency", 0.85),
        hop_latency_s=float(net_raw.get("hop_latency_us", 8.0)) * 1e-6,
        uplinks_per_tor=int(net_raw.get("uplinks_per_tor", 32)),
        split_downlinks=bool(net_raw.get("split_downlinks", True)),
        rails=int(net_raw.get("rails", 1)),
        flows_per_connection=int(net_raw.get("flows_per_connection", 2)),
    )
    if network.rails not in (1, node.gpus):
        raise ConfigError(f"network.rails must be 1 or node.gpus={node.gpus}, got {network.rails}")
    if network.flows_per_connection < 1:
        raise ConfigError("network.flows_per_connection must be >= 1")
    fleet = raw.get("fleet", {})
    slow = SlowHosts(
        fraction=float(fleet.get("slow_host_fraction", 0.0)), slowdown=float(fleet.get("slow_host_slowdown", 0.0))
    )
    if not (0 <= slow.fraction <= 1 and slow.slowdown >= 0):
        raise ConfigError("fleet.slow_host_fraction must be in [0, 1] and fleet.slow_host_slowdown >= 0")
    return ClusterSpec(
        name=str(raw.get("name", default_name)),
        gpu=gpu,
        node=node,
        network=network,
        notes=str(raw.get("notes", "")),
        slow_hosts=slow,
    )


def _section(raw: dict[str, Any], key: str) -> dict[str, Any]:
    value = raw.get(key)
    if not isinstance(value, dict):
        raise ConfigError(f"cluster description needs a [{key}] table")
    return value


def _num(raw: dict[str, Any], key: str) -> float:
    short = key.split(".")[-1]
    if short not in raw:
        raise ConfigError(f"cluster key {key} is missing")
    value = raw[short]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"cluster key {key} must be a positive number, got {value!r}")
    return float(value)


def _frac(raw: dict[str, Any], key: str, default: float | None = None) -> float:
    short = key.split(".")[-1]
    if short not in raw and default is not None:
        return default
    value = _num(raw, key)
    if value > 1:
        raise ConfigError(f"cluster key {key} is a fraction of peak and must be <= 1, got {value}")
    return value
