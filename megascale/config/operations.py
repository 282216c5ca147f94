"""The sections that run a job rather than define its mathematics: checkpoints, diagnostics
and the fault-tolerant driver."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from megascale.config.fields import ConfigError, at_least, opt, positive


@dataclass
class CheckpointConfig:
    """Two-stage checkpoints: where, how often, how many, and resume."""

    dir: str = opt("", '"" = <run_dir>/checkpoints; any fsspec URL is accepted')
    every: int = opt(100, "save every N steps; 0 disables periodic saves")
    keep: int = opt(3, "valid checkpoints kept")
    resume: str = opt("auto", "auto (the newest valid one), none, or a checkpoint path")
    init_from: str = opt(
        "",
        "weights only, fresh optimizer: a Hugging Face checkpoint directory (megascale "
        "import); read when there is no checkpoint to resume from",
    )
    async_save: bool = opt(True, "stage 2 (persisting) in a background writer while training goes on")
    when_busy: Literal["wait", "skip"] = opt(
        "wait", "a save due while the previous one is still writing: wait, or skip it"
    )
    write_mb_per_s: float = opt(0.0, "cap on stage-2 write bandwidth per rank; 0 = unlimited")
    commit_timeout_s: float = opt(600.0, "rank 0 gives up on a save whose other ranks never finish")
    save_on_signal: bool = opt(True, "SIGTERM/Ctrl-C: every rank stops after the same step and saves")
    fsync: bool = opt(True, "sync files and directories around each commit (false: scratch storage only)")
    peer_every: int = opt(
        10,
        "steps between copies of each rank's state into a peer node's memory, used to "
        "recover under megascale launch (0 = no copies)",
    )
    peer_stride: int = opt(
        1,
        "a node's copies go to the node this many places on along the ring; at scale, the "
        "nodes behind one switch, so that one switch failure never takes a rank and its copy",
    )

    def validate(self) -> None:
        if self.every < 0 or self.keep < 1:
            raise ConfigError(f"checkpoint.every must be >= 0 and checkpoint.keep >= 1, got {self.every}, {self.keep}")
        if self.write_mb_per_s < 0:
            raise ConfigError(f"checkpoint.write_mb_per_s must be >= 0, got {self.write_mb_per_s}")
        if self.commit_timeout_s <= 0:
            raise ConfigError(f"checkpoint.commit_timeout_s must be > 0, got {self.commit_timeout_s}")
        if self.peer_every < 0:
            raise ConfigError(f"checkpoint.peer_every must be >= 0 (0 = no peer copies), got {self.peer_every}")
        if self.peer_stride < 1:
            raise ConfigError(f"checkpoint.peer_stride must be >= 1 (nodes along the ring), got {self.peer_stride}")


def checkpoint_root(ck: CheckpointConfig, run_dir: str | Path) -> str:
    """Where a run's checkpoints are: `checkpoint.dir`, else <run_dir>/checkpoints made absolute
    (the one place this default is spelled out: the trainer writes there, the launcher reads it)."""
    return ck.dir or str((Path(run_dir) / "checkpoints").resolve())


@dataclass
class DiagnosticsConfig:
    """Always-on timers, hang dumps, the Flight Recorder and straggler detection."""

    timers: bool = opt(True, "always-on per-rank timers (compute apart from communication waits)")
    hang_timeout_s: float = opt(300.0, "a rank stuck this long dumps where it is (hang analysis)")
    flight_recorder: bool = opt(True, "PyTorch's Flight Recorder of collectives (feeds hang analysis)")
    straggler_threshold: float = opt(1.10, "a rank slower than its peers' median by this factor ...")
    straggler_min_fraction: float = opt(0.5, "... in at least this share of the analysed steps is a straggler")
    straggler_warmup_steps: int = opt(1, "first steps left out of straggler statistics")

    def validate(self) -> None:
        if self.hang_timeout_s <= 0 or self.straggler_threshold <= 1:
            raise ConfigError("diagnostics.hang_timeout_s must be > 0 and diagnostics.straggler_threshold > 1")
        if not 0 < self.straggler_min_fraction <= 1:
            raise ConfigError(
                f"diagnostics.straggler_min_fraction must be in (0, 1], got {self.straggler_min_fraction}"
            )
        if self.straggler_warmup_steps < 0:
            raise ConfigError(f"diagnostics.straggler_warmup_steps must be >= 0, got {self.straggler_warmup_steps}")


@dataclass
class ResilienceConfig:
    """The fault-tolerant driver (`megascale launch`) and its executors."""

    heartbeat_s: float = opt(1.0, "executor -> driver heartbeat period")
    heartbeat_timeout_s: float = opt(5.0, "no heartbeat for this long: the node is lost")
    silence_fraction: float = opt(
        0.5,
        "this share of the nodes (and at least 2) silent at once is the driver's "
        "or the network's stall: nobody is judged lost, the driver waits",
    )
    startup_timeout_s: float = opt(120.0, "start -> first step; covers a slow first step")
    hang_floor_s: float = opt(10.0, "no step progress for max(floor, factor * max step time): hang")
    hang_factor: float = opt(5.0, "see hang_floor_s")
    warmup_steps: int = opt(2, "steps before the hang window and the slowdown baseline are learned")
    slow_factor: float = opt(3.0, "recent step time above factor x baseline: a slowdown alert")
    traffic_window_s: float = opt(5.0, "traffic at zero this long while ranks run: a fault")
    traffic_fall_ratio: float = opt(0.2, "traffic below ratio x its baseline: an alert")
    traffic_interfaces: list[str] = opt(factory=list, doc="network interfaces watched; [] = every interface but lo")
    error_keywords: list[str] = opt(
        doc="log lines containing any of these are faults",
        factory=lambda: [
            "Traceback (most recent call last)",
            "CUDA error",
            "NCCL error",
            "ncclInternalError",
            "Segmentation fault",
            "illegal memory access",
            "uncorrectable ECC",
        ],
    )
    restart_budget: int = opt(10, "restarts allowed over the whole job")
    max_node_faults: int = opt(2, "faults blamed on one node before it is evicted anyway")
    spares: int = opt(0, "spare nodes that replace evicted ones")
    spare_pool: int = opt(
        4,
        "node ids admitted beyond nodes + spares over the job's life (replacement "
        "nodes); any further new id is refused",
    )
    shrink: Literal["keep-batch", "divide"] = opt(
        "keep-batch",
        "fewer nodes and no spare: keep-batch (the largest dp that fits; replicas take uneven "
        "micro-batch counts, the global batch and the optimizer's trajectory stay) or divide "
        "(the largest dp dividing the batch: more nodes idle)",
    )
    roster: str = opt(
        "",
        'the node ids a cluster job expects, each bound to its host: "file:PATH", one '
        "`NODE_ID [HOST]` a line (HOST defaults to the id); a listed id registers only from "
        "its host, another only as a name resolving to where it connects from, at most "
        'spare_pool of them; "" = any id within nodes + spares + spare_pool (trust on first use)',
    )
    peer_address_check: bool = opt(
        True,
        "a registration's address must be the one it connects to the driver "
        "from; off behind NAT, or when executors get an --address the driver "
        "does not see them from",
    )
    max_step_rate: float = opt(
        1000.0,
        "a rank's reported step may advance at most this many steps per "
        "second since it last advanced (or since the job started); more is refused",
    )
    stop_timeout_s: float = opt(20.0, "how long ranks get to stop before they are killed")
    selfcheck_timeout_s: float = opt(60.0, "limit on the self-check diagnostics after a fault")
    selfcheck_expected: str = opt(
        "", 'JSON file of floors and per-hardware baselines (megascale selfcheck --measure); "" = built-in floors only'
    )
    selfcheck_min_ratio: float = opt(
        0.7,
        "a self-check figure below this share of the median of the nodes "
        "checked with it (or of its hardware's baseline) fails",
    )
    api_host: str = opt("127.0.0.1", "the driver's API address (127.0.0.1 unless executors run elsewhere)")
    api_port: int = opt(0, "0 = any free port (written to the state dir)")
    api_request_timeout_s: float = opt(10.0, "a client's TLS handshake, and each request, must finish within this")
    secret_dir: str = opt(
        "", 'join and operator tokens + TLS certificate and key; "" = <run_dir>/resilience/secret, made if missing'
    )
    rendezvous_port: int = opt(0, "0 = a free port per attempt; else base + attempt")
    in_place: bool = opt(
        True,
        "recover by replacing only the failed ranks (the healthy ones stay alive, state "
        "from peer memory); false: every fault restarts every rank",
    )
    standby: int = opt(
        1, "warm rank processes (torch imported) an active node keeps for replacements; spares keep one per rank"
    )
    straggler_action: Literal["replace", "alert", "off"] = opt(
        "replace",
        "a node whose ranks compute slower than their peers: replace it with a spare in place "
        "(at most max_evictions_per_hour, never the last spare), only alert, or do not look",
    )
    straggler_threshold: float = opt(
        1.3,
        "a rank whose median compute time per step exceeds its peers' "
        "median by this factor in a window is slow in that window",
    )
    straggler_window_steps: int = opt(
        8, "steps per window: each rank's compute times reduce to one median/MAD summary per window"
    )
    straggler_windows: int = opt(2, "consecutive slow windows before a node is named (and acted on)")
    max_evictions_per_hour: int = opt(2, "stragglers replaced per hour at most; beyond, only an alert")

    def validate(self) -> None:
        periods = ("heartbeat_s", "heartbeat_timeout_s", "startup_timeout_s", "hang_floor_s", "traffic_window_s")
        timeouts = ("stop_timeout_s", "selfcheck_timeout_s", "api_request_timeout_s")
        at_least(self, "resilience", periods + timeouts, 0, strict=True)
        if self.heartbeat_timeout_s <= self.heartbeat_s:
            raise ConfigError(
                f"resilience.heartbeat_timeout_s={self.heartbeat_timeout_s} must exceed "
                f"resilience.heartbeat_s={self.heartbeat_s}"
            )
        if self.hang_factor < 1 or self.slow_factor <= 1:
            raise ConfigError("resilience.hang_factor must be >= 1 and resilience.slow_factor > 1")
        _share("silence_fraction", self.silence_fraction, one_allowed=True)
        _share("traffic_fall_ratio", self.traffic_fall_ratio, one_allowed=False)
        self._validate_fail_slow()
        at_least(self, "resilience", ["max_step_rate"], 0, strict=True)
        counts = ("warmup_steps", "restart_budget", "spares", "spare_pool", "standby", "max_evictions_per_hour")
        at_least(self, "resilience", counts, 0)
        positive(self, "resilience", ["max_node_faults"])
        for key in ("api_port", "rendezvous_port"):
            if not 0 <= getattr(self, key) < 65536:
                raise ConfigError(f"resilience.{key} must be a port in [0, 65535]")

    def _validate_fail_slow(self) -> None:
        _share("selfcheck_min_ratio", self.selfcheck_min_ratio, one_allowed=False)
        if self.straggler_threshold <= 1:
            raise ConfigError(
                f"resilience.straggler_threshold must be > 1 (a factor over the peers' median), "
                f"got {self.straggler_threshold}"
            )
        for key in ("straggler_window_steps", "straggler_windows"):
            if getattr(self, key) < 1:
                raise ConfigError(f"resilience.{key} must be >= 1, got {getattr(self, key)}")


def _share(key: str, value: float, one_allowed: bool) -> None:
    """A share of something: in (0, 1], or (0, 1) when 1 would make the rule meaningless."""
    if not (0 < value <= 1 if one_allowed else 0 < value < 1):
        raise ConfigError(f"resilience.{key} must be in (0, 1{']' if one_allowed else ')'}, got {value}")
