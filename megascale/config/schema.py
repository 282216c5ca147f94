"""Typed configuration of a training job.

Every component is built from one section of `JobConfig`. The sections are plain dataclasses
so that the planner, the trainer and the driver read the same description of a job. Values are
checked in `validate()`; the loader (`loader.py`) turns TOML and command-line overrides into
these objects and names the offending key on any error.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

# The Redis store's password: from this variable rather than the URL, it stays out of command
# lines, RUN_DIR/config.toml and checkpoint manifests. Ranks get the path of a 0600 file instead
# (config/handoff.py), so that the value is in no rank's environment either.
REDIS_PASSWORD_ENV = "MEGASCALE_REDIS_PASSWORD"
REDIS_PASSWORD_FILE_ENV = "MEGASCALE_REDIS_PASSWORD_FILE"


def redacted_url(url: str, mask: str | None = "***") -> str:
    """`url` with its password replaced by `mask` (messages, logs, written configs), or removed
    with `mask=None` (a rank's config: the password travels apart, in a 0600 file)."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    user = parts.username or ""
    keep = f"{user}:{mask}@" if mask is not None else (f"{user}@" if user else "")
    return urlunsplit(parts._replace(netloc=parts.netloc.replace(f"{user}:{parts.password}@", keep, 1)))


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type or impossible. Names the key."""


def opt(default: Any = MISSING, doc: str = "", *, factory: Callable[[], Any] | None = None) -> Any:
    """A config field and its one-line description: the one source `megascale train --help`
    and the documentation check read."""
    if factory is not None:
        return field(default_factory=factory, metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


@dataclass
class RopeScaling:
    """Llama-3 rotary scaling: wavelengths longer than the original context are stretched by
    `factor`, short ones kept, the band between interpolated (Llama 3.1 and later)."""

    kind: Literal["none", "llama3"] = opt("none", "none, or llama3: stretch long wavelengths (Llama 3.1 and later)")
    factor: float = opt(8.0, "how much longer wavelengths are stretched")
    low_freq_factor: float = opt(1.0, "wavelengths above original_max_positions / this are stretched in full")
    high_freq_factor: float = opt(
        4.0, "wavelengths below original_max_positions / this are kept; between: interpolated")
    original_max_positions: int = opt(8192, "the context length the model was pretrained with")

    def validate(self) -> None:
        if self.kind == "none":
            return
        if self.factor <= 0 or self.original_max_positions < 1:
            raise ConfigError("model.rope_scaling.factor and .original_max_positions must be > 0")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ConfigError(
                f"model.rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"{self.low_freq_factor} and {self.high_freq_factor}"
            )


@dataclass
class ModelConfig:
    """The GPT: sizes, block kind, attention, positions and the Llama-family layer options."""

    vocab_size: int = opt(257, "vocabulary size; byte-level is 257 (256 bytes + end-of-document)")
    seq_len: int = opt(256, "tokens per training sequence (and the learned position table's length)")
    layers: int = opt(4, "transformer blocks")
    hidden: int = opt(256, "width of the residual stream")
    heads: int = opt(8, "attention (query) heads; must divide hidden")
    kv_heads: int = opt(0, "grouped-query attention: key/value heads; 0 = heads (multi-head)")
    ffn_hidden: int = opt(0, "MLP width; 0 = 4 * hidden")
    block: Literal["serial", "parallel"] = opt(
        "parallel", "serial: x + MLP(LN(x + Attn(LN(x)))); parallel: x + MLP(LN(x)) + Attn(LN(x)) (MegaScale)")
    parallel_norms: Literal[1, 2] = opt(1, "parallel block: 1 norm feeds both branches, 2 = one each (GPT-NeoX)")
    norm: Literal["layernorm", "rmsnorm"] = opt("layernorm", "layernorm, or rmsnorm (Llama family)")
    mlp: Literal["gelu", "gelu_exact", "swiglu"] = opt(
        "gelu", "gelu (tanh approximation, GPT-2), gelu_exact, or swiglu (Llama family)")
    window: int | None = opt(None, "sliding-window attention span in tokens; none = full causal")
    positions: Literal["rotary", "learned"] = opt("rotary", "rotary, or learned absolute positions (GPT-2)")
    tie_embeddings: bool = opt(False, "the head shares the token embedding's weight (needs pp = 1)")
    bias: bool = opt(True, "the linear layers have biases (LayerNorms always do)")
    qkv_bias: bool = opt(False, "the QKV projection has a bias even when bias = false (Qwen 2)")
    norm_eps: float = opt(1e-5, "epsilon of every LayerNorm/RMSNorm")
    init_std: float = opt(0.02, "standard deviation of the initial weights (residual projections are scaled down)")
    rope_base: float = opt(10000.0, "rotary base (theta): 10000 for GPT-NeoX/Llama 2, 500000 for Llama 3")
    rotary_fraction: float = opt(1.0, "share of each head's dimensions that rotate (GPT-NeoX: 0.25)")
    rope_scaling: RopeScaling = opt(factory=RopeScaling, doc="rotary scaling for long contexts (a section of its own)")

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_groups(self) -> int:
        """Key/value heads (each shared by `heads / kv_groups` query heads)."""
        return self.kv_heads or self.heads

    @property
    def qkv_width(self) -> int:
        """Output width of the QKV projection: query heads plus the key and value heads."""
        return (self.heads + 2 * self.kv_groups) * self.head_dim

    @property
    def mlp_in_width(self) -> int:
        """Output width of the MLP's input projection (SwiGLU's gate and up side by side)."""
        return 2 * self.ffn if self.mlp == "swiglu" else self.ffn

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rotary_fraction)

    def validate(self) -> None:
        _positive(self, "model", ["vocab_size", "seq_len", "layers", "hidden", "heads"])
        if self.ffn_hidden < 0:
            raise ConfigError(f"model.ffn_hidden must be >= 0 (0 = 4*hidden), got {self.ffn_hidden}")
        if self.hidden % self.heads:
            raise ConfigError(
                f"model.heads={self.heads} must divide model.hidden={self.hidden} "
                f"(allowed heads: {_divisors(self.hidden)})"
            )
        if self.kv_heads < 0 or self.heads % self.kv_groups:
            raise ConfigError(
                f"model.kv_heads={self.kv_heads} must divide model.heads={self.heads} (0 = heads; "
                f"allowed: {_divisors(self.heads)})"
            )
        if self.positions == "rotary":
            if not 0 < self.rotary_fraction <= 1 or self.rotary_dim < 2 or self.rotary_dim % 2:
                raise ConfigError(
                    f"model.positions='rotary' needs an even number of rotating dims per head, got "
                    f"head dim {self.head_dim} x model.rotary_fraction {self.rotary_fraction}"
                )
            self.rope_scaling.validate()
        if self.block == "serial" and self.parallel_norms != 1:
            raise ConfigError("model.parallel_norms applies to block='parallel' only (a serial block has 2)")
        if self.window is not None and self.window < 1:
            raise ConfigError(f"model.window must be >= 1 or absent (full causal), got {self.window}")
        if self.norm_eps <= 0 or self.init_std <= 0:
            raise ConfigError("model.norm_eps and model.init_std must be > 0")


@dataclass
class OptimConfig:
    """LAMB or AdamW, the learning-rate schedule and gradient clipping."""

    name: Literal["lamb", "adamw"] = opt("lamb", "lamb (layer-wise trust ratio, large batches) or adamw")
    lr: float = opt(2e-3, "peak learning rate")
    min_lr_ratio: float = opt(0.1, "cosine decays to lr * min_lr_ratio")
    warmup_steps: int = opt(20, "linear warm-up steps from 0 to lr")
    decay_steps: int = opt(0, "cosine decay length in steps; 0 = train.steps")
    weight_decay: float = opt(0.01, "decoupled weight decay of matrices (not biases or norms)")
    beta1: float = opt(0.9, "first-moment decay")
    beta2: float = opt(0.95, "second-moment decay")
    eps: float = opt(1e-8, "denominator epsilon")
    grad_clip: float = opt(1.0, "clip the global gradient L2 norm to this; 0 disables")

    def validate(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"optim.lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        for key in ("beta1", "beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise ConfigError(f"optim.{key} must be in [0, 1), got {getattr(self, key)}")
        for key in ("warmup_steps", "decay_steps", "weight_decay", "grad_clip"):
            if getattr(self, key) < 0:
                raise ConfigError(f"optim.{key} must be >= 0, got {getattr(self, key)}")
        if self.eps <= 0:
            raise ConfigError(f"optim.eps must be > 0, got {self.eps}")


@dataclass
class ParallelConfig:
    """The (pp, dp, tp) layout, the overlaps and how ranks meet at start-up."""

    dp: int = opt(1, "data-parallel degree (ZeRO-2 shards gradients and optimizer state over it)")
    tp: int = opt(1, "tensor-parallel degree (inside a node; with sequence parallelism)")
    pp: int = opt(1, "pipeline stages")
    vpp: int = opt(1, "virtual pipeline chunks per stage (interleaved 1F1B when > 1)")
    # layers per pipeline chunk: "auto" balances FLOPs (the first chunk has the embedding, the
    # last the head and loss), "even" splits by count, or a list of pp*vpp counts in chunk order
    pp_split: Literal["auto", "even"] | list[int] = opt(
        "auto", "layers per chunk: auto (FLOP-balanced), even, or a list of pp*vpp counts")
    schedule: Literal["1f1b", "gpipe"] = opt("1f1b", "1f1b (interleaved when vpp > 1) or gpipe")
    sequence_parallel: bool = opt(True, "shard LayerNorm/residual activations along the sequence over tp")
    tp_overlap: bool = opt(True, "chunked all-gather/reduce-scatter fused into the GEMMs")
    tp_overlap_chunks: int = opt(2, "chunks each collective GEMM is cut into")
    dp_overlap: bool = opt(True, "ZeRO-2 all-gather prefetch and reduce-scatter overlap")
    dp_bucket_mb: float = opt(16.0, "ZeRO bucket: MiB of fp32 per rank; smaller starts reduce-scatters earlier")
    backend: Literal["auto", "gloo", "nccl"] = opt("auto", "auto (NCCL on CUDA, gloo on CPU), gloo or nccl")
    store: Literal["tcp", "redis"] = opt("tcp", "rendezvous store: tcp (PyTorch's TCPStore) or redis")
    redis_url: str = opt(
        "redis://127.0.0.1:6379/0", "redis://HOST:PORT/DB of the Redis store (password: $MEGASCALE_REDIS_PASSWORD)")
    redis_connect_timeout_s: float = opt(10.0, "fail with the address if Redis is not reachable within this")
    redis_start: bool = opt(False, "the launcher/driver runs redis-server at redis_url for the job")
    init_timeout_s: float = opt(120.0, "how long ranks wait for each other at start-up")
    collective_timeout_s: float = opt(600.0, "a collective that takes longer fails (then the watchdog says where)")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def redis_password(self) -> str | None:
        """The URL's password, else the file $MEGASCALE_REDIS_PASSWORD_FILE names, else
        $MEGASCALE_REDIS_PASSWORD, else none."""
        if password := urlsplit(self.redis_url).password:
            return password
        if path := os.environ.get(REDIS_PASSWORD_FILE_ENV):
            try:
                return Path(path).read_text().strip() or None
            except OSError as exc:
                raise ConfigError(f"${REDIS_PASSWORD_FILE_ENV}={path}: {exc.strerror or exc}") from None
        return os.environ.get(REDIS_PASSWORD_ENV) or None

    def validate(self) -> None:
        _positive(self, "parallel", ["dp", "tp", "pp", "vpp", "tp_overlap_chunks"])
        if self.dp_bucket_mb <= 0:
            raise ConfigError(f"parallel.dp_bucket_mb must be > 0, got {self.dp_bucket_mb}")
        if self.vpp > 1 and self.pp == 1:
            raise ConfigError("parallel.vpp > 1 needs parallel.pp > 1 (interleaving is across stages)")
        if self.init_timeout_s <= 0 or self.collective_timeout_s <= 0:
            raise ConfigError("parallel.init_timeout_s and parallel.collective_timeout_s must be > 0")
        if self.redis_connect_timeout_s <= 0:
            raise ConfigError(
                f"parallel.redis_connect_timeout_s must be > 0, got {self.redis_connect_timeout_s}"
            )
        if self.store == "redis" and not self.redis_url.startswith(("redis://", "unix://")):
            raise ConfigError(
                f"parallel.redis_url must look like redis://HOST:PORT/DB, got {self.redis_url!r}"
            )
        if self.redis_start:
            self._validate_redis_start()

    def _validate_redis_start(self) -> None:
        if self.store != "redis":
            raise ConfigError('parallel.redis_start = true needs parallel.store = "redis"')
        url = urlsplit(self.redis_url)
        if url.scheme != "redis" or not url.port:
            raise ConfigError(
                f"parallel.redis_start serves TCP: parallel.redis_url must be redis://HOST:PORT/DB "
                f"with a port, got {url.scheme}://{url.hostname}:{url.port}"
            )
        if url.hostname not in ("127.0.0.1", "localhost", "::1") and not self.redis_password():
            raise ConfigError(
                f"parallel.redis_start would expose redis-server on {url.hostname}:{url.port} without a "
                f"password; set ${REDIS_PASSWORD_ENV} (not in the URL: `ps` would show it) or bind 127.0.0.1"
            )


@dataclass
class DataConfig:
    """Prepared token data: path or mixture, loading, evaluation split."""

    path: str = opt("", "a prepared token directory (megascale prep); \"\" = the embedded default corpus")
    cache_dir: str = opt(".cache/megascale", "where the default corpus is prepared")
    val_fraction: float = opt(0.02, "share of documents held out for evaluation")
    seed: int = opt(1234, "seed of the sample order (resumable)")
    prefetch: bool = opt(True, "prepare step k+1's batch while step k runs")
    reader: Literal["node", "tp", "rank"] = opt(
        "node", "who reads from disk: node (one per node, shared memory), tp, or rank")
    cross_document: bool = opt(False, "predict across end-of-document tokens")
    mixture: dict[str, float] = opt(factory=dict, doc="weighted datasets: PATH=WEIGHT,PATH=WEIGHT (instead of path)")
    tokenizer: str = opt("", "expected tokenizer: \"\" = the manifest's, bytes, or a tokenizer.json")
    verify_checksums: bool = opt(True, "sha256 of every shard before training (readers only)")

    def validate(self) -> None:
        if not 0 <= self.val_fraction < 1:
            raise ConfigError(f"data.val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.path and self.mixture:
            raise ConfigError("set data.path or data.mixture, not both (the mixture lists paths)")
        for path, weight in self.mixture.items():
            if weight <= 0:
                raise ConfigError(f"data.mixture weight for {path!r} must be > 0, got {weight}")


@dataclass
class TrainConfig:
    """The loop: steps, batch sizes, precision, speed options, logging and trackers."""

    steps: int = opt(200, "optimizer steps to train")
    global_batch: int = opt(16, "sequences per optimizer step, across data-parallel ranks")
    micro_batch: int = opt(4, "sequences per forward/backward on one rank")
    seed: int = opt(1234, "seed of the initial weights and of every rank's RNG")
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "auto (CUDA when available), cpu or cuda")
    dtype: Literal["fp32", "bf16"] = opt("fp32", "compute dtype: fp32, or bf16 (autocast)")
    param_dtype: Literal["fp32", "bf16"] = opt(
        "fp32", "parameters, gradients and their reduction in fp32 or bf16 (fp32 master shards either way)")
    recompute: Literal["none", "full", "selective"] = opt(
        "none", "activation recomputation: none, selective (attention core) or full (whole blocks)")
    compile: bool = opt(False, "torch.compile each block (fuses LayerNorm, GeLU, residual adds)")
    fuse_input_gemm: bool = opt(
        False, "parallel block: QKV and MLP up-projection as one GEMM (tensor parallel always does)")
    attention: Literal["auto", "sdpa", "flex"] = opt("auto", "attention kernel: auto, sdpa, or flex (CUDA only)")
    eval_every: int = opt(50, "evaluate every N steps; 0 = never")
    eval_batches: int = opt(4, "batches per evaluation")
    log_every: int = opt(1, "progress line every N steps")
    gc_every: int = opt(50, "automatic GC off; collect on every rank every N steps")
    run_dir: str = opt("runs/default", "where the run's logs, metrics, timers and checkpoints go")
    tensorboard: bool = opt(True, "write TensorBoard scalars (grouped tags) under run_dir")
    wandb: bool = opt(False, "also log to Weights & Biases (pip install 'megascale[wandb]')")
    wandb_project: str = opt("megascale", "the W&B project")
    wandb_mode: Literal["online", "offline"] = opt(
        "online", "online, or offline: written under run_dir for a later `wandb sync`")

    def validate(self) -> None:
        _positive(self, "train", ["steps", "global_batch", "micro_batch", "log_every"])
        for key in ("eval_every", "eval_batches", "gc_every"):
            if getattr(self, key) < 0:
                raise ConfigError(f"train.{key} must be >= 0, got {getattr(self, key)}")


@dataclass
class CheckpointConfig:
    """Two-stage checkpoints: where, how often, how many, and resume."""

    dir: str = opt("", "\"\" = <run_dir>/checkpoints; any fsspec URL is accepted")
    every: int = opt(100, "save every N steps; 0 disables periodic saves")
    keep: int = opt(3, "valid checkpoints kept")
    resume: str = opt("auto", "auto (the newest valid one), none, or a checkpoint path")
    init_from: str = opt("", "weights only, fresh optimizer: a Hugging Face checkpoint directory (megascale "
                             "import); read when there is no checkpoint to resume from")
    async_save: bool = opt(True, "stage 2 (persisting) in a background writer while training goes on")
    when_busy: Literal["wait", "skip"] = opt(
        "wait", "a save due while the previous one is still writing: wait, or skip it")
    write_mb_per_s: float = opt(0.0, "cap on stage-2 write bandwidth per rank; 0 = unlimited")
    commit_timeout_s: float = opt(600.0, "rank 0 gives up on a save whose other ranks never finish")
    save_on_signal: bool = opt(True, "SIGTERM/Ctrl-C: every rank stops after the same step and saves")
    fsync: bool = opt(True, "sync files and directories around each commit (false: scratch storage only)")
    peer_every: int = opt(10, "steps between copies of each rank's state into a peer node's memory, used to "
                             "recover under megascale launch (0 = no copies)")
    peer_stride: int = opt(1, "a node's copies go to the node this many places on along the ring; at scale, the "
                              "nodes behind one switch, so that one switch failure never takes a rank and its copy")

    def validate(self) -> None:
        if self.every < 0 or self.keep < 1:
            raise ConfigError(
                f"checkpoint.every must be >= 0 and checkpoint.keep >= 1, got {self.every}, {self.keep}"
            )
        if self.write_mb_per_s < 0:
            raise ConfigError(f"checkpoint.write_mb_per_s must be >= 0, got {self.write_mb_per_s}")
        if self.commit_timeout_s <= 0:
            raise ConfigError(f"checkpoint.commit_timeout_s must be > 0, got {self.commit_timeout_s}")
        if self.peer_every < 0:
            raise ConfigError(f"checkpoint.peer_every must be >= 0 (0 = no peer copies), got {self.peer_every}")
        if self.peer_stride < 1:
            raise ConfigError(f"checkpoint.peer_stride must be >= 1 (nodes along the ring), got {self.peer_stride}")


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
            raise ConfigError(
                "diagnostics.hang_timeout_s must be > 0 and diagnostics.straggler_threshold > 1"
            )
        if not 0 < self.straggler_min_fraction <= 1:
            raise ConfigError(
                f"diagnostics.straggler_min_fraction must be in (0, 1], "
                f"got {self.straggler_min_fraction}"
            )
        if self.straggler_warmup_steps < 0:
            raise ConfigError(
                "diagnostics.straggler_warmup_steps must be >= 0, "
                f"got {self.straggler_warmup_steps}"
            )


@dataclass
class ResilienceConfig:
    """The fault-tolerant driver (`megascale launch`) and its executors."""

    heartbeat_s: float = opt(1.0, "executor -> driver heartbeat period")
    heartbeat_timeout_s: float = opt(5.0, "no heartbeat for this long: the node is lost")
    startup_timeout_s: float = opt(120.0, "start -> first step; covers a slow first step")
    hang_floor_s: float = opt(10.0, "no step progress for max(floor, factor * max step time): hang")
    hang_factor: float = opt(5.0, "see hang_floor_s")
    warmup_steps: int = opt(2, "steps before the hang window and the slowdown baseline are learned")
    slow_factor: float = opt(3.0, "recent step time above factor x baseline: a slowdown alert")
    traffic_window_s: float = opt(5.0, "traffic at zero this long while ranks run: a fault")
    traffic_fall_ratio: float = opt(0.2, "traffic below ratio x its baseline: an alert")
    traffic_interfaces: list[str] = opt(factory=list, doc="network interfaces watched; [] = every interface but lo")
    error_keywords: list[str] = opt(doc="log lines containing any of these are faults", factory=lambda: [
        "Traceback (most recent call last)", "CUDA error", "NCCL error", "ncclInternalError",
        "Segmentation fault", "illegal memory access", "uncorrectable ECC"])
    restart_budget: int = opt(10, "restarts allowed over the whole job")
    max_node_faults: int = opt(2, "faults blamed on one node before it is evicted anyway")
    spares: int = opt(0, "spare nodes that replace evicted ones")
    stop_timeout_s: float = opt(20.0, "how long ranks get to stop before they are killed")
    selfcheck_timeout_s: float = opt(60.0, "limit on the self-check diagnostics after a fault")
    selfcheck_expected: str = opt("", "JSON file of expected figures; \"\" = built-in floors")
    api_host: str = opt("127.0.0.1", "the driver's API address (127.0.0.1 unless executors run elsewhere)")
    api_port: int = opt(0, "0 = any free port (written to the state dir)")
    api_request_timeout_s: float = opt(10.0, "a client's TLS handshake, and each request, must finish within this")
    secret_dir: str = opt("", "token + TLS certificate and key; \"\" = <run_dir>/resilience/secret, made if missing")
    rendezvous_port: int = opt(0, "0 = a free port per attempt; else base + attempt")
    in_place: bool = opt(True, "recover by replacing only the failed ranks (the healthy ones stay alive, state "
                               "from peer memory); false: every fault restarts every rank")
    standby: int = opt(1, "warm rank processes (torch imported) an active node keeps for replacements; "
                          "spares keep one per rank")

    def validate(self) -> None:
        for key in ("heartbeat_s", "heartbeat_timeout_s", "startup_timeout_s", "hang_floor_s",
                    "traffic_window_s", "stop_timeout_s", "selfcheck_timeout_s", "api_request_timeout_s"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"resilience.{key} must be > 0, got {getattr(self, key)}")
        if self.heartbeat_timeout_s <= self.heartbeat_s:
            raise ConfigError(
                f"resilience.heartbeat_timeout_s={self.heartbeat_timeout_s} must exceed "
                f"resilience.heartbeat_s={self.heartbeat_s}"
            )
        if self.hang_factor < 1 or self.slow_factor <= 1:
            raise ConfigError("resilience.hang_factor must be >= 1 and resilience.slow_factor > 1")
        if not 0 < self.traffic_fall_ratio < 1:
            raise ConfigError(
                f"resilience.traffic_fall_ratio must be in (0, 1), got {self.traffic_fall_ratio}"
            )
        for key in ("warmup_steps", "restart_budget", "spares", "standby"):
            if getattr(self, key) < 0:
                raise ConfigError(f"resilience.{key} must be >= 0, got {getattr(self, key)}")
        if self.max_node_faults < 1:
            raise ConfigError(f"resilience.max_node_faults must be >= 1, got {self.max_node_faults}")
        for key in ("api_port", "rendezvous_port"):
            if not 0 <= getattr(self, key) < 65536:
                raise ConfigError(f"resilience.{key} must be a port in [0, 65535]")


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)

    def validate(self) -> None:
        for section in (self.model, self.optim, self.parallel, self.data, self.train,
                        self.checkpoint, self.diagnostics, self.resilience):
            section.validate()
        self._validate_layout()

    @property
    def micro_batches(self) -> int:
        """Micro-batches per data-parallel rank per optimizer step."""
        return self.train.global_batch // (self.train.micro_batch * self.parallel.dp)

    def _validate_layout(self) -> None:
        m, p, t = self.model, self.parallel, self.train
        per_step = t.micro_batch * p.dp
        if t.global_batch % per_step:
            raise ConfigError(
                f"train.global_batch={t.global_batch} must be a multiple of "
                f"train.micro_batch * parallel.dp = {t.micro_batch} * {p.dp} = {per_step}"
            )
        check_tensor_parallel(m, p.tp, p.sequence_parallel)
        check_pipeline_split(m.layers, p.pp, p.vpp, p.pp_split)
        if p.vpp > 1 and self.micro_batches % p.pp:
            raise ConfigError(
                f"interleaved 1F1B needs micro-batches per step ({self.micro_batches} = "
                f"global_batch / (micro_batch * dp)) to be a multiple of parallel.pp={p.pp}"
            )
        if p.pp > 1 and m.tie_embeddings:
            raise ConfigError(
                "model.tie_embeddings=true needs parallel.pp=1 (the embedding and the head live "
                "on different pipeline stages); set model.tie_embeddings=false"
            )


def check_tensor_parallel(m: ModelConfig, tp: int, sequence_parallel: bool) -> None:
    """The model splits into `tp` slices: whole heads and key/value groups, whole MLP columns and, under sequence
    parallelism, equal sequence slices. Checked by `validate()` and again by tensor parallelism
    against the mesh it is given, before any collective."""
    if m.heads % tp:
        raise ConfigError(f"parallel.tp={tp} must divide model.heads={m.heads} (allowed tp: {_divisors(m.heads)})")
    if m.kv_groups % tp:
        raise ConfigError(
            f"parallel.tp={tp} must divide model.kv_heads={m.kv_groups}: each tp rank holds whole "
            f"key/value heads (allowed tp: {_divisors(m.kv_groups)})"
        )
    if m.ffn % tp:
        raise ConfigError(f"parallel.tp={tp} must divide the MLP width {m.ffn}")
    if sequence_parallel and tp > 1 and m.seq_len % tp:
        raise ConfigError(f"parallel.tp={tp} must divide model.seq_len={m.seq_len} with sequence parallelism")


def check_pipeline_split(layers: int, pp: int, vpp: int, split: str | list[int]) -> None:
    """`layers` can be cut into pp*vpp consecutive chunks as `split` asks, each with a layer."""
    chunks = pp * vpp
    if split == "even" and layers % chunks:
        raise ConfigError(
            f"model.layers={layers} must be divisible by parallel.pp * parallel.vpp = {pp} * {vpp} = "
            f"{chunks} with parallel.pp_split='even'; use 'auto' or a list of layers per chunk"
        )
    if split == "auto" and layers < chunks:
        raise ConfigError(f"model.layers={layers} is fewer than the {chunks} pipeline chunks (pp * vpp)")
    if isinstance(split, list) and (len(split) != chunks or sum(split) != layers or min(split) < 1):
        raise ConfigError(
            f"parallel.pp_split={split} must list {chunks} (pp * vpp) chunks of >= 1 layer each, "
            f"in chunk order, adding up to model.layers={layers}"
        )


def _positive(section: object, name: str, keys: list[str]) -> None:
    for key in keys:
        value = getattr(section, key)
        if value < 1:
            raise ConfigError(f"{name}.{key} must be >= 1, got {value}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
