"""Layout parity harness: train a tiny GPT for a few steps on one process and on a parallel
layout with the same global batch, and return what is needed to compare them.

Each rank builds the model from the same seed, applies its layout with the real
`build_runner`, and runs the real `Trainer.train_step` (global token count over dp,
forward/backward of the micro-batches, gradient sync, clipping across pp, optimizer step,
parameter refresh, loss reduced to the true global mean: what the trainer reports). The final parameters are returned
as (name, ShardSpec, array) pieces, so the parent can put whole parameters back together.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from functools import partial

import torch

from megascale.checkpoint.state import shared_pieces
from megascale.checkpoint.stateful import CheckpointState, TrainState
from megascale.config.schema import (
    CheckpointConfig,
    JobConfig,
    ModelConfig,
    MoEConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
)
from megascale.data import TokenBatch
from megascale.diagnostics.timers import Timers
from megascale.layout.shard import shard_spec
from megascale.model import GPT, IGNORE_INDEX
from megascale.model.init import SeededValues, ValueSource
from megascale.optim import build_optimizer
from megascale.parallel.engine import build_runner
from megascale.parallel.mesh import ParallelMesh, init_mesh
from megascale.parallel.timed_comm import timed_all_reduce
from megascale.train.trainer import Trainer

# Five steps: two of warm-up and three at the full rate, past every code path a step has (ZeRO's
# buffers reused, the optimizer's moments non-zero). Each step is ~1.5 s of a 4-rank spawn on two
# cores (latency-bound collectives), and ten steps made the layout matrices ~4 minutes of the suite.
STEPS = 5
# fp32 everywhere. A layout changes only the order in which contributions are summed (per
# micro-batch, per rank, across dp/tp/pp), which perturbs gradients at ~1e-7 relative. Losses
# and gradient norms must agree to 1e-5 relative at every step. Final parameters (measured when
# the matrices ran ten steps; fewer only shrink the differences): after ten LAMB steps they
# differ by ~1e-7 (every element within 1e-5). AdamW at lr 1e-2 moves every element by ~lr per
# step whatever its gradient's size, so an element whose gradient is a near-cancelling sum (a
# GeLU unit that is almost off) turns the ~1e-7 summation noise into up to ~1e-4 after ten
# steps. Measured: tp2 layouts at most 7.0e-5 (dp2-tp2: 237 of 16632 elements above 1e-6, all
# in block 0's MLP), dp8 1.7e-5; LAMB on the same layouts <= 3.6e-7.
LOSS_RTOL = 1e-5
PARAM_ATOL = {"lamb": 1e-5, "adamw": 2e-4}
GLOBAL_BATCH = 8
SEED = 7


@dataclass(frozen=True)
class Case:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    optim: str = "adamw"
    overlap: bool = True
    split: tuple[int, ...] | None = None  # layers per pipeline chunk; None: `auto`
    model: str = "gpt"  # a key of MODELS
    dtype: str = "fp32"  # train.dtype and train.param_dtype
    lr: float = 1e-2
    schedule: str = "1f1b"  # parallel.schedule
    ep: int = 1  # expert parallelism (carved from dp; the MoE models)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def __str__(self) -> str:
        return (
            f"{self.model}-dp{self.dp}-tp{self.tp}-pp{self.pp}-v{self.vpp}{f'-cp{self.cp}' if self.cp > 1 else ''}"
            f"-{self.optim}"
            f"{'' if self.overlap else '-sync'}{'' if self.split is None else f'-split{list(self.split)}'}"
            f"{'' if self.dtype == 'fp32' else f'-{self.dtype}'}{'' if self.lr == 1e-2 else f'-lr{self.lr:g}'}"
            f"{'' if self.schedule == '1f1b' else f'-{self.schedule}'}"
            f"{'' if self.ep == 1 else f'-ep{self.ep}'}"
        )


# Tiny models whose sizes also exercise ZeRO padding (hidden 12, odd bias lengths). The
# Llama-style one: RMSNorm, SwiGLU, grouped-query attention (2 key/value heads for 4 query heads,
# so tp=2 splits whole groups), no biases.
LLAMA = ModelConfig(
    vocab_size=64,
    seq_len=8,
    layers=8,
    hidden=16,
    heads=4,
    kv_heads=2,
    ffn_hidden=20,
    block="serial",
    norm="rmsnorm",
    mlp="swiglu",
    bias=False,
)
MODELS = {
    "gpt": ModelConfig(vocab_size=64, seq_len=8, layers=8, hidden=12, heads=2, block="serial"),
    # the parallel block: tensor parallelism fuses its GEMMs (concatenated weights rebuilt in backward)
    "parallel": ModelConfig(vocab_size=64, seq_len=8, layers=4, hidden=12, heads=2, block="parallel"),
    "llama": LLAMA,
    # sliding-window attention for context parallelism: cp=2 holds 8 positions a rank, window 5
    # needs the previous rank's last 4
    "swa": ModelConfig(vocab_size=64, seq_len=16, layers=2, hidden=16, heads=4, kv_heads=2, window=5, block="serial"),
    # full causal attention for context parallelism: ring attention, cp=2 holds chunks 0 and 3 of 4
    "causal": ModelConfig(vocab_size=64, seq_len=16, layers=2, hidden=16, heads=4, kv_heads=2, block="serial"),
    # Mixture of experts in blocks 1 and 3 (every=2): 4 SwiGLU experts, top-2, a shared expert,
    # the balancing loss and z-loss on. "moe-skew": top-1 with a routing bias (DeepSeek-V3
    # balancing, `SkewedValues`) that sends every token to expert 0: one ep rank gets all rows.
    "moe": replace(LLAMA, layers=4, moe=MoEConfig(experts=4, top_k=2, every=2, ffn_hidden=12, shared_ffn_hidden=8)),
    # the same with a window (cp=2: the halo of 3 positions) and DeepSeek-V3's bias balancing on
    # top of the balancing loss: under cp every statistic of a rank's part of a sequence must be
    # summed over cp (the loss's counts per sequence, the bias's loads per step)
    "moe-swa": replace(
        LLAMA,
        layers=4,
        window=4,
        moe=MoEConfig(experts=4, top_k=2, every=2, ffn_hidden=12, shared_ffn_hidden=8, bias_balancing=True),
    ),
    "moe-skew": ModelConfig(
        vocab_size=64,
        seq_len=8,
        layers=2,
        hidden=16,
        heads=4,
        ffn_hidden=20,
        block="parallel",
        norm="rmsnorm",
        mlp="swiglu",
        bias=False,
        moe=MoEConfig(experts=4, top_k=1, normalize=False, bias_balancing=True),
    ),
}


class SkewedValues:
    """Seeded values, except a routing bias that makes every token choose expert 0."""

    def __init__(self, cfg: ModelConfig, seed: int) -> None:
        self.seeded = SeededValues(cfg, seed)

    def __call__(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name.endswith("mlp.expert_bias"):
            return torch.tensor([1e3] + [0.0] * (shape[0] - 1))
        return self.seeded(name, shape)


def values_for(case: Case, cfg: JobConfig) -> ValueSource | None:
    return SkewedValues(cfg.model, cfg.train.seed) if case.model == "moe-skew" else None


def job_config(case: Case, steps: int = STEPS) -> JobConfig:
    cfg = JobConfig(
        model=MODELS[case.model],
        optim=OptimConfig(name=case.optim, lr=case.lr, warmup_steps=2, weight_decay=0.1, grad_clip=0.3),
        parallel=ParallelConfig(
            dp=case.dp,
            tp=case.tp,
            pp=case.pp,
            ep=case.ep,
            vpp=case.vpp,
            cp=case.cp,
            pp_split="auto" if case.split is None else list(case.split),
            dp_overlap=case.overlap,
            schedule=case.schedule,
            backend="gloo",
        ),
        train=TrainConfig(
            steps=steps,
            global_batch=GLOBAL_BATCH,
            micro_batch=1,
            device="cpu",
            dtype=case.dtype,
            param_dtype=case.dtype,
            eval_every=0,
            tensorboard=False,
        ),
        checkpoint=CheckpointConfig(),
    )
    cfg.validate()
    return cfg


def global_batches(cfg: JobConfig, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random tokens with a few ignored labels, so dp ranks hold different token counts."""
    g = torch.Generator().manual_seed(SEED)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, cfg.model.vocab_size, (GLOBAL_BATCH, cfg.model.seq_len + 1), generator=g)
        labels = tokens[:, 1:].clone()
        labels[torch.rand(labels.shape, generator=g) < 0.2] = IGNORE_INDEX
        out.append((tokens[:, :-1], labels))
    return out


def rank_batch(inputs: torch.Tensor, labels: torch.Tensor, cfg: JobConfig, dp_rank: int) -> TokenBatch:
    """This dp rank's contiguous slice of the global batch, as [micro_batches, micro, seq]."""
    per = GLOBAL_BATCH // cfg.parallel.dp
    sl = slice(dp_rank * per, (dp_rank + 1) * per)
    shape = (cfg.micro_batches, cfg.train.micro_batch, cfg.model.seq_len)
    return TokenBatch(inputs[sl].reshape(shape), labels[sl].reshape(shape))


class StepTrainer(Trainer):
    """The real `Trainer.train_step` (token count, sync, clipping, loss reduction) on a model
    built here, without the data loaders, checkpoints and metrics of a full run."""

    def __init__(self, cfg: JobConfig, mesh: ParallelMesh, values: ValueSource | None = None) -> None:
        self.cfg, self.mesh, self.train_state = cfg, mesh, TrainState()  # step 0
        with torch.device("meta"):  # as the Trainer builds it: values after the layout
            model = GPT(cfg.model)
        if cfg.train.param_dtype == "bf16":
            model.to(torch.bfloat16)
        self.runner = build_runner(model, cfg, mesh, values)
        self.sum_over = partial(timed_all_reduce, mesh=mesh)  # as the Trainer: its step reads it
        self.optimizer = build_optimizer(self.runner.optimizer_tensors(), cfg.optim, self.sum_over)
        self.timers = Timers(mesh.rank, {}, "", None, enabled=False)
        self.init_numerics()


def train(case: Case, mesh: ParallelMesh | None = None, steps: int = STEPS) -> dict:
    """Run `steps` steps of `case` on this rank (mesh None = one process)."""
    cfg = job_config(case, steps)
    trainer = StepTrainer(cfg, mesh or init_mesh(cfg.parallel, device="cpu"), values_for(case, cfg))
    losses, norms, moved = [], [], {}
    initial = [t.detach().clone() for _, t in trainer.runner.optimizer_tensors()]
    for inputs, labels in global_batches(cfg, steps):
        record = trainer.train_step(rank_batch(inputs, labels, cfg, trainer.mesh.dp_rank))
        trainer.step += 1
        losses.append(record["loss"])
        norms.append(record["grad_norm"])
        moved = moved or masters_moved(trainer, initial)
    runner = trainer.runner
    if runner.grad_sync is not None:
        runner.grad_sync.wait_params()
    # numpy, not tensors: tensors cross process boundaries as shared fds that die with the rank
    pieces = [(name, shard_spec(p), p.detach().float().numpy().copy()) for name, p in runner.named_parameters()]
    return {"losses": losses, "norms": norms, "pieces": pieces, "precision": {**precision(trainer), "moved": moved}}


def masters_moved(trainer: StepTrainer, initial: list[torch.Tensor]) -> dict[str, tuple[int, int]]:
    """(elements that differ from `initial`, elements) of each master tensor on this rank
    (ZeRO's padding, which never moves, left out)."""
    out = {}
    for (name, t), before in zip(trainer.runner.optimizer_tensors(), initial, strict=True):
        valid = shard_spec(t).valid_numel
        out[name] = (int((t.detach() != before).flatten()[:valid].sum()), valid)
    return out


def precision(trainer: StepTrainer) -> dict:
    """Where fp32 is kept: the parameters' dtypes, the optimizer's tensors and state in memory,
    and as the checkpoint's save path (`shared_pieces`) would write them."""
    named = trainer.runner.optimizer_tensors()
    state = CheckpointState(
        model=trainer.runner, optimizer=trainer.optimizer, loader=None, train=trainer.train_state, rng=None
    )
    pieces, _ = shared_pieces(state)
    return {
        "params": sorted({str(p.dtype) for _, p in trainer.runner.named_parameters()}),
        "masters": sorted({str(t.dtype) for _, t in named}),
        "moments": sorted(
            {
                str(v.dtype)
                for s in trainer.optimizer.state.values()
                for v in s.values()
                if torch.is_tensor(v) and v.dim() > 0
            }
        ),
        "checkpoint": sorted({(piece.field, str(piece.tensor.dtype)) for piece in pieces}),
    }


def assemble(per_rank: list[list[tuple]]) -> dict[str, torch.Tensor]:
    """Whole parameters from every rank's (name, spec, tensor) pieces (tp slices joined)."""
    slices: dict[str, dict[int, tuple]] = {}
    for pieces in per_rank:
        for name, spec, tensor in pieces:
            slices.setdefault(name, {})[spec.tp_rank] = (spec, torch.as_tensor(tensor))
    whole = {}
    for name, by_rank in slices.items():
        spec = by_rank[0][0]
        if spec.tp_dim is None:
            whole[name] = by_rank[0][1]
        else:
            whole[name] = torch.cat([by_rank[r][1] for r in range(spec.tp_size)], spec.tp_dim)
    return whole


def run_cases(cases: list[Case], ports: list[int], steps: int = STEPS) -> list[dict]:
    """Rank entry point for `run_local`: every case in turn, each on its own mesh and port."""
    out = []
    for case, port in zip(cases, ports, strict=True):
        os.environ["MASTER_PORT"] = str(port)
        mesh = init_mesh(job_config(case).parallel, device="cpu")
        try:
            out.append(train(case, mesh, steps))
        finally:
            mesh.destroy()
    return out


def compare(case: Case, ranks: list[dict], ref: dict) -> dict[str, float]:
    """Assert that every rank reports the reference losses and that the whole parameters put
    together from all ranks equal the reference's; returns the largest differences."""
    loss_err = 0.0
    for r, run in enumerate(ranks):
        for got, want in ((run["losses"], ref["losses"]), (run["norms"], ref["norms"])):
            err = max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))
            assert err < LOSS_RTOL, f"{case} rank {r}: {got} != {want}"
            loss_err = max(loss_err, err)
    got = assemble([run["pieces"] for run in ranks])
    want = assemble([ref["pieces"]])
    assert got.keys() == want.keys(), f"{case}: parameter names differ"
    param_err = 0.0
    for name in want:
        assert got[name].shape == want[name].shape, f"{case}: {name} shape"
        err = (got[name] - want[name]).abs().max().item()
        assert err < PARAM_ATOL[case.optim], f"{case}: {name} differs by {err:.2e}"
        param_err = max(param_err, err)
    return {"loss_rel": loss_err, "param_abs": param_err}
