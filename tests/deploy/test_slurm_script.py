"""deploy/slurm/megascale.sbatch run by bash with stand-in `scontrol`, `srun` and `megascale`.

The stand-ins are small programs on PATH that log what they were asked to do. `scontrol` writes
the expanded node list the way a C program writes to a pipe (a 4096-byte stdio buffer at a
time) and, like the real one asking slurmctld, no faster than its reader takes it: a reader
that leaves early kills it with SIGPIPE. That is what ended the old script at 2,000 nodes
(`scontrol ... | head -n 1` under pipefail), before any srun.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "slurm" / "megascale.sbatch"

SCONTROL = """
import fcntl, os, re, select, signal, struct, sys, termios
signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # die of it, as a C program does
assert sys.argv[1:3] == ["show", "hostnames"], sys.argv
prefix, first, last = re.fullmatch(r"(\\w+)\\[(\\d+)-(\\d+)\\]", sys.argv[3]).groups()
text = "".join(f"{prefix}{i:0{len(first)}d}\\n" for i in range(int(first), int(last) + 1)).encode()
reader_gone = select.poll()
reader_gone.register(1, 0)  # no events asked: only POLLERR, once the reader has closed its end

def unread() -> int:
    return struct.unpack("i", fcntl.ioctl(1, termios.FIONREAD, b"\\0" * 4))[0]

for start in range(0, len(text), 4096):
    os.write(1, text[start:start + 4096])
    while unread() and not reader_gone.poll(5):
        pass
"""

SRUN = """
import json, os, signal, subprocess, sys
args = sys.argv[1:]
split = next(i for i, arg in enumerate(args) if not arg.startswith("-"))
options, command = args[:split], args[split:]
with open(os.environ["STANDIN_LOG"], "a") as log:
    log.write(json.dumps({"prog": "srun", "options": options, "command": command}) + "\\n")
task = subprocess.Popen(command, env=dict(os.environ, SLURMD_NODENAME=os.environ["STANDIN_FIRST_HOST"]))
signal.signal(signal.SIGTERM, lambda signum, frame: task.send_signal(signum))  # srun passes it on
sys.exit(task.wait())
"""

MEGASCALE = """
import json, os, pathlib, signal, sys, time
ended = pathlib.Path(os.environ["STANDIN_LOG"]).with_name("driver-ended")

def note(event: str) -> None:
    with open(os.environ["STANDIN_LOG"], "a") as log:
        log.write(json.dumps({"prog": "megascale", "event": event, "argv": sys.argv[1:]}) + "\\n")

command = sys.argv[1]
note(command)
if command == "secret":  # the real one: what it writes where is what is checked
    os.execv(sys.executable, [sys.executable, "-m", "megascale.cli", *sys.argv[1:]])
elif command == "launch":  # the driver
    secret_dir = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--resilience.secret_dir="))
    note("driver-secret " + json.dumps({p: open(os.path.join(secret_dir, p)).read() for p in os.listdir(secret_dir)}))
    code = int(os.environ["STANDIN_DRIVER_EXIT"])
    note(f"driver-exit {code}")
    ended.touch()
    sys.exit(code)
elif os.environ.get("STANDIN_EXECUTOR") == "knocks":  # its driver crashed: it never hears `exit`
    signal.signal(signal.SIGTERM, lambda signum, frame: (note("executor-terminated"), sys.exit(143)))
    while True:
        time.sleep(0.05)
else:  # takes its `exit` from the driver, stops its ranks, then leaves (3: as if evicted)
    while not ended.exists():
        time.sleep(0.02)
    time.sleep(0.5)
    note("executor-exit")
    sys.exit(3)
"""


def stand_ins(bin_dir: Path) -> None:
    bin_dir.mkdir()
    for name, body in (("scontrol", SCONTROL), ("srun", SRUN), ("megascale", MEGASCALE)):
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
        path.chmod(0o755)


def run_job(tmp_path: Path, nodes: int, driver_exit: int, executor: str = "obeys") -> tuple[int, str, list[dict]]:
    stand_ins(tmp_path / "bin")
    log = tmp_path / "log.jsonl"
    env = dict(
        os.environ,
        PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
        SLURM_JOB_NAME="megascale",
        SLURM_JOB_NUM_NODES=str(nodes),
        SLURM_JOB_NODELIST=f"gpu[00000-{nodes - 1:05d}]",
        RUN_DIR=str(tmp_path / "run"),
        EXECUTOR_GRACE_S="1",
        STANDIN_LOG=str(log),
        STANDIN_FIRST_HOST="gpu00000",
        STANDIN_DRIVER_EXIT=str(driver_exit),
        STANDIN_EXECUTOR=executor,
        PYTHONPATH=str(SCRIPT.parents[2]),
    )
    env.pop("SLURMD_NODENAME", None)  # the batch host: gpu00000, the list's first
    with (tmp_path / "stderr").open("w") as stderr:  # a file: a pipe would also wait for orphans
        job = subprocess.Popen(
            ["bash", str(SCRIPT), "job.toml", "--train.steps=10"],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
        )
        try:
            code = job.wait(timeout=60)
            events = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        finally:  # whatever the script left behind (the old one left its executors running)
            time.sleep(0.1)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.pid, signal.SIGKILL)
    return code, (tmp_path / "stderr").read_text(), events


@pytest.mark.parametrize("nodes", [2, 2000])
@pytest.mark.parametrize("driver_exit", [0, 7])
def test_the_job_starts_driver_and_executors_waits_for_both_and_ends_with_the_drivers_status(
    tmp_path: Path, nodes: int, driver_exit: int
) -> None:
    code, stderr, events = run_job(tmp_path, nodes, driver_exit)
    sruns = [e for e in events if e["prog"] == "srun"]
    assert len(sruns) == 2, f"the script reached {len(sruns)} of its 2 srun calls; stderr:\n{stderr}"
    driver, executors = sorted(sruns, key=lambda e: e["command"][0] != "megascale")  # they start at once
    assert "--nodelist=gpu00000" in driver["options"]
    assert driver["command"][:7] == ["megascale", "launch", "--external", "--nodes", str(nodes - 1), "--spares", "1"]
    assert f"--resilience.roster=file:{tmp_path}/run/resilience/roster" in driver["command"]
    assert (tmp_path / "run/resilience/roster").read_text().split() == [f"gpu{i:05d}" for i in range(nodes)]
    assert driver["command"][-1] == "--train.steps=10"  # the job's own overrides reach the driver
    assert "--ntasks-per-node=1" in executors["options"] and "--nodelist" not in " ".join(executors["options"])
    started = next(e for e in events if e.get("event") == "executor")
    assert started["argv"] == [
        "executor",
        "--driver",
        "https://gpu00000:29400",
        "--secret-dir",
        f"{tmp_path}/run/resilience/executor-secret",
        "--node-id",
        "gpu00000",
    ]
    _executors_hold_no_driver_secret(tmp_path, driver, events)
    order = [e["event"] for e in events if e["prog"] == "megascale"]
    assert order.index("secret") < order.index("launch")  # the secret exists before anyone needs it
    # The executor ends 0.5 s after the driver: the job waited for it, and kept the driver's status.
    assert order[-1] == "executor-exit" and f"driver-exit {driver_exit}" in order, order
    assert code == driver_exit, stderr


def _executors_hold_no_driver_secret(tmp_path: Path, driver: dict, events: list[dict]) -> None:
    """Before, the secret directory with tls.key and the operator token was on RUN_DIR (the shared
    filesystem) and every executor was given it: any node could act as the operator or make any
    node's credential. Now the executors' directory has the join token and the certificate only,
    the driver's is outside RUN_DIR and gone when the job ends, and no file on RUN_DIR holds the
    operator token or the key."""
    executors = tmp_path / "run/resilience/executor-secret"
    assert sorted(p.name for p in executors.iterdir()) == ["tls.crt", "token"]
    secret = json.loads(
        next(e["event"] for e in events if e.get("event", "").startswith("driver-secret ")).split(" ", 1)[1]
    )
    assert sorted(secret) == ["operator", "tls.crt", "tls.key", "token"]
    assert (executors / "token").read_text() == secret["token"] and (executors / "tls.crt").read_text() == secret[
        "tls.crt"
    ]
    driver_dir = Path(next(a.split("=", 1)[1] for a in driver["command"] if a.startswith("--resilience.secret_dir=")))
    assert tmp_path / "run" not in driver_dir.parents and not driver_dir.exists()
    on_shared = [p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()]
    for part in ("operator", "tls.key"):
        assert not any(secret[part].strip().encode() in data for data in on_shared), part


def test_executors_of_a_crashed_driver_are_stopped_after_the_grace_period(tmp_path: Path) -> None:
    started = time.monotonic()
    code, stderr, events = run_job(tmp_path, nodes=2, driver_exit=1, executor="knocks")
    assert code == 1
    assert [e["event"] for e in events if e["prog"] == "megascale"][-1] == "executor-terminated"
    assert "executors still running 1s after the driver (exit 1); stopping them" in stderr
    assert time.monotonic() - started < 30


def test_too_few_nodes_for_the_spares_is_a_clear_error(tmp_path: Path) -> None:
    code, stderr, events = run_job(tmp_path, nodes=1, driver_exit=0)
    assert code == 2 and not events
    assert "1 node(s) leave none to train after SPARES=1" in stderr
