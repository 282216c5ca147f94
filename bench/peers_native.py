"""The PyTorch-native peer of megascale's parallel runtime (issue 22), composed the way the
torchtitan recipe composes it, around megascale's own GPT (the model code has no parallelism):

- tp: DTensor tensor + sequence parallel through `parallelize_module` -- the token embedding
  `RowwiseParallel` (vocabulary-split, output sequence-sharded), block linears
  `ColwiseParallel`/`RowwiseParallel(output_layouts=Shard(1))`, LayerNorms `SequenceParallel`,
  the output projection `ColwiseParallel` with vocabulary-split logits and `loss_parallel`;
- dp: FSDP2 `fully_shard(reshard_after_forward=False)` (ZeRO-2-like) on every block and on the
  stage, with gradient sync and resharding only after the last micro-batch;
- pp: `torch.distributed.pipelining` stages under `ScheduleInterleaved1F1B` (`Schedule1F1B`
  when v = 1; `ScheduleZBVZeroBubble`, stages in a V, against megascale's `zbv`), the model
  cut into the same chunks as megascale's;

then AdamW with global-norm clipping (the norm summed over pipeline stages, as torchtitan does).
Parameters get the values megascale gives them, `initial_value(name, seed)`, so both sides
train the same model on the same data and their losses must agree.

The parallel block `x + MLP(LN(x)) + Attn(LN(x))` gathers its one LayerNorm output once for
both branches (a `PrepareModuleOutput` to a replicated DTensor), so its backward is one
reduce-scatter, as megascale's; the serial block follows torchtitan's llama plan.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch
import torch._inductor.config
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.pipelining.schedules as pp_schedules
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from megascale.config.schema import JobConfig
from megascale.model import GPT, IGNORE_INDEX
from megascale.model.efficiency import apply_compile
from megascale.model.init import initial_value
from megascale.optim import lr_at

DIMS = ("pp", "dp", "tp")  # megascale's rank grid order: rank = (pp * dp + dp) * tp + tp


class StageModule(nn.Module):
    """Consecutive blocks of the GPT, with the embedding on the first stage and the final norm
    and vocabulary projection on the last; parameter names stay the single-process ones."""

    def __init__(self, model: GPT, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.embed = model.embed if first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        self.head = model.head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x)
        return x if self.head is None else self.head.logits(x)


def apply_tensor_parallel(part: StageModule, tp_mesh: DeviceMesh) -> None:
    """Megatron TP + SP with DTensor: the residual stream is sequence-sharded between blocks."""
    edges = {}
    if part.embed is not None:
        edges["embed.tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if part.head is not None:
        edges["head.norm"] = SequenceParallel()
        edges["head.out"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(part, tp_mesh, edges)
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    for block in part.blocks.values():
        plan = {
            "ln1": SequenceParallel(),
            "attn.qkv": ColwiseParallel(),
            "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
            "mlp.fc": ColwiseParallel(),
            "mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
        }
        if block.ln2 is not None:  # serial block: torchtitan's plan
            plan.update({"ln2": SequenceParallel(), "attn": gather, "mlp": gather})
        parallelize_module(block, tp_mesh, plan)
        if block.ln2 is None:  # parallel block: one gather of LN(x) feeds both branches
            parallelize_module(
                block,
                tp_mesh,
                {
                    "ln1": PrepareModuleOutput(
                        output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=False
                    )
                },
            )


@torch.no_grad()
def fill_initial_values(part: nn.Module, cfg: JobConfig) -> None:
    """Every parameter (plain or a DTensor shard) gets megascale's value for its name."""
    for name, p in part.named_parameters():
        whole = initial_value(name, tuple(p.shape), cfg.model, cfg.train.seed)
        if isinstance(p, DTensor):  # this rank's piece, cut locally (no communication)
            piece = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None)
            p.to_local().copy_(piece.to_local())
        else:
            p.copy_(whole)


class CommClock:
    """Host time blocked in this composition's communication, per mesh dimension.

    While `recording()`, the three places where it makes the host wait are wrapped: the
    synchronous c10d collectives (FSDP2's all-gather and reduce-scatter: on CPU it issues them
    without `async_op`), DTensor's `wait_tensor` (every tensor-parallel collective, the
    vocabulary-parallel loss included, is a functional collective waited for there), and the
    pipeline schedule's `_batch_p2p` and `_wait_batch_p2p` (each time step posts its sends and
    receives, then waits for all of them; megascale's p2p spans also cover posting a send).
    Collectives issued with `async_op=True` are counted in `untimed` (their wait is not seen)."""

    _SYNC = (
        "all_gather_single",
        "reduce_scatter_single",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "all_reduce",
    )

    def __init__(self, dims: dict[dist.ProcessGroup, str]) -> None:
        self.dims = dims
        self.seconds: dict[str, float] = defaultdict(float)
        self.untimed = 0

    def take(self) -> dict[str, float]:
        out, self.seconds = dict(self.seconds), defaultdict(float)
        return out

    def _timed(self, fn: Callable, dim: Callable[..., str]) -> Callable:
        def wrapper(*args, **kwargs):
            if kwargs.get("async_op"):
                self.untimed += 1
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[dim(*args, **kwargs)] += time.perf_counter() - start

        return wrapper

    def _group_dim(self, *args, group: dist.ProcessGroup | None = None, **kwargs) -> str:
        return self.dims.get(group, "world")

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        patches = [(dist, name, self._timed(getattr(dist, name), self._group_dim)) for name in self._SYNC]
        patches.append((funcol, "wait_tensor", self._timed(funcol.wait_tensor, lambda *a, **k: "tp")))
        for name in ("_batch_p2p", "_wait_batch_p2p"):  # posting, as megascale's pp.send spans do
            patches.append((pp_schedules, name, self._timed(getattr(pp_schedules, name), lambda *a, **k: "pp")))
        saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
        for module, name, wrapped in patches:
            setattr(module, name, wrapped)
        try:
            yield
        finally:
            for module, name, original in saved:
                setattr(module, name, original)


class NativePeer:
    """One rank of the torch-native composition for `cfg`'s layout; `train_step` is one optimizer
    step on this dp rank's micro-batches, returning the global mean token loss."""

    def __init__(self, cfg: JobConfig, device: torch.device, chunk_layers: list[range]) -> None:
        self.cfg, self.device = cfg, device
        par = cfg.parallel
        start = time.perf_counter()
        self.mesh = init_device_mesh(device.type, (par.pp, par.dp, par.tp), mesh_dim_names=DIMS)
        self.mesh_s = time.perf_counter() - start  # creating the sub-groups: start-up's group part
        self.groups = {d: self.mesh.get_group(d) if self.mesh[d].size() > 1 else None for d in DIMS}
        self.clock = CommClock({g: d for d, g in self.groups.items() if g is not None})
        self.step_index = 0
        self._tokens = 1  # loss-bearing tokens of the step's global batch
        self.optimizer_s = 0.0  # the last step's clipping and optimizer step (host time)
        self._losses: list[torch.Tensor] = []  # this step's micro-batch losses (last stage)
        pp_rank, chunks = self.mesh["pp"].get_local_rank(), par.pp * par.vpp
        zbv = par.schedule == "zbv"  # the V: rank r holds stages r and 2p-1-r
        stage_ids = [pp_rank, chunks - 1 - pp_rank] if zbv else [pp_rank + c * par.pp for c in range(par.vpp)]
        # async-TP: inductor fuses the TP collectives into the GEMMs of compiled blocks, but only
        # with NCCL and CUDA symmetric memory (its pass returns at once otherwise)
        self.async_tp = cfg.train.compile and par.tp > 1 and device.type == "cuda" and dist.is_nccl_available()
        torch._inductor.config._micro_pipeline_tp = self.async_tp
        with torch.device("meta"):
            model = GPT(cfg.model)
        self.parts = [StageModule(model, chunk_layers[s], s == 0, s == chunks - 1) for s in stage_ids]
        for part in self.parts:
            if par.tp > 1:
                apply_tensor_parallel(part, self.mesh["tp"])
            part.to_empty(device=device)
            fill_initial_values(part, cfg)
            if cfg.train.compile:  # per block, after TP and before FSDP (torchtitan's order)
                apply_compile(part.blocks)
            if par.dp > 1:
                for block in part.blocks.values():
                    fully_shard(block, mesh=self.mesh["dp"], reshard_after_forward=False)
                fully_shard(part, mesh=self.mesh["dp"], reshard_after_forward=False)
                for module in part.modules():  # the loss is already the global mean: sum, not
                    if isinstance(module, FSDPModule):  # average (and gloo has no PREMUL_SUM/AVG)
                        module.set_gradient_divide_factor(1.0)
                        module.set_force_sum_reduction_for_comms(True)
        self.has_first = 0 in stage_ids
        self.has_last = chunks - 1 in stage_ids
        self.schedule = None
        if par.pp > 1:
            stages = [
                PipelineStage(part, s, chunks, device, group=self.groups["pp"])
                for part, s in zip(self.parts, stage_ids, strict=True)
            ]
            kind = ScheduleZBVZeroBubble if zbv else ScheduleInterleaved1F1B if par.vpp > 1 else Schedule1F1B
            self.schedule = kind(
                stages if par.vpp > 1 else stages[0],
                n_microbatches=cfg.micro_batches,
                loss_fn=self._loss,
                scale_grads=False,
            )
        self.optimizer = torch.optim.AdamW(
            self._param_groups(), lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps
        )

    def _param_groups(self) -> list[dict]:
        """Weight decay on matrices, not on biases and norms (megascale's rule)."""
        decay, no_decay = [], []
        for part in self.parts:
            for name, p in part.named_parameters():
                (decay if p.ndim >= 2 and not name.endswith("bias") else no_decay).append(p)
        return [
            {"params": decay, "weight_decay": self.cfg.optim.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed token loss over the global token count (`loss_parallel` when logits are split)."""
        summed = F.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        return summed / self._tokens

    def _context(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        if self.cfg.parallel.tp > 1:
            stack.enter_context(loss_parallel())
        if self.cfg.train.dtype == "bf16":
            stack.enter_context(torch.autocast(self.device.type, dtype=torch.bfloat16))
        return stack

    def train_step(self, inputs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """`inputs`/`labels`: this dp rank's `[micro_batches * micro_batch, seq]` (ignored on
        middle pipeline stages); returns the loss and the gradient norm, the same on every rank."""
        count = (labels != IGNORE_INDEX).sum().to(self.device)
        if self.groups["dp"] is not None:
            dist.all_reduce(count, group=self.groups["dp"])
        self._tokens, self._losses = int(count), []
        for part in self.parts:
            part.train()
        with self.clock.recording(), self._context():
            self._forward_backward(inputs.to(self.device), labels.to(self.device))
        start = time.perf_counter()
        grad_norm = self._clip(self.cfg.optim.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step_index, self.cfg.optim, self.cfg.train.steps)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_s = time.perf_counter() - start
        self.step_index += 1
        return {"loss": self._global_loss(), "grad_norm": float(grad_norm)}

    def _forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor) -> None:
        if self.schedule is not None:
            args = (inputs,) if self.has_first else ()
            # the schedule's own list: its first step also runs the loss in shape inference
            losses = self._losses if self.has_last else None
            self.schedule.step(*args, target=labels if self.has_last else None, losses=losses, return_outputs=False)
            return
        model, m = self.parts[0], self.cfg.micro_batches
        for i, (x, y) in enumerate(zip(inputs.chunk(m), labels.chunk(m), strict=True)):
            if isinstance(model, FSDPModule):  # ZeRO-2: one reduce-scatter and one gather per step
                model.set_requires_gradient_sync(i == m - 1)
                model.set_reshard_after_backward(i == m - 1)
            loss = self._loss(model(x), y)
            loss.backward()
            self._losses.append(loss.detach())

    def _clip(self, max_norm: float) -> torch.Tensor:
        """Global gradient norm over every stage of the model, then clip (torchtitan's way)."""
        params = [p for part in self.parts for p in part.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        if self.groups["pp"] is not None:
            norm = norm**2
            dist.all_reduce(norm, group=self.groups["pp"])
            norm = norm.sqrt()
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
        return norm

    def _global_loss(self) -> float:
        """The last stage's micro-batch losses (each already over the global token count),
        summed over dp and pp."""
        local = torch.zeros((), dtype=torch.float64, device=self.device)
        for loss in self._losses:
            local += (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach().double()
        if self.has_last and self.groups["dp"] is not None:  # a dp group shares its pp stage
            dist.all_reduce(local, group=self.groups["dp"])
        if self.groups["pp"] is not None:  # stages without the last add zero
            dist.all_reduce(local, group=self.groups["pp"])
        return float(local)
