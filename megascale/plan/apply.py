"""What the launchers take from the planner: the order of their nodes and the communication env.

`megascale launch` (the driver) orders its active nodes by the planner's placement
(`placement.place`: tp inside a node, each pipeline stage's nodes under as few ToRs as possible,
consecutive stages close) when it is told the network topology, and hands every rank the
planner's NCCL / Flight Recorder settings (`env.py`); `megascale train --nproc` applies the same
settings to its local ranks. Both log what they applied. Settings already in a node's own
environment win: the planner's values are defaults, not overrides (`env.launch_env`). This module
imports the placement (and so torch): the driver imports it only when a topology is given.

Topology sources (`--topology`):
  file:PATH             one `name tor [pod]` line per host (placement.read_hosts)
  slurm[:PATH]          `scontrol show topology` (run now, or its saved output): a host's ToR is
                        the level-0 switch that lists it, its pod the switch above that one
  k8s:PATH[#tor=L,pod=L]  `kubectl get nodes -o json`; ToR and pod from node labels (default
                        the EKS network-topology labels network-node-layer-3 / -layer-2)
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from megascale.config.fields import ConfigError
from megascale.plan.layout import Layout
from megascale.plan.placement import Host, place, read_hosts

K8S_TOR_LABEL = "topology.k8s.aws/network-node-layer-3"
K8S_POD_LABEL = "topology.k8s.aws/network-node-layer-2"


def expand_hostlist(text: str) -> list[str]:
    """Slurm host lists: `gpu[01-03,07],login1` -> gpu01 gpu02 gpu03 gpu07 login1."""
    names = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", text):
        match = re.fullmatch(r"(.*)\[([^\]]*)\](.*)", item)
        if not match:
            names.append(item)
            continue
        prefix, ranges, suffix = match.groups()
        for part in ranges.split(","):
            low, _, high = part.partition("-")
            for i in range(int(low), int(high or low) + 1):
                names.append(f"{prefix}{i:0{len(low)}d}{suffix}")
    return names


def parse_scontrol_topology(text: str) -> list[Host]:
    switches = []
    for line in text.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if "SwitchName" in fields:
            switches.append(fields)
    parent = {child: i for i, s in enumerate(switches) if "Switches" in s for child in expand_hostlist(s["Switches"])}
    hosts = []
    for tor, s in enumerate(switches):
        for name in expand_hostlist(s.get("Nodes", "")) if s.get("Level", "0") == "0" else []:
            hosts.append(Host(name, tor, parent.get(s["SwitchName"], 0)))
    if not hosts:
        raise ConfigError(
            "scontrol show topology lists no level-0 switch with Nodes=; is topology/tree configured in slurm.conf?"
        )
    return hosts


def parse_k8s_nodes(doc: dict, tor_label: str = K8S_TOR_LABEL, pod_label: str = K8S_POD_LABEL) -> list[Host]:
    ids: dict[str, int] = {}
    hosts = []
    for item in doc.get("items", []):
        meta = item.get("metadata", {})
        labels = meta.get("labels", {})
        if tor_label not in labels:
            raise ConfigError(
                f"k8s node {meta.get('name')!r} has no label {tor_label!r}; name the ToR label with k8s:PATH#tor=LABEL"
            )
        tor = ids.setdefault("tor:" + labels[tor_label], len(ids))
        pod = ids.setdefault("pod:" + labels.get(pod_label, ""), len(ids))
        hosts.append(Host(str(meta.get("name")), tor, pod))
    return hosts


def read_topology(source: str) -> list[Host]:
    kind, _, rest = source.partition(":")
    if kind == "file":
        return read_hosts(rest)
    if kind == "slurm":
        text = (
            Path(rest).read_text()
            if rest
            else subprocess.run(["scontrol", "show", "topology"], capture_output=True, text=True, check=True).stdout
        )
        return parse_scontrol_topology(text)
    if kind == "k8s":
        path, _, options = rest.partition("#")
        labels = dict(o.split("=", 1) for o in options.split(",") if "=" in o)
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--topology {source}: cannot read nodes JSON ({exc})") from exc
        return parse_k8s_nodes(doc, labels.get("tor", K8S_TOR_LABEL), labels.get("pod", K8S_POD_LABEL))
    raise ConfigError(f"--topology {source!r}: use file:PATH, slurm[:PATH] or k8s:PATH[#tor=LABEL]")


@dataclass(frozen=True)
class NodeOrder:
    order: list[int]  # indices into the nodes given, rank order (node k runs ranks k*G...)
    reason: str


def plan_node_order(
    source: str | None, nodes: Sequence[tuple[str, ...]], layout: Layout, ranks_per_node: int
) -> NodeOrder:
    """The planner's order of `nodes` (each given by its names: id, host, address...)."""
    identity = list(range(len(nodes)))
    if not source:
        return NodeOrder(identity, "registration order (no --topology)")
    topology = {h.name: h for h in read_topology(source)}
    found = [next((topology[n] for n in names if n in topology), None) for names in nodes]
    missing = [names[0] for names, host in zip(nodes, found, strict=True) if host is None]
    if missing:
        raise ConfigError(f"--topology {source}: no entry for node(s) {missing}")
    try:
        placed = place(layout, [h for h in found if h is not None], ranks_per_node)
    except ConfigError as exc:
        return NodeOrder(identity, f"registration order ({exc})")
    index = {h.name: i for i, h in enumerate(found) if h is not None}
    order = [index[h.name] for h in placed.hosts]
    return NodeOrder(
        order + [i for i in identity if i not in order],
        f"planner placement over {len({h.tor for h in placed.hosts})} ToR(s) from {source}",
    )


def describe(order: NodeOrder, names: list[str]) -> str:
    return f"node order ({order.reason}): {', '.join(names[i] for i in order.order)}"


def order_nodes(source: str, nodes: list, layout: dict[str, int], ranks_per_node: int) -> tuple[list, str]:
    """The driver's active nodes (with node_id, host, address) in the planner's order, and the
    line to log; a topology that cannot be used leaves the order as it is, and says why."""
    names = [(n.node_id, n.host, n.address) for n in nodes]
    lay = Layout(dp=layout["dp"], tp=layout["tp"], pp=layout["pp"], cp=layout.get("cp", 1))
    try:
        order = plan_node_order(source, names, lay, ranks_per_node)
    except (ConfigError, OSError, subprocess.CalledProcessError) as exc:
        order = NodeOrder(list(range(len(nodes))), f"registration order: {exc}")
    return [nodes[i] for i in order.order], describe(order, [n.node_id for n in nodes])
