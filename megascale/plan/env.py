"""Environment a cluster run should set so that a flapping link slows it down instead of killing it.

MegaScale ("network performance tuning": retransmit timeouts) saw NIC links flap for seconds;
with default timeouts the collectives failed and the whole job restarted. The remedy is layered:
RDMA retransmits long enough to ride out a flap, a collective timeout longer than the worst
retransmit sequence (but short enough to catch a real hang), and the Flight Recorder on, so a
collective that does time out says which operation every rank was in. Each setting carries the
reason it is there; docs/planning.md ("Communication settings") explains the arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megascale.diagnostics.watchdog import FLIGHT_RECORDER_ENTRIES

IB_TIMEOUT_EXPONENT = 22  # verbs local ACK timeout = 4.096 us * 2**n: ~17 s per attempt
IB_RETRY_COUNT = 7  # the largest value the 3-bit verbs retry field holds
MIN_COLLECTIVE_TIMEOUT_S = 600.0  # never tighter than the config's default
STEPS_OF_SLACK = 20  # a collective may wait this many predicted step times before it is a hang
FLIGHT_RECORDER_VARS = (
    "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "TORCH_FR_BUFFER_SIZE",
    "TORCH_NCCL_DUMP_ON_TIMEOUT",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
)


@dataclass(frozen=True)
class EnvSetting:
    name: str
    value: str
    why: str


def rdma_ride_out_s() -> float:
    """Worst time a queue pair keeps retrying before it reports an error."""
    return 4.096e-6 * 2**IB_TIMEOUT_EXPONENT * IB_RETRY_COUNT


def collective_timeout_s(step_time_s: float | None) -> float:
    """Long enough for a full RDMA retry sequence (twice) and for slow steps, never < 600 s."""
    slow_steps = STEPS_OF_SLACK * (step_time_s or 0.0)
    return max(MIN_COLLECTIVE_TIMEOUT_S, 2 * rdma_ride_out_s(), slow_steps)


def communication_env(
    step_time_s: float | None = None, dump_dir: str = "runs/default/flight_recorder"
) -> list[EnvSetting]:
    timeout = collective_timeout_s(step_time_s)
    ride = rdma_ride_out_s()
    return [
        EnvSetting(
            "NCCL_IB_TIMEOUT",
            str(IB_TIMEOUT_EXPONENT),
            f"RDMA ACK timeout 4.096us*2^{IB_TIMEOUT_EXPONENT} = "
            f"{4.096e-6 * 2**IB_TIMEOUT_EXPONENT:.0f} s per retry: a NIC flap of "
            "seconds is retransmitted over instead of failing the queue pair",
        ),
        EnvSetting(
            "NCCL_IB_RETRY_CNT",
            str(IB_RETRY_COUNT),
            f"retry the maximum number of times: {ride:.0f} s of ride-out in total",
        ),
        EnvSetting(
            "TORCH_NCCL_ASYNC_ERROR_HANDLING",
            "1",
            "abort the communicator and exit on a timeout or NCCL error, so the "
            "executor sees a dead rank and the driver restarts from a checkpoint",
        ),
        EnvSetting(
            "TORCH_NCCL_BLOCKING_WAIT", "0", "the watchdog enforces the timeout; ranks keep overlapping communication"
        ),
        EnvSetting(
            "MEGASCALE_COLLECTIVE_TIMEOUT_S",
            f"{timeout:.0f}",
            "pass as --parallel.collective_timeout_s: longer than two RDMA ride-outs "
            f"({2 * ride:.0f} s) and {STEPS_OF_SLACK} predicted steps, so a flap is "
            "survived and a real hang is still caught",
        ),
        EnvSetting(
            "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC",
            f"{timeout + 120:.0f}",
            "the watchdog's own heartbeat must outlast the collective timeout, or it "
            "kills the rank before the timeout can be reported",
        ),
        EnvSetting(
            "TORCH_NCCL_TRACE_BUFFER_SIZE",
            str(FLIGHT_RECORDER_ENTRIES),
            "Flight Recorder on for NCCL: the last collectives of every rank are kept",
        ),
        EnvSetting(
            "TORCH_FR_BUFFER_SIZE",
            str(FLIGHT_RECORDER_ENTRIES),
            "Flight Recorder on for gloo and NCCL (newer PyTorch name)",
        ),
        EnvSetting(
            "TORCH_NCCL_DUMP_ON_TIMEOUT", "1", "on a timeout every rank dumps its Flight Recorder for the hang analyser"
        ),
        EnvSetting(
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
            f"{dump_dir}/rank_",
            "where the dumps go (one file per rank), next to the run's other records",
        ),
        EnvSetting("NCCL_DEBUG", "WARN", "NCCL's warnings reach the executor's log filter"),
    ]


def format_env(settings: list[EnvSetting]) -> str:
    return "\n".join(f"export {s.name}={s.value}  # {s.why}" for s in settings)


def launch_env(run_dir: str | Path, flight_recorder: bool = True) -> dict[str, str]:
    """What the launchers hand every rank: the settings above, the Flight Recorder ones only when
    the job records collectives (the collective timeout is a config key, not a variable)."""
    settings = communication_env(None, dump_dir=str(Path(run_dir) / "flight_recorder"))
    return {
        s.name: s.value
        for s in settings
        if s.name != "MEGASCALE_COLLECTIVE_TIMEOUT_S" and (flight_recorder or s.name not in FLIGHT_RECORDER_VARS)
    }


def with_defaults(env: dict[str, str], defaults: dict[str, str]) -> dict[str, str]:
    """`env` plus every default it does not set itself: a node's own settings win."""
    return {**defaults, **env}


def format_applied(env: dict[str, str]) -> str:
    return "communication env: " + " ".join(f"{k}={v}" for k, v in sorted(env.items()))
