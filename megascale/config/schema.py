"""Typed configuration of a training job.

Every component is built from one section of `JobConfig`. The sections are plain dataclasses
so that the planner, the trainer and the driver read the same description of a job. Values are
checked in `validate()`; the loader (`loader.py`) turns TOML and command-line overrides into
these objects and names the offending key on any error. The sections that run a job
(checkpoints, diagnostics, the driver) are in `operations.py`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

from megascale.config.fields import ConfigError, at_least, divisors, opt, positive
from megascale.config.operations import CheckpointConfig, DiagnosticsConfig, ResilienceConfig
from megascale.config.shares import BatchShares

# The Redis store's password: from this variable rather than the URL, it stays out of command
# lines, RUN_DIR/config.toml and checkpoint manifests. Ranks get the path of a 0600 file instead
# (config/handoff.py), so that the value is in no rank's environment either.
REDIS_PASSWORD_ENV = "MEGASCALE_REDIS_PASSWORD"
REDIS_PASSWORD_FILE_ENV = "MEGASCALE_REDIS_PASSWORD_FILE"

# Tokens per chunk of the head and loss: 1024 x vocabulary 128k is 0.5 GiB of fp32 logits, and
# still a large GEMM (1024 rows) for a GPU.
DEFAULT_LOSS_CHUNK = 1024


def redacted_url(url: str, mask: str | None = "***") -> str:
    """`url` with its password replaced by `mask` (messages, logs, written configs), or removed
    with `mask=None` (a rank's config: the password travels apart, in a 0600 file)."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    user = parts.username or ""
    keep = f"{user}:{mask}@" if mask is not None else (f"{user}@" if user else "")
    return urlunsplit(parts._replace(netloc=parts.netloc.replace(f"{user}:{parts.password}@", keep, 1)))


@dataclass
class RopeScaling:
    """Llama-3 rotary scaling: wavelengths longer than the original context are stretched by
    `factor`, short ones kept, the band between interpolated (Llama 3.1 and later)."""

    kind: Literal["none", "llama3"] = opt("none", "none, or llama3: stretch long wavelengths (Llama 3.1 and later)")
    factor: float = opt(8.0, "how much longer wavelengths are stretched")
    low_freq_factor: float = opt(1.0, "wavelengths above original_max_positions / this are stretched in full")
    high_freq_factor: float = opt(
        4.0, "wavelengths below original_max_positions / this are kept; between: interpolated"
    )
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
class MoEConfig:
    """Mixture-of-experts MLPs: a router sends each token to `top_k` of `experts` SwiGLU (the
    model's MLP kind) experts; `experts = 0` keeps every MLP dense."""

    experts: int = opt(0, "routed experts per MoE layer; 0 = dense MLPs (no MoE)")
    top_k: int = opt(2, "experts each token is sent to")
    every: int = opt(1, "block i has an MoE MLP when (i + 1) % every == 0 (1: every block)")
    ffn_hidden: int = opt(0, "width of one expert's MLP; 0 = model.ffn_hidden (its default)")
    router: Literal["softmax", "sigmoid"] = opt(
        "softmax", "softmax over experts (Mixtral, Qwen-MoE) or per-expert sigmoid (DeepSeek-V3)"
    )
    normalize: bool = opt(True, "rescale each token's top-k gates to sum to 1 (Mixtral); sigmoid always does")
    shared_ffn_hidden: int = opt(0, "width of a shared expert every token goes through; 0 = none")
    shared_gate: bool = opt(
        False, "scale the shared expert's output by sigmoid(a learned linear function of the token) (Qwen2-MoE)"
    )
    aux_loss_coef: float = opt(0.01, "load-balancing loss (Switch/GShard, per sequence) coefficient; 0 = off")
    z_loss_coef: float = opt(0.001, "router z-loss (ST-MoE: mean squared log-sum-exp of router logits) coefficient")
    bias_balancing: bool = opt(
        False, "DeepSeek-V3 auxiliary-loss-free balancing: a per-expert bias on the routing scores, moved each step"
    )
    bias_update_rate: float = opt(0.001, "bias_balancing: step of the bias towards the mean load per optimizer step")
    capacity_factor: float = opt(
        0.0,
        "0 = dropless; else an expert takes at most ceil(factor * seq_len * top_k / experts) tokens of a "
        "sequence, later tokens beyond it are dropped (pass through the residual)",
    )

    def is_moe_layer(self, index: int) -> bool:
        return self.experts > 0 and (index + 1) % self.every == 0

    def validate(self) -> None:
        if self.experts == 0:
            return
        positive(self, "model.moe", ["experts", "top_k", "every"])
        if self.top_k > self.experts:
            raise ConfigError(f"model.moe.top_k={self.top_k} must be <= model.moe.experts={self.experts}")
        if self.shared_gate and not self.shared_ffn_hidden:
            raise ConfigError("model.moe.shared_gate=true gates the shared expert: set model.moe.shared_ffn_hidden > 0")
        widths, rates = ("ffn_hidden", "shared_ffn_hidden"), ("aux_loss_coef", "z_loss_coef", "bias_update_rate")
        at_least(self, "model.moe", (*widths, *rates, "capacity_factor"), 0)


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
        "parallel", "serial: x + MLP(LN(x + Attn(LN(x)))); parallel: x + MLP(LN(x)) + Attn(LN(x)) (MegaScale)"
    )
    parallel_norms: Literal[1, 2] = opt(1, "parallel block: 1 norm feeds both branches, 2 = one each (GPT-NeoX)")
    norm: Literal["layernorm", "rmsnorm"] = opt("layernorm", "layernorm, or rmsnorm (Llama family)")
    mlp: Literal["gelu", "gelu_exact", "swiglu"] = opt(
        "gelu", "gelu (tanh approximation, GPT-2), gelu_exact, or swiglu (Llama family)"
    )
    window: int | None = opt(None, "sliding-window attention span in tokens; none = full causal")
    positions: Literal["rotary", "learned"] = opt("rotary", "rotary, or learned absolute positions (GPT-2)")
    tie_embeddings: bool = opt(False, "the head shares the token embedding's weight (needs pp = 1)")
    bias: bool = opt(True, "the linear layers have biases (LayerNorms always do)")
    qkv_bias: bool = opt(False, "the QKV projection has a bias even when bias = false (Qwen 2)")
    qk_norm: bool = opt(
        False, "RMSNorm over each query and key head (head_dim wide) before the rotary embedding (Qwen 3)"
    )
    norm_eps: float = opt(1e-5, "epsilon of every LayerNorm/RMSNorm")
    init_std: float = opt(0.02, "standard deviation of the initial weights (residual projections are scaled down)")
    rope_base: float = opt(10000.0, "rotary base (theta): 10000 for GPT-NeoX/Llama 2, 500000 for Llama 3")
    rotary_fraction: float = opt(1.0, "share of each head's dimensions that rotate (GPT-NeoX: 0.25)")
    rope_scaling: RopeScaling = opt(factory=RopeScaling, doc="rotary scaling for long contexts (a section of its own)")
    moe: MoEConfig = opt(factory=MoEConfig, doc="mixture-of-experts MLPs (a section of its own)")

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @property
    def expert_ffn(self) -> int:
        """Width of one routed expert's MLP."""
        return self.moe.ffn_hidden or self.ffn

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
        positive(self, "model", ["vocab_size", "seq_len", "layers", "hidden", "heads"])
        if self.ffn_hidden < 0:
            raise ConfigError(f"model.ffn_hidden must be >= 0 (0 = 4*hidden), got {self.ffn_hidden}")
        if self.hidden % self.heads:
            raise ConfigError(
                f"model.heads={self.heads} must divide model.hidden={self.hidden} "
                f"(allowed heads: {divisors(self.hidden)})"
            )
        if self.kv_heads < 0 or self.heads % self.kv_groups:
            raise ConfigError(
                f"model.kv_heads={self.kv_heads} must divide model.heads={self.heads} (0 = heads; "
                f"allowed: {divisors(self.heads)})"
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
        self.moe.validate()


@dataclass
class OptimConfig:
    """LAMB or AdamW, the learning-rate schedule and gradient clipping."""

    name: Literal["lamb", "adamw"] = opt("lamb", "lamb (layer-wise trust ratio, large batches) or adamw")
    lr: float = opt(2e-3, "peak learning rate (0 keeps the weights as they are: an evaluation run)")
    min_lr_ratio: float = opt(0.1, "cosine decays to lr * min_lr_ratio")
    warmup_steps: int = opt(20, "linear warm-up steps from 0 to lr")
    decay_steps: int = opt(0, "cosine decay length in steps; 0 = train.steps")
    weight_decay: float = opt(0.01, "decoupled weight decay of matrices (not biases or norms)")
    beta1: float = opt(0.9, "first-moment decay")
    beta2: float = opt(0.95, "second-moment decay")
    eps: float = opt(1e-8, "denominator epsilon")
    grad_clip: float = opt(1.0, "clip the global gradient L2 norm to this; 0 disables")

    def validate(self) -> None:
        if self.lr < 0:
            raise ConfigError(f"optim.lr must be >= 0 (0 leaves the weights as they are), got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        for key in ("beta1", "beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise ConfigError(f"optim.{key} must be in [0, 1), got {getattr(self, key)}")
        at_least(self, "optim", ("warmup_steps", "decay_steps", "weight_decay", "grad_clip"), 0)
        if self.eps <= 0:
            raise ConfigError(f"optim.eps must be > 0, got {self.eps}")


@dataclass
class ParallelConfig:
    """The (pp, dp, cp, tp) layout, the overlaps and how ranks meet at start-up."""

    dp: int = opt(1, "data-parallel degree (ZeRO-2 shards gradients and optimizer state over it)")
    tp: int = opt(1, "tensor-parallel degree (inside a node; with sequence parallelism)")
    pp: int = opt(1, "pipeline stages")
    cp: int = opt(1, "context-parallel degree: each sequence split over cp ranks (ring attention; a window: a halo)")
    ep: int = opt(1, "expert-parallel degree, carved from dp: ep consecutive dp ranks split each MoE layer's experts")
    vpp: int = opt(1, "virtual pipeline chunks per stage (interleaved 1F1B when > 1)")
    # layers per pipeline chunk: "auto" balances FLOPs (the first chunk has the embedding, the
    # last the head and loss), "even" splits by count, or a list of pp*vpp counts in chunk order
    pp_split: Literal["auto", "even"] | list[int] = opt(
        "auto", "layers per chunk: auto (FLOP-balanced), even, or a list of pp*vpp counts"
    )
    schedule: Literal["1f1b", "gpipe", "zb-h1", "zbv"] = opt(
        "1f1b",
        "1f1b (interleaved when vpp > 1), gpipe, zb-h1 (zero-bubble: split backward, vpp=1) or zbv "
        "(zero-bubble V: two chunks per stage in a V, vpp=2)",
    )
    sequence_parallel: bool = opt(True, "shard LayerNorm/residual activations along the sequence over tp")
    tp_overlap: bool = opt(True, "chunked all-gather/reduce-scatter fused into the GEMMs")
    tp_overlap_chunks: int = opt(2, "chunks each collective GEMM is cut into")
    ep_overlap_chunks: int = opt(
        2,
        "expert parallelism: parts a micro-batch's routed rows are cut into, each part's all-to-all in flight "
        "while another part's experts compute; 1 = no overlap",
    )
    dp_overlap: bool = opt(True, "ZeRO-2 all-gather prefetch and reduce-scatter overlap")
    dp_bucket_mb: float = opt(
        4.0, "ZeRO bucket: MiB of fp32 per rank; smaller starts reduce-scatters earlier and holds less unsharded"
    )
    backend: Literal["auto", "gloo", "nccl"] = opt("auto", "auto (NCCL on CUDA, gloo on CPU), gloo or nccl")
    store: Literal["tcp", "redis"] = opt("tcp", "rendezvous store: tcp (PyTorch's TCPStore) or redis")
    redis_url: str = opt(
        "redis://127.0.0.1:6379/0", "redis://HOST:PORT/DB of the Redis store (password: $MEGASCALE_REDIS_PASSWORD)"
    )
    redis_connect_timeout_s: float = opt(10.0, "fail with the address if Redis is not reachable within this")
    redis_start: bool = opt(False, "the launcher/driver runs redis-server at redis_url for the job")
    init_timeout_s: float = opt(120.0, "how long ranks wait for each other at start-up")
    collective_timeout_s: float = opt(600.0, "a collective that takes longer fails (then the watchdog says where)")

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
        positive(self, "parallel", ["dp", "tp", "pp", "cp", "ep", "vpp", "tp_overlap_chunks", "ep_overlap_chunks"])
        if self.dp_bucket_mb <= 0:
            raise ConfigError(f"parallel.dp_bucket_mb must be > 0, got {self.dp_bucket_mb}")
        if self.vpp > 1 and self.pp == 1:
            raise ConfigError("parallel.vpp > 1 needs parallel.pp > 1 (interleaving is across stages)")
        if self.schedule == "zb-h1" and self.vpp > 1:
            raise ConfigError("parallel.schedule='zb-h1' runs one chunk per stage: set parallel.vpp=1")
        if self.schedule == "zbv" and self.vpp != 2:
            raise ConfigError("parallel.schedule='zbv' runs two chunks per stage in a V: set parallel.vpp=2")
        if self.init_timeout_s <= 0 or self.collective_timeout_s <= 0:
            raise ConfigError("parallel.init_timeout_s and parallel.collective_timeout_s must be > 0")
        if self.redis_connect_timeout_s <= 0:
            raise ConfigError(f"parallel.redis_connect_timeout_s must be > 0, got {self.redis_connect_timeout_s}")
        if self.store == "redis" and not self.redis_url.startswith(("redis://", "unix://")):
            raise ConfigError(f"parallel.redis_url must look like redis://HOST:PORT/DB, got {self.redis_url!r}")
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

    path: str = opt("", 'a prepared token directory (megascale prep); "" = the embedded default corpus')
    cache_dir: str = opt(".cache/megascale", "where the default corpus is prepared")
    val_fraction: float = opt(0.02, "share of documents held out for evaluation")
    seed: int = opt(1234, "seed of the sample order (resumable)")
    prefetch: bool = opt(True, "prepare step k+1's batch while step k runs")
    reader: Literal["node", "tp", "rank"] = opt(
        "node", "who reads from disk: node (one per node, shared memory), tp, or rank"
    )
    cross_document: bool = opt(False, "predict across end-of-document tokens")
    mixture: dict[str, float] = opt(factory=dict, doc="weighted datasets: PATH=WEIGHT,PATH=WEIGHT (instead of path)")
    tokenizer: str = opt("", 'expected tokenizer: "" = the manifest\'s, bytes, or a tokenizer.json')
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
    dtype: str = opt("fp32", "compute dtype: fp32, or bf16 (autocast); fp16 is refused (no loss scaler)")
    param_dtype: str = opt(
        "fp32", "parameters and their gradients in fp32 or bf16 (fp32 master weights and optimizer state either way)"
    )
    reduce_dtype: str = opt(
        "fp32", "dtype of the data-parallel gradient reduce-scatter: fp32 (bf16 gradients widened first) or bf16"
    )
    max_skipped_steps: int = opt(5, "stop after this many consecutive steps skipped for a non-finite gradient norm")
    spike_action: Literal["log", "skip", "rollback"] = opt(
        "log", "on a loss spike: log it, skip the step, or rollback (restore the last checkpoint, skip the data)"
    )
    spike_window: int = opt(50, "loss spikes: steps of recent losses the median and MAD are taken over")
    spike_threshold: float = opt(6.0, "a spike: loss above median + this many robust deviations (1.4826 MAD)")
    spike_skip_batches: int = opt(1, "rollback: batches skipped, ending with the spike's")
    max_rollbacks: int = opt(3, "stop when a spike would roll back to the same checkpoint more than this many times")
    recompute: Literal["none", "full", "selective"] = opt(
        "none", "activation recomputation: none, selective (attention core) or full (whole blocks)"
    )
    memory_limit_gib: float = opt(
        0.0,
        "GiB each rank's tensors may hold (model state, activations, buffers); 0 = no limit. "
        "megascale train refuses a layout whose planner estimate exceeds it and names one that fits "
        "(more parallel.cp, full recompute); megascale plan searches under it",
    )
    compile: bool = opt(False, "torch.compile each block (fuses LayerNorm, GeLU, residual adds)")
    fuse_input_gemm: bool = opt(
        False, "parallel block: QKV and MLP up-projection as one GEMM (tensor parallel always does)"
    )
    attention: Literal["auto", "sdpa", "flex", "sliding"] = opt(
        "auto",
        "attention kernel: auto, sdpa (SWA band-masked: O(s^2)), flex (CUDA only), or sliding "
        "(SWA in query blocks, O(s*w), any device; auto's choice off CUDA)",
    )
    loss_chunk: int = opt(
        DEFAULT_LOSS_CHUNK,
        "tokens per chunk of the head and loss: whole logits never exist "
        "(a chunk's are loss_chunk x vocab/tp fp32 values)",
    )
    eval_every: int = opt(50, "evaluate every N steps; 0 = never")
    eval_batches: int = opt(4, "batches per evaluation")
    log_every: int = opt(1, "progress line every N steps")
    gc_every: int = opt(50, "automatic GC off; collect on every rank every N steps")
    run_dir: str = opt("runs/default", "where the run's logs, metrics, timers and checkpoints go")
    tensorboard: bool = opt(True, "write TensorBoard scalars (grouped tags) under run_dir")
    wandb: bool = opt(False, "also log to Weights & Biases (pip install 'megascale[wandb]')")
    wandb_project: str = opt("megascale", "the W&B project")
    wandb_mode: Literal["online", "offline"] = opt(
        "online", "online, or offline: written under run_dir for a later `wandb sync`"
    )

    def validate(self) -> None:
        positive(
            self,
            "train",
            [
                "steps",
                "global_batch",
                "micro_batch",
                "log_every",
                "max_skipped_steps",
                "spike_skip_batches",
                "max_rollbacks",
                "loss_chunk",
            ],
        )
        at_least(self, "train", ("eval_every", "eval_batches", "gc_every"), 0)
        for key in ("dtype", "param_dtype", "reduce_dtype"):
            check_dtype(f"train.{key}", getattr(self, key))
        if self.memory_limit_gib < 0:
            raise ConfigError(f"train.memory_limit_gib must be >= 0 (0 = no limit), got {self.memory_limit_gib}")
        if self.spike_window < 8:
            raise ConfigError(
                f"train.spike_window must be >= 8 (a median of fewer losses is noise), got {self.spike_window}"
            )
        if self.spike_threshold <= 0:
            raise ConfigError(f"train.spike_threshold must be > 0, got {self.spike_threshold}")


def check_dtype(key: str, value: str) -> None:
    """fp32 or bf16. fp16 would need a dynamic loss scaler (its range is too small for
    gradients), which megascale does not have: refused by name rather than trained badly."""
    if value == "fp16":
        raise ConfigError(
            f"{key}='fp16' is not supported: fp16 needs a dynamic loss scaler, which "
            "megascale does not offer; use 'bf16' (same memory, fp32's range, no scaler needed)"
        )
    if value not in ("fp32", "bf16"):
        raise ConfigError(f"{key} must be one of ['fp32', 'bf16'], got {value!r}")


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
        for section in (
            self.model,
            self.optim,
            self.parallel,
            self.data,
            self.train,
            self.checkpoint,
            self.diagnostics,
            self.resilience,
        ):
            section.validate()
        self._validate_layout()

    @property
    def shares(self) -> BatchShares:
        """Each data-parallel replica's share of the global batch (`shares.py`)."""
        return BatchShares(self.train.global_batch, self.train.micro_batch, self.parallel.dp)

    @property
    def micro_batches(self) -> int:
        """Micro-batches per data-parallel rank per optimizer step: the most any replica runs
        (with uneven shares, `resilience.shrink='keep-batch'`, some run one fewer)."""
        return self.shares.most

    def micro_batches_of(self, dp_rank: int) -> int:
        """Micro-batches data-parallel replica `dp_rank` runs per optimizer step."""
        return self.shares.micro_batches(dp_rank)

    def _validate_layout(self) -> None:
        m, p, t = self.model, self.parallel, self.train
        self.shares.check(self.resilience.shrink)
        if t.spike_action == "rollback" and self.checkpoint.every <= 0:
            raise ConfigError(
                "train.spike_action='rollback' restores the last checkpoint: it needs "
                "checkpoint.every > 0 (or use spike_action='skip')"
            )
        check_tensor_parallel(m, p.tp, p.sequence_parallel)
        if p.cp > 1:
            check_context_parallel(m, p)
        check_expert_parallel(m, p)
        if p.ep > 1 and not self.shares.even and self.shares.total % p.ep:
            # ep groups are ep consecutive dp ranks: with ep | total the replicas taking one more fill whole groups
            raise ConfigError(
                f"parallel.ep={p.ep} with {self.shares.describe()}: an ep group's dp ranks exchange tokens "
                f"every micro-batch, so they must run the same count; with uneven shares "
                f"train.global_batch / train.micro_batch = {self.shares.total} must be a multiple of parallel.ep"
            )
        check_pipeline_split(m.layers, p.pp, p.vpp, p.pp_split)
        if p.vpp > 1 and p.schedule != "zbv" and {self.shares.fewest % p.pp, self.micro_batches % p.pp} != {0}:
            raise ConfigError(
                f"interleaved 1F1B needs micro-batches per step ({self.shares.describe()}: "
                f"global_batch / (micro_batch * dp)) to be a multiple of parallel.pp={p.pp}"
            )
        if p.pp > 1 and m.tie_embeddings:
            fix = (
                "this checkpoint's head is its embedding (checkpoint.init_from), so keep parallel.pp=1 and "
                "use parallel.tp or parallel.dp"
                if self.checkpoint.init_from
                else "set model.tie_embeddings=false or parallel.pp=1"
            )
            raise ConfigError(
                "model.tie_embeddings=true needs parallel.pp=1 (the embedding and the head live "
                f"on different pipeline stages); {fix}"
            )


def check_tensor_parallel(m: ModelConfig, tp: int, sequence_parallel: bool) -> None:
    """The model splits into `tp` slices: whole heads and key/value groups, whole MLP columns and, under sequence
    parallelism, equal sequence slices. Checked by `validate()` and again by tensor parallelism
    against the mesh it is given, before any collective."""
    if m.heads % tp:
        raise ConfigError(f"parallel.tp={tp} must divide model.heads={m.heads} (allowed tp: {divisors(m.heads)})")
    if m.kv_groups % tp:
        raise ConfigError(
            f"parallel.tp={tp} must divide model.kv_heads={m.kv_groups}: each tp rank holds whole "
            f"key/value heads (allowed tp: {divisors(m.kv_groups)})"
        )
    if m.ffn % tp:
        raise ConfigError(f"parallel.tp={tp} must divide the MLP width {m.ffn}")
    if sequence_parallel and tp > 1 and m.seq_len % tp:
        raise ConfigError(f"parallel.tp={tp} must divide model.seq_len={m.seq_len} with sequence parallelism")


def check_context_parallel(m: ModelConfig, p: ParallelConfig) -> None:
    """What ring attention (full causal, `parallel/ring.py`) or the halo exchange (a window,
    `parallel/context.py`) needs, and the combinations not built yet."""
    ring = m.window is None or m.window >= m.seq_len
    parts = 2 * p.cp if ring else p.cp
    if m.seq_len % parts:
        what = "2 * parallel.cp (ring attention: two chunks per rank)" if ring else "parallel.cp"
        raise ConfigError(f"{what} = {parts} must divide model.seq_len={m.seq_len}")
    local = m.seq_len // p.cp
    if not ring and m.window is not None and m.window - 1 > local:
        raise ConfigError(
            f"model.window={m.window} reaches past the previous cp rank's {local} positions "
            f"(seq_len / cp): use model.window <= {local + 1}, a smaller parallel.cp, or full attention "
            "(model.window unset: ring attention)"
        )
    if p.sequence_parallel and p.tp > 1 and local % p.tp:
        raise ConfigError(f"parallel.tp={p.tp} must divide seq_len / cp = {local} with sequence parallelism")


def check_expert_parallel(m: ModelConfig, p: ParallelConfig) -> None:
    """ep groups of consecutive dp ranks, each rank holding experts / ep whole experts of every MoE layer."""
    if m.moe.experts and m.moe.capacity_factor > 0 and (p.cp > 1 or (p.tp > 1 and p.sequence_parallel)):
        split = f"parallel.cp={p.cp}" if p.cp > 1 else f"parallel.tp={p.tp} and sequence parallelism"
        fix = "parallel.cp=1" if p.cp > 1 else "parallel.sequence_parallel=false or tp=1"
        raise ConfigError(
            f"model.moe.capacity_factor={m.moe.capacity_factor} with {split}: a token's place in its "
            "expert's queue spans the ranks holding parts of its sequence, which is not built yet; "
            f"use capacity_factor=0 (dropless) or {fix}"
        )
    if p.ep == 1:
        return
    if not m.moe.experts:
        raise ConfigError(f"parallel.ep={p.ep} needs MoE layers (model.moe.experts > 0); use parallel.ep=1")
    valid = [d for d in divisors(p.dp) if m.moe.experts % d == 0]
    if p.dp % p.ep or m.moe.experts % p.ep:
        raise ConfigError(
            f"parallel.ep={p.ep} must divide parallel.dp={p.dp} (ep is carved from dp) and model.moe.experts="
            f"{m.moe.experts} (each ep rank holds whole experts); valid parallel.ep: {valid}"
        )


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
