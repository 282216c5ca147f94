"""Self-check thresholds relative to the fleet: nodes checked together are compared with each
other, a recorded baseline per hardware type backs a node checked alone, floors stay a backstop.

The slowed node is really slowed: a cgroup CPU quota that keeps it at half the CPU its peers
actually get (re-measured every 0.2 s: the machine is shared), and a token-bucket rate limit on
its veth at half the links' healthy bandwidth measured just before.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megascale.config import load_config
from megascale.resilience import selfcheck
from megascale.resilience.local import Netns, netns_available, netns_down, netns_up
from megascale.resilience.selfcheck_plan import build, judge, relative
from megascale.resilience.slowdown import CpuQuota, cpu_quota_available, slow_link
from megascale.resilience.state import Node

REPO = Path(__file__).resolve().parents[2]
RATIO = 0.7


def _report(node: str, hardware: str = "cpu:x", links: dict[str, float] | None = None, **figures: float) -> dict:
    tests = [{"name": k, "value": v, "passed": True} for k, v in figures.items()]
    tests += [{"name": "p2p_bandwidth", "peer": p, "value": v, "passed": True} for p, v in (links or {}).items()]
    return {"ok": True, "report": {"node": node, "hardware": hardware, "tests": tests}}


def test_a_node_at_half_its_peers_speed_fails_and_jitter_passes():
    results = {f"n{i}": _report(f"n{i}", gemm=10.0 * (1 + 0.1 * (i % 3 - 1))) for i in range(4)}
    assert judge(results, RATIO)["failed"] == {}
    results["n2"] = _report("n2", gemm=5.0)
    failed = judge(results, RATIO)["failed"]
    assert list(failed) == ["n2"] and failed["n2"].startswith("gemm: 5 is 56% of the median 9 ")


def test_only_the_same_hardware_is_compared():
    results = {"a": _report("a", "cuda:H100", gemm=900.0), "b": _report("b", "cuda:H100", gemm=880.0),
               "c": _report("c", "cuda:A100", gemm=300.0)}
    assert relative(results, RATIO) == {}


def test_the_node_whose_every_link_is_slow_is_named_not_its_peers():
    """Ring a-b-c: c's link is slowed, so pairs b-c and c-a are slow and a-b fast."""
    results = {"a": _report("a", links={"b": 100.0, "c": 50.0}), "b": _report("b", links={"a": 100.0, "c": 50.0}),
               "c": _report("c", links={"a": 50.0, "b": 50.0})}
    assert list(relative(results, RATIO)) == ["c"] and "best link" in relative(results, RATIO)["c"]
    two = {"a": _report("a", links={"b": 50.0}), "b": _report("b", links={"a": 50.0})}
    assert relative(two, RATIO) == {}  # one link, two ends: which end is slow cannot be told


def test_a_recorded_baseline_backs_a_node_checked_alone(tmp_path):
    path = tmp_path / "expected.json"
    path.write_text(json.dumps({"gemm": 0.01}))  # an old flat file of floors is kept as floors
    report = selfcheck.run_checks("n0", {"ranks": 1})
    data = selfcheck.record_baseline(path, report)
    assert data["floors"] == {"gemm": 0.01} and report["hardware"] in data["baseline"]
    assert selfcheck.run_checks("n0", {"ranks": 1, "expected_file": str(path)})["passed"]
    data["baseline"][report["hardware"]]["gemm"] *= 4  # as if this node were a quarter of its healthy self
    path.write_text(json.dumps(data))
    again = selfcheck.run_checks("n0", {"ranks": 1, "expected_file": str(path)})
    gemm = next(t for t in again["tests"] if t["name"] == "gemm")
    assert not gemm["passed"] and gemm["expected"] == pytest.approx(RATIO * gemm["baseline"])
    floors, baselines = selfcheck.load_expected(str(path))
    assert floors["gemm"] == 0.01 and report["hardware"] in baselines


def _selfcheck(node: str, out: Path, *extra: str, ns: str | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "megascale.cli", "selfcheck", "--node-id", node, "--ranks", "1", "--json", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(out, "wb") as sink:
        return subprocess.Popen(["ip", "netns", "exec", ns, *cmd] if ns else cmd, cwd=REPO, env=env, stdout=sink)


def _judge(files: list[Path]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megascale.cli", "selfcheck", "--judge", *map(str, files)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(cpu_quota_available() is not None, reason=f"{cpu_quota_available()}")
def test_selfcheck_flags_a_node_at_half_its_peers_cpu_and_passes_a_healthy_fleet_10_of_10(tmp_path):
    passes = 0
    for repeat in range(10):  # three nodes checked together, as the driver runs them
        files = [tmp_path / f"h{repeat}-{i}.json" for i in range(3)]
        procs = [_selfcheck(f"n{i}", f) for i, f in enumerate(files)]
        assert all(p.wait(120) == 0 for p in procs)
        passes += _judge(files).returncode == 0
    assert passes == 10
    files = [tmp_path / f"slow-{i}.json" for i in range(3)]
    with CpuQuota(f"megascale-selfcheck-{os.getpid()}", cores=0.5) as quota:
        procs = [_selfcheck(f"n{i}", f) for i, f in enumerate(files[:2])]
        slow = _selfcheck("n2", files[2])
        quota.add([slow.pid])
        stop = quota.follow([p.pid for p in procs], 0.5)
        try:
            assert all(p.wait(120) == 0 for p in [*procs, slow])
        finally:
            stop()
    verdict = _judge(files)
    assert verdict.returncode == 1 and "n2: FAILED" in verdict.stdout, verdict.stdout
    assert "n0: PASSED" in verdict.stdout and "n1: PASSED" in verdict.stdout, verdict.stdout


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.timeout(300)
@pytest.mark.skipif(netns_available() is not None, reason=f"{netns_available()}")
def test_a_link_slowed_to_half_is_found_by_the_pair_tests(tmp_path):
    spec = Netns(f"f{os.getpid() % 1000}", net=78)
    netns_up(spec, 3)
    try:
        nodes = [Node(f"n{i}", spec.address(i), f"n{i}") for i in range(3)]
        cfg = load_config(None, []).resilience

        def check(name: str) -> tuple[list[Path], dict]:
            plans = build(nodes, 1, cfg)
            files = [tmp_path / f"{name}-{i}.json" for i in range(3)]
            procs = [_selfcheck(f"n{i}", f, "--plan", json.dumps(plans[f"n{i}"]), ns=spec.name(i))
                     for i, f in enumerate(files)]
            for p in procs:
                p.wait(120)
            reports = {f"n{i}": {"ok": True, "report": json.loads(f.read_text())} for i, f in enumerate(files)}
            return files, reports

        _, healthy = check("healthy")
        links = [t["value"] for r in healthy.values() for t in r["report"]["tests"] if t["name"] == "p2p_bandwidth"]
        assert len(links) == 6 and judge(healthy, RATIO)["failed"] == {}
        slow_link(spec, 2, mbit=sorted(links)[len(links) // 2] * 8 * 0.5)  # half the healthy median
        time.sleep(0.5)
        files, slowed = check("slowed")
        verdict = _judge(files)
        assert "n2: FAILED: best link" in verdict.stdout, (verdict.stdout, slowed)
        assert "n0: PASSED" in verdict.stdout and "n1: PASSED" in verdict.stdout
    finally:
        netns_down(spec, 3)
