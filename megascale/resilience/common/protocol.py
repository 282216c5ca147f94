"""The messages between driver, executors and operators, as schemas checked on receipt.

Both ends validate what they receive (pydantic, strict: no "1" for 1, no NaN, no unknown keys,
bounded sizes), so a malformed or hostile message is refused with its first defect named and
never reaches the control loop. Names are limited to characters that are safe in logs and
commands; free text (log lines, reasons) is bounded.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, TypeAdapter, ValidationError

from megascale.config.schema import REDIS_PASSWORD_FILE_ENV
from megascale.plan.env import communication_env
from megascale.resilience.common.rankstatus import STATUS_DIR_ENV

Name = Annotated[str, StringConstraints(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.:%@-]*$")]
Text = Annotated[str, StringConstraints(max_length=4096)]
COMMAND_ID = r"^[a-z]+-[0-9a-f]{6,32}$"
CommandId = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=COMMAND_ID)]
Count = Annotated[int, Field(ge=0, le=2**62)]
Signed = Annotated[int, Field(ge=-(2**31), le=2**62)]
Seconds = Annotated[float, Field(ge=0.0)]
Port = Annotated[int, Field(ge=0, le=65535)]
# What a driver may set in a rank's environment; anything else in a `start` is refused (a
# variable such as LD_PRELOAD or NCCL_NET_PLUGIN would run code of the sender's choosing).
RANK_ENV = ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "MEGASCALE_JOB_ID", "MEGASCALE_RESTART_ATTEMPT")
PLAN_ENV = tuple(setting.name for setting in communication_env())  # defaults under the node's own
MAX_ERROR_LINES = 64


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


# ---------------------------------------------------------------------- executor -> driver
class Register(Message):
    node_id: Name
    address: Name
    host: Name
    pid: Count | None = None


class Gpu(Message):
    index: Count
    name: Text
    memory: Count


class Hardware(Message):
    cpus: Count | None = None
    cpu_percent: Annotated[float, Field(ge=0.0, le=1e6)] = 0.0
    mem_total: Count = 0
    mem_used: Count = 0
    gpus: Annotated[list[Gpu], Field(max_length=64)] = []


class RankStart(Message):
    """When a rank joined its attempt's mesh and had its state back, and from where."""

    joined_at: Seconds | None = None
    restored_at: Seconds | None = None
    source: Literal["memory", "storage", "none"] | None = None
    step: Count | None = None


class RankReport(Message):
    rank: Count
    local_rank: Count
    pid: Count
    alive: bool
    exitcode: Signed | None = None
    exited_at: Seconds | None = None  # the executor's clock when it saw the rank end
    step: Count | None = None
    step_time: Seconds | None = None
    recent: Annotated[list[tuple[Count, Seconds]], Field(max_length=64)] = []
    compute: Annotated[list[tuple[Count, Seconds]], Field(max_length=64)] = []  # (step, compute s)
    status_time: Seconds | None = None
    phase: Literal["training", "paused"] | None = None  # what the rank says it does
    state: Name | None = None  # the process's state as the kernel reports it (running, stopped, ...)
    start: RankStart | None = None


class ErrorLine(Message):
    rank: Count
    text: Text


class SelfcheckTest(Message):
    name: Name
    value: float = 0.0
    unit: Text = ""
    expected: float = 0.0
    passed: bool = False
    peer: Name | None = None
    backend: Literal["gloo", "nccl"] | None = None  # of a pair test
    error: Text | None = None
    baseline: float | None = None  # the healthy figure recorded for the node's hardware type


class SelfcheckReport(Message):
    node: Name
    host: Name
    pid: Count
    hardware: Text = ""  # what its figures may be compared with (selfcheck.hardware_type)
    passed: bool
    failed: Annotated[list[Text], Field(max_length=256)] = []
    tests: Annotated[list[SelfcheckTest], Field(max_length=256)] = []


class CommandResult(Message):
    ok: bool
    error: Annotated[str, StringConstraints(max_length=8192)] | None = None
    pids: Annotated[list[Count], Field(max_length=1024)] | None = None
    stopped: Count | None = None
    report: SelfcheckReport | None = None
    paused: Annotated[list[Count], Field(max_length=1024)] | None = None  # ranks alive and waiting (pause)
    dead: Annotated[list[Count], Field(max_length=1024)] | None = None  # ranks gone or killed (pause)


class Heartbeat(Message):
    node_id: Name
    seq: Count = 0
    time: Seconds = 0.0
    address: Name | None = None
    host: Name | None = None
    hardware: Hardware = Hardware()
    attempt: Count | None = None
    ranks: Annotated[list[RankReport], Field(max_length=1024)] = []
    errors: Annotated[list[ErrorLine], Field(max_length=MAX_ERROR_LINES)] = []
    net: Annotated[
        dict[Annotated[str, StringConstraints(max_length=64)], tuple[Count, Count]], Field(max_length=512)
    ] = {}
    net_shared: bool = False
    done: Annotated[dict[CommandId, CommandResult], Field(max_length=64)] = {}
    busy: CommandId | None = None


# ---------------------------------------------------------------------- operator -> driver
class Evict(Message):
    node_id: Name
    reason: Text | None = None


class Stop(Message):
    reason: Text | None = None


# ---------------------------------------------------------------------- driver -> executor
Standby = Annotated[int, Field(ge=0, le=64)]  # warm rank processes the node keeps


class RegisterReply(Message):
    model_config = ConfigDict(extra="ignore")  # a newer driver may say more
    role: Name
    keywords: Annotated[list[Text], Field(max_length=256)] = []
    heartbeat_s: Annotated[float, Field(gt=0.0, le=600.0)] = 1.0
    standby: Standby = 0
    credential: Annotated[str, StringConstraints(min_length=1, max_length=1024)] | None = None  # the node's own


class PairPlan(Message):
    round: Count
    peer: Name
    role: Literal[0, 1]
    master: Name
    port: Port


class SelfcheckPlan(Message):
    ranks: Annotated[int, Field(ge=1, le=1024)] = 1
    expected_file: Annotated[str, StringConstraints(max_length=4096)] = ""
    min_ratio: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.7
    pair_timeout_s: Annotated[float, Field(gt=0.0, le=3600.0)] = 15.0
    pairs: Annotated[list[PairPlan], Field(max_length=64)] = []


class StartCommand(Message):
    id: CommandId
    kind: Literal["start"]
    attempt: Count
    ranks: Annotated[list[Count], Field(min_length=1, max_length=1024)]
    env: dict[Literal[RANK_ENV], Annotated[str, StringConstraints(max_length=253)]]
    plan_env: dict[Literal[PLAN_ENV], Annotated[str, StringConstraints(max_length=4096)]] = {}
    config: Annotated[str, StringConstraints(max_length=1 << 20)]  # the rank's TOML, no secret in it
    redis_password: Annotated[str, StringConstraints(max_length=4096)] | None = None
    keep: Annotated[list[Count], Field(max_length=1024)] = []  # paused ranks that rejoin (the fast path)


class PauseCommand(Message):
    """The fast path's stop: kill `kill`, tell the node's other ranks to drop their process groups
    and wait for the new attempt (their state stays in memory)."""

    id: CommandId
    kind: Literal["pause"]
    attempt: Count
    kill: Annotated[list[Count], Field(max_length=1024)] = []
    timeout_s: Annotated[float, Field(gt=0.0, le=3600.0)] = 20.0


class SelfcheckCommand(Message):
    id: CommandId
    kind: Literal["selfcheck"]
    plan: SelfcheckPlan
    timeout_s: Annotated[float, Field(gt=0.0, le=3600.0)] = 120.0


class StopCommand(Message):
    id: CommandId
    kind: Literal["stop", "exit"]


Command = Annotated[StartCommand | PauseCommand | SelfcheckCommand | StopCommand, Field(discriminator="kind")]
COMMAND = TypeAdapter(Command)


class HeartbeatReply(BaseModel):
    model_config = ConfigDict(extra="ignore")
    commands: Annotated[list[dict[str, Any]], Field(max_length=256)] = []  # checked one by one
    ack: Annotated[list[CommandId], Field(max_length=1024)] = []
    standby: Standby | None = None
    heartbeat_s: Annotated[float, Field(gt=0.0, le=600.0)] | None = None  # faster while a recovery runs


# ---------------------------------------------------------------------- executor -> its rank (the rank's stdin)
# What an executor may put in a rank's environment: what a driver's `start` may set, plus the
# rank's place on the node and the private files the executor made for it.
PIPE_ENV = (*RANK_ENV, *PLAN_ENV, "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", STATUS_DIR_ENV, REDIS_PASSWORD_FILE_ENV)
PipeEnv = dict[Literal[PIPE_ENV], Annotated[str, StringConstraints(max_length=4096)]]
FilePath = Annotated[str, StringConstraints(min_length=1, max_length=4096)]


class Assign(Message):
    """A standby process becomes a rank: its config file, environment and log."""

    kind: Literal["assign"]
    config: FilePath
    env: PipeEnv
    log: FilePath


class Rejoin(Message):
    """A paused rank joins the next attempt (same rank, new rendezvous)."""

    kind: Literal["rejoin"]
    config: FilePath
    env: PipeEnv


class Abort(Message):
    """Drop the process groups now (a peer failed) and wait for `rejoin`."""

    kind: Literal["abort"]


RANK_MESSAGE = TypeAdapter(Annotated[Assign | Rejoin | Abort, Field(discriminator="kind")])


def first_error(exc: ValidationError) -> str:
    """`ranks.0.step: Input should be ...`: the first defect, short enough for a log line."""
    err = exc.errors(include_url=False)[0]
    # a key is client data: escaped so that it cannot forge a line in the driver's log
    where = log_safe(".".join(str(part)[:64] for part in err["loc"])) or "body"
    more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{where}: {err['msg']}{more}"


def log_safe(text: str) -> str:
    """Client text as one log line: control characters (newlines, CR, ESC), backslashes and
    Unicode line separators escaped, so that a reason or key cannot forge a line of the log."""
    return "".join(c if c.isprintable() and c != "\\" else c.encode("unicode_escape").decode() for c in text)
