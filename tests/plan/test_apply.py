"""Plans the launchers apply: topology sources, the planner's node order, the ranks' environment.

The last test runs a real local `megascale launch` (2 nodes x 2 ranks, no network namespaces)
with a topology file that puts the second node first, and reads back from each live rank's
log the rank it was given and the planner's communication settings.
"""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import pytest

from megascale.config import ConfigError
from megascale.plan.apply import (
    expand_hostlist,
    order_nodes,
    parse_k8s_nodes,
    parse_scontrol_topology,
    plan_node_order,
    read_topology,
)
from megascale.plan.env import FLIGHT_RECORDER_VARS, launch_env, with_defaults
from megascale.plan.layout import Layout
from megascale.resilience.selfcheck.checks import pair_backend

# The format of Slurm's topology/tree plugin (slurm.conf: TopologyPlugin=topology/tree), as
# `scontrol show topology` prints it: leaf switches list nodes, the switch above lists them.
SCONTROL = """\
SwitchName=tor0 Level=0 LinkSpeed=1 Nodes=gpu[01-02]
SwitchName=tor1 Level=0 LinkSpeed=1 Nodes=gpu[03-04],gpu07
SwitchName=spine Level=1 LinkSpeed=1 Switches=tor[0-1]
"""


def k8s_node(name: str, tor: str, block: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "topology.k8s.aws/network-node-layer-3": tor,
                "topology.k8s.aws/network-node-layer-2": block,
            },
        },
    }


def test_slurm_host_lists_and_topology():
    assert expand_hostlist("gpu[01-03,07],login1,n[8-10]-ib") == [
        "gpu01",
        "gpu02",
        "gpu03",
        "gpu07",
        "login1",
        "n8-ib",
        "n9-ib",
        "n10-ib",
    ]
    hosts = {h.name: (h.tor, h.pod) for h in parse_scontrol_topology(SCONTROL)}
    assert hosts == {"gpu01": (0, 2), "gpu02": (0, 2), "gpu03": (1, 2), "gpu04": (1, 2), "gpu07": (1, 2)}
    with pytest.raises(ConfigError, match="topology/tree"):
        parse_scontrol_topology("SwitchName=s Level=1 Switches=a")


def test_kubernetes_node_labels(tmp_path):
    doc = {
        "apiVersion": "v1",
        "kind": "List",
        "items": [k8s_node("a", "nn-1", "b-1"), k8s_node("b", "nn-2", "b-1"), k8s_node("c", "nn-1", "b-1")],
    }
    hosts = parse_k8s_nodes(doc)
    assert hosts[0].tor == hosts[2].tor != hosts[1].tor and len({h.pod for h in hosts}) == 1
    path = tmp_path / "nodes.json"
    path.write_text(json.dumps(doc))
    by_zone = read_topology(f"k8s:{path}#tor=kubernetes.io/hostname")
    assert len({h.tor for h in by_zone}) == 3
    with pytest.raises(ConfigError, match="no label 'rack'"):
        read_topology(f"k8s:{path}#tor=rack")
    with pytest.raises(ConfigError, match="file:PATH"):
        read_topology("consul:x")


def test_node_order_follows_the_placement(tmp_path):
    topo = tmp_path / "hosts"
    # 4 nodes registered a, b, c, d; a and c under one ToR, b and d under another
    topo.write_text("a 0 0\nb 1 0\nc 0 0\nd 1 0\n")
    nodes = [(n, f"host-{n}") for n in "abcd"]
    # pp=2, each stage two nodes of 8 GPUs: each stage's pair under one ToR, stages next
    order = plan_node_order(f"file:{topo}", nodes, Layout(dp=2, tp=8, pp=2), 8)
    assert [nodes[i][0] for i in order.order] == ["a", "c", "b", "d"]
    assert "2 ToR(s)" in order.reason
    assert plan_node_order(None, nodes, Layout(dp=4), 8).order == [0, 1, 2, 3]
    # a node the topology does not know is an error naming it
    with pytest.raises(ConfigError, match=r"\['e'\]"):
        plan_node_order(f"file:{topo}", nodes + [("e",)], Layout(dp=2, tp=8, pp=2), 8)
    # the driver's form: objects with node_id / host / address; unusable -> unchanged, with why
    drivers = [SimpleNamespace(node_id=n, host="h", address="10.0.0.1") for n in "abcd"]
    same, line = order_nodes(f"file:{topo}", drivers, {"dp": 4, "tp": 4, "pp": 1}, 2)
    assert same == drivers and "registration order" in line and "tp=4" in line


def test_launch_env_defaults_never_override():
    env = launch_env("/runs/x")
    assert env["NCCL_IB_TIMEOUT"] == "22" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == "/runs/x/flight_recorder/rank_"
    assert "MEGASCALE_COLLECTIVE_TIMEOUT_S" not in env
    assert not set(FLIGHT_RECORDER_VARS) & set(launch_env("/runs/x", flight_recorder=False))
    merged = with_defaults({"NCCL_DEBUG": "INFO", "PATH": "/bin"}, env)
    assert merged["NCCL_DEBUG"] == "INFO" and merged["NCCL_IB_RETRY_CNT"] == "7"
    assert pair_backend() == ("gloo", "cpu")  # no CUDA here: the self-check stays on gloo


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ranks_receive_the_planned_order_and_env(tmp_path, monkeypatch):
    from tests.resilience.jobs import PAUSE, Job

    topo = tmp_path / "topology.txt"
    topo.write_text("node1 0 0\nnode0 1 0\n")  # node1 under the first ToR: it runs ranks 0, 1
    monkeypatch.setenv("NCCL_DEBUG", "INFO")  # set where the job is launched: it must win
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)  # an in-process trainer of an earlier test sets it
    job = Job(tmp_path / "run", fault=PAUSE, spares=0, extra=("--topology", f"file:{topo}"))
    job.start()
    try:
        status = job.wait_for(
            lambda s: (
                sum(r.get("alive") and (r.get("step") or 0) >= 1 for n in s["nodes"].values() for r in n["ranks"]) == 4
            )
        )
        node_of = {r["rank"]: node for node, info in status["nodes"].items() for r in info["ranks"]}
        assert {node_of[0], node_of[1]} == {"node1"} and {node_of[2], node_of[3]} == {"node0"}
        assert status["nodes"]["node1"]["slot"] == 0
        # a standby takes its environment from the assignment (os.environ, not /proc/PID/environ):
        # each rank's log says what it runs with
        for rank in range(4):
            log = next(job.run_dir.rglob(f"rank{rank:05d}.log")).read_text()
            env = dict(kv.split("=", 1) for kv in log.split("communication env: ", 1)[1].split("\n", 1)[0].split())
            assert env["NCCL_IB_TIMEOUT"] == "22" and env["NCCL_IB_RETRY_CNT"] == "7"
            assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
            assert env["NCCL_DEBUG"] == "INFO"
            assert "TORCH_FR_BUFFER_SIZE" not in env  # the job has the Flight Recorder off
        job.client.call("POST", "/v1/stop", {"reason": "test done"})
        deadline = time.monotonic() + 60
        while job.procs[-1].poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        log = job.log_tail(20000)
        assert "node order (planner placement over 2 ToR(s)" in log and "node1, node0" in log
        assert "communication env: NCCL_DEBUG=WARN" in log
    finally:
        job.cleanup()
    assert os.path.exists(tmp_path / "run" / "resilience" / "driver.sqlite")
