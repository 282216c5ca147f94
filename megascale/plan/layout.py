"""What the planner is asked about: a workload, a layout of it on GPUs, and how the system runs it.

A `Workload` is the part of a job that does not depend on the cluster (model shape, global
batch, precision, optimizer). A `Layout` is one way to run it (dp, tp, pp, v, micro-batch, ZeRO
stage, recomputation). `Features` say how the training system runs it: each MegaScale overlap on
or off, which operator kernels, the system's measured or fitted `Implementation` constants, and
which second-order `Effects` are modelled, so the cost model can answer "what does this buy?".
Layout validity reuses the job config's own checks, so the planner never proposes a layout
`megascale train` would reject.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from megascale.config.fields import ConfigError
from megascale.config.schema import JobConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from megascale.layout.grid import RankGrid
from megascale.plan.stragglers import Jitter

Recompute = Literal["none", "selective", "full"]
Schedule = Literal["1f1b", "zb-h1", "zbv"]  # parallel.schedule (1f1b: interleaved when v > 1)
Attention = Literal["flash2", "flash1", "unfused"]


@dataclass(frozen=True)
class Workload:
    model: ModelConfig
    global_batch: int  # sequences per optimizer step
    dtype: str = "bf16"  # compute dtype; "bf16" means mixed precision with fp32 master weights
    optimizer: str = "lamb"

    @classmethod
    def from_job(cls, cfg: JobConfig, global_batch: int | None = None) -> Workload:
        return cls(
            model=cfg.model,
            global_batch=global_batch or cfg.train.global_batch,
            dtype=cfg.train.dtype,
            optimizer=cfg.optim.name,
        )

    @property
    def mixed_precision(self) -> bool:
        return self.dtype != "fp32"

    @property
    def act_bytes(self) -> int:
        """Bytes per element of activations and of the communicated tensors."""
        return 2 if self.mixed_precision else 4

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.model.seq_len

    def with_model(self, **changes: Any) -> Workload:
        return replace(self, model=replace(self.model, **changes))


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int = 1
    pp: int = 1
    v: int = 1  # virtual pipeline chunks per stage (interleaved 1F1B when > 1)
    micro_batch: int = 1
    zero: int = 2  # 0: DDP, 1: optimizer sharded, 2: + gradients (MegaScale), 3: + parameters
    recompute: Recompute = "none"
    cp: int = 1  # context parallelism: each sequence split along its length over cp ranks
    ep: int = 1  # expert parallelism, carved from dp (MoE models only)
    schedule: Schedule = "1f1b"  # zb-h1 (v = 1) and zbv (v = 2): zero-bubble, split backward

    @classmethod
    def from_job(cls, cfg: JobConfig) -> Layout:
        """The layout a job as configured runs (overrides() is the way back)."""
        p = cfg.parallel
        return cls(
            dp=p.dp,
            tp=p.tp,
            pp=p.pp,
            v=p.vpp,
            micro_batch=cfg.train.micro_batch,
            zero=2,  # megascale runs ZeRO-2 at every dp: at dp = 1 it still holds the fp32 masters
            recompute=cfg.train.recompute,
            cp=p.cp,
            ep=p.ep,
            schedule="1f1b" if p.schedule == "gpipe" else p.schedule,
        )

    @property
    def world(self) -> int:
        return RankGrid.of(self).world_size

    def micro_batches(self, global_batch: int) -> int:
        return global_batch // (self.dp * self.micro_batch)

    def label(self) -> str:
        return (
            f"dp={self.dp} tp={self.tp} pp={self.pp} v={self.v} mb={self.micro_batch} "
            f"zero={self.zero} rc={self.recompute}{f' cp={self.cp}' if self.cp > 1 else ''}"
            + (f" ep={self.ep}" if self.ep > 1 else "")
            + ("" if self.schedule == "1f1b" else f" {self.schedule}")
        )

    def overrides(self) -> list[str]:
        """The `--section.key=value` overrides that run this layout with `megascale train`."""
        return [
            f"--parallel.dp={self.dp}",
            f"--parallel.tp={self.tp}",
            f"--parallel.pp={self.pp}",
            f"--parallel.vpp={self.v}",
            f"--train.micro_batch={self.micro_batch}",
            f"--train.recompute={self.recompute}",
            *([f"--parallel.cp={self.cp}"] if self.cp > 1 else []),
            *([f"--parallel.ep={self.ep}"] if self.ep > 1 else []),
            *([f"--parallel.schedule={self.schedule}"] if self.schedule != "1f1b" else []),
        ]

    def check(self, work: Workload, gpus_per_node: int | None = None) -> None:
        """Raise ConfigError (naming the key) if the trainer could not run this layout."""
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"zero stage must be 0-3, got {self.zero}")
        if gpus_per_node is not None and (self.tp > gpus_per_node or gpus_per_node % self.tp):
            raise ConfigError(
                f"parallel.tp={self.tp} must divide the {gpus_per_node} GPUs of a node "
                "(tensor parallelism stays on NVLink)"
            )
        job = JobConfig(
            model=work.model,
            optim=OptimConfig(name=work.optimizer),  # type: ignore[arg-type]
            parallel=ParallelConfig(
                dp=self.dp, tp=self.tp, pp=self.pp, vpp=self.v, cp=self.cp, ep=self.ep, schedule=self.schedule
            ),
            train=TrainConfig(global_batch=work.global_batch, micro_batch=self.micro_batch, recompute=self.recompute),
        )
        job.validate()


@dataclass(frozen=True)
class Implementation:
    """How fast a system's code runs around the kernels: constants measured or fitted per system
    (configs/systems/*.toml; docs/planning.md says where each comes from). Zero = ideal."""

    launch_gap_us: float = 0.0  # GPU idle between two dependent kernels (launch, stream waits)
    chunk_overhead_us: float = 0.0  # per model-chunk run: wait for the receive, post the send
    overlap_contention: float = 0.0  # compute slowed by this fraction of the comm it hides
    host_overhead_s: float = 0.0  # per step on the critical path: data, logging, Python GC
    jitter: Jitter = Jitter()  # per-rank busy-time factor (stragglers)
    grad_wire_bytes: int = 0  # bytes per gradient element on the DP wire (0: activation dtype)


@dataclass(frozen=True)
class Effects:
    """Which second-order effects the cost model includes; each is a named step term, so
    turning one off shows its weight."""

    stragglers: bool = True
    collisions: bool = True  # ECMP collisions of every flow that leaves a ToR
    interleave: bool = True  # per model-chunk overhead, paid 2v times per micro-batch
    contention: bool = True  # overlapped communication slows the compute it hides behind
    launch_gaps: bool = True
    host: bool = True

    NAMES = ("stragglers", "collisions", "interleave", "contention", "launch_gaps", "host")

    @classmethod
    def without(cls, names: list[str] | tuple[str, ...]) -> Effects:
        unknown = sorted(set(names) - set(cls.NAMES))
        if unknown:
            raise ConfigError(f"unknown effect(s) {unknown}; effects: {list(cls.NAMES)}")
        return cls(**{n: False for n in names})


@dataclass(frozen=True)
class Features:
    """Which MegaScale overlaps are on (section 3.2 of the paper); all on by default."""

    tp_overlap: bool = True  # all-gather / reduce-scatter fused into chunked GEMMs
    tp_chunks: int = 2  # chunks each fused GEMM is split into (parallel.tp_overlap_chunks)
    pp_overlap: bool = True  # sends and receives decoupled from compute
    dp_overlap: bool = True  # ZeRO all-gather prefetch, reduce-scatter as chunks finish
    data_overlap: bool = True  # first all-gather hidden behind data loading
    ep_overlap: bool = True  # MoE all-to-alls pipelined against the experts (chunks of rows)
    ep_chunks: int = 2  # parts a micro-batch's rows are cut into (parallel.ep_overlap_chunks)
    network_slowdown: float = 0.0  # DP slowdown from ecmp.simulate (0: the closed-form model)
    attention: Attention = "flash2"  # FlashAttention-2, FlashAttention-1, or materialised scores
    fused_elementwise: bool = True  # LayerNorm and GeLU each one kernel (else their pieces)
    impl: Implementation = Implementation()
    effects: Effects = Effects()

    @classmethod
    def from_job(cls, cfg: JobConfig) -> Features:
        p = cfg.parallel
        return cls(
            tp_overlap=p.tp_overlap,
            tp_chunks=p.tp_overlap_chunks,
            dp_overlap=p.dp_overlap,
            ep_overlap=p.ep_overlap_chunks > 1,
            ep_chunks=p.ep_overlap_chunks,
        )

    @classmethod
    def none(cls) -> Features:
        return cls(tp_overlap=False, pp_overlap=False, dp_overlap=False, data_overlap=False, ep_overlap=False)
