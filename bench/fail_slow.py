"""Fail-slow benchmark (issue 33): one node really slowed ~2x, detection on vs off, and a jitter soak.

A local job of 2 nodes x 2 ranks + 2 spares trains a tiny model for `--steps` steps. At step
`--slow-at` the ranks of the node in slot 1 get a cgroup CPU quota of half the CPU they were
measured to use just before (its executor is left alone): its compute slows ~2x against its
peers (the figure the rule and the ranks' timers measure is recorded, not assumed). Runs:

- `on`:  resilience.straggler_action=replace: the node is named and replaced in place;
- `off`: resilience.straggler_action=off: the node stays in, the job runs at its pace;
- `jitter`: no slow node, every rank sleeps a random 0-40% of its compute in every step (+-20%),
  detection on: every detection is a false positive.

Reported: time and steps from the slowdown to detection, the job's tokens/s from the slowdown to
the last step and the ETTR of each run, their ratio on/off (goal >= 1.6), false positives
(goal 0). The machine is shared (2 cores, other jobs): runs are sequential, the ratio is only
as good as the load was steady; the load average is recorded.

    python bench/fail_slow.py [--steps 300] [--slow-at 15] [--window-steps 4] [--windows 2] [--jitter-steps 200]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from soak import MODEL, REPO, Soak

from megascale.resilience.driver.slowdown import CpuQuota, cpu_quota_available, cpu_rates, tree


def _step(status: dict) -> int:
    return max(
        (r.get("step") or 0 for n in status["nodes"].values() if n["role"] == "active" for r in n["ranks"]), default=0
    )


def _wait(job: Soak, predicate, poll_s: float = 0.2) -> dict:
    while True:
        status = job.status()
        if predicate(status):
            return status
        if job.proc.poll() is not None:
            raise RuntimeError(f"driver exited with {job.proc.returncode}; see {job.run_dir.parent}")
        time.sleep(poll_s)


def run(name: str, work: Path, args: argparse.Namespace, action: str, slow: bool, fault: str = "") -> dict:
    steps = args.steps if slow else args.jitter_steps
    extra = [
        *MODEL,
        f"--train.steps={steps}",
        "--checkpoint.every=100",
        "--checkpoint.peer_every=5",
        "--resilience.hang_floor_s=10",
        "--resilience.heartbeat_timeout_s=5",
        "--resilience.restart_budget=5",
        f"--resilience.straggler_action={action}",
        f"--resilience.straggler_window_steps={args.window_steps}",
        f"--resilience.straggler_windows={args.windows}",
    ]
    if fault:
        os.environ["MEGASCALE_FAULT"] = fault
    try:
        job = Soak(work / name, extra, nodes=2, ranks=2, spares=2)
    finally:
        os.environ.pop("MEGASCALE_FAULT", None)
    out: dict = {"run": name, "action": action, "steps": steps}
    quota = None
    try:
        status = _wait(job, lambda s: s["phase"] == "running" and _step(s) >= (args.slow_at if slow else 1))
        start, start_step = time.time(), _step(status)
        if slow:
            victim = next(n for n, v in status["nodes"].items() if v["role"] == "active" and v["slot"] == 1)
            ranks = tree(status["nodes"][victim]["pid"])[1:]
            used = sum(cpu_rates(ranks, 1.0))
            quota = CpuQuota(f"megascale-failslow-bench-{os.getpid()}", cores=used / 2)
            quota.add(ranks)
            start, start_step = time.time(), _step(job.status())
            out.update(victim=victim, victim_cpu_cores=used, quota_cores=used / 2)
        end_status = _wait(job, lambda s: _step(s) >= steps or s["phase"] in ("complete", "failed"))
        end = time.time()
        job.proc.wait(300)
    finally:
        if quota is not None:
            quota.close()
    summary = json.loads((job.run_dir / "resilience" / "summary.json").read_text())
    tokens = (steps - start_step) * 8 * 64  # global_batch x seq_len of MODEL
    named = [d for d in summary["stragglers"] if d["kind"] == "straggler"]
    out.update(
        phase=summary["phase"],
        from_step=start_step,
        wall_s=end - start,
        tokens_per_s=tokens / (end - start),
        ettr=summary["ettr"]["ettr"],
        restarts=summary["restarts"],
        evicted=summary["evicted"],
        detections=summary["stragglers"],
        last_step_seen=_step(end_status),
    )
    if slow and named:
        first = named[0]
        out.update(
            detection_s=first["time"] - start,
            detection_steps=first["step"] - start_step,
            named_by_window_end=first["steps"][1] - start_step,
            measured_ratio=first["ratio"],
        )
        recovery = next((f for f in summary["faults"] if f["kind"] == "straggler"), None)
        out["recovery_s"] = recovery.get("recovery_s") if recovery else None
    if slow:
        out["measured_ratio_timers"] = _timer_ratio(
            job.run_dir, [2, 3], start_step, first_step_after=None if not named else named[0]["step"]
        )
        out["false_positives"] = [d for d in named if d["node"] != out["victim"]]
    else:
        out["false_positives"] = summary["stragglers"]
    print(json.dumps({k: v for k, v in out.items() if k != "detections"}), flush=True)
    return out


def _timer_ratio(run_dir: Path, slowed: list[int], from_step: int, first_step_after: int | None) -> float | None:
    """Median over steps of the slowed ranks' compute (timers' compute + optimizer self time) over
    the other ranks', from the slowdown to its detection (or the end): what the ranks really got."""
    per: dict[int, dict[int, float]] = {}
    for path in (run_dir / "timers").glob("rank*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if (
                rec.get("kind") in ("compute", "optimizer")
                and rec["step"] > from_step
                and (first_step_after is None or rec["step"] <= first_step_after)
            ):
                per.setdefault(rec["step"], {}).setdefault(rec["rank"], 0.0)
                per[rec["step"]][rec["rank"]] += rec["self"]
    ratios = []
    for ranks in per.values():
        slow = [v for r, v in ranks.items() if r in slowed]
        rest = [v for r, v in ranks.items() if r not in slowed]
        if slow and rest and statistics.median(rest) > 0:
            ratios.append(statistics.median(slow) / statistics.median(rest))
    return statistics.median(ratios) if ratios else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--slow-at", type=int, default=15)
    parser.add_argument("--window-steps", type=int, default=4)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--jitter-steps", type=int, default=200)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "fail_slow.json"))
    args = parser.parse_args()
    if why := cpu_quota_available():
        raise SystemExit(f"fail_slow: {why}")
    work = Path(tempfile.mkdtemp(prefix="megascale-failslow-"))
    load = [os.getloadavg()[0]]
    on = run("on", work, args, "replace", slow=True)
    load.append(os.getloadavg()[0])
    off = run("off", work, args, "off", slow=True)
    load.append(os.getloadavg()[0])
    jitter = run(
        "jitter",
        work,
        args,
        "replace",
        slow=False,
        fault=";".join(f"jitter:rank={r}:step=1:frac=0.2" for r in range(4)),
    )
    load.append(os.getloadavg()[0])
    result = {
        "machine": f"{os.cpu_count()} cores, shared with other jobs (loaded); load average at each run's "
        f"start and the end: {[round(x, 1) for x in load]}",
        "config": vars(args),
        "on": on,
        "off": off,
        "jitter": jitter,
        "throughput_on_over_off": on["tokens_per_s"] / off["tokens_per_s"],
        "ettr": {"on": on["ettr"], "off": off["ettr"]},
        "false_positives": len(on["false_positives"]) + len(jitter["false_positives"]),
        "goals": {"throughput_on_over_off": ">= 1.6", "false_positives": 0},
        "work_dir": str(work),
    }
    Path(args.out).write_text(json.dumps(result, indent=2, default=str) + "\n")
    shown = ("throughput_on_over_off", "ettr", "false_positives", "machine")
    print(json.dumps({k: result[k] for k in shown}, indent=2))


if __name__ == "__main__":
    main()
