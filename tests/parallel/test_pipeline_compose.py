"""Pipeline composed with the other parallelisms on 4 gloo ranks; the losses of a few optimizer
steps equal one process training on the same data:
- ZeRO-2 through `build_runner` (pp=2, vpp=2, dp=2), which also exercises the runner's ZeRO
  hooks (before_forward / after_backward per chunk);
- tensor + sequence parallel blocks applied before splitting (pp=2, vpp=2, tp=2): activations
  cross stages sequence-sharded, a shape the runner learns from the wire."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megascale.diagnostics.timers import Timers, set_timers
from megascale.model import GPT
from megascale.optim import build_optimizer, clip_grad_norm_
from megascale.parallel import init_mesh
from megascale.parallel.engine import build_runner
from megascale.parallel.pipeline import PipelineRunner, split_model
from megascale.parallel.tensor import apply_tensor_parallel
from megascale.testing.launch import run_local
from tests.parallel.test_pipeline_parity import batches, job, reference, token_count

pytestmark = pytest.mark.timeout(240)

STEPS = 4


def _rank_main() -> list[float]:
    cfg = job(p=2, v=2, m=4)
    cfg.parallel.dp = 2
    cfg.train.global_batch *= 2
    cfg.validate()
    mesh = init_mesh(cfg.parallel, device="cpu")
    set_timers(Timers(mesh.rank, mesh.coords._asdict(), "test", None, enabled=True))
    try:
        torch.manual_seed(0)
        runner = build_runner(GPT(cfg.model), cfg, mesh)
        assert isinstance(runner, PipelineRunner) and runner.grad_sync is not None
        opt = build_optimizer(runner.optimizer_tensors(), cfg.optim)
        m = cfg.micro_batches
        losses = []
        for batch in batches(job(p=2, v=2, m=2 * m), STEPS):  # dp rank d takes its m of them
            tokens = token_count(batch)
            mine = type(batch)(
                batch.inputs[mesh.dp_rank * m : (mesh.dp_rank + 1) * m],
                batch.labels[mesh.dp_rank * m : (mesh.dp_rank + 1) * m],
            )
            loss_sum = runner.forward_backward(mine, tokens)
            runner.finish_grads()
            params = [t for _, t in runner.optimizer_tensors()]
            clip_grad_norm_(params, cfg.optim.grad_clip, across=[mesh.pp_group])
            opt.step()
            runner.zero_grad()
            runner.after_optimizer_step()
            dist.all_reduce(loss_sum)  # last stage's dp slices; other stages add zero
            losses.append(float(loss_sum) / tokens)
        return losses
    finally:
        mesh.destroy()


@pytest.mark.slow
def test_pipeline_with_zero_matches_single_process():
    cfg = job(p=2, v=2, m=8)  # the same global batch on one process
    ref_losses, _, _ = reference(cfg, batches(cfg, STEPS))
    results = run_local(_rank_main, 4, timeout_s=200)
    for rank, losses in enumerate(results):
        for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
            assert abs(a - b) < 1e-5, f"rank {rank} step {step}: {a} vs {b}"


def _tp_rank_main() -> list[float]:
    cfg = job(p=2, v=2, m=4)
    cfg.parallel.tp = 2
    cfg.model.vocab_size = 96  # divisible by tp: vocabulary-parallel embedding and loss
    cfg.validate()
    mesh = init_mesh(cfg.parallel, device="cpu")
    set_timers(Timers(mesh.rank, mesh.coords._asdict(), "test", None, enabled=True))
    try:
        torch.manual_seed(0)
        model = GPT(cfg.model)
        apply_tensor_parallel(model, cfg.parallel, mesh)
        runner = PipelineRunner(split_model(model, 2, 2, mesh.pp_rank), cfg, mesh)
        opt = build_optimizer(runner.optimizer_tensors(), cfg.optim)
        params = [t for _, t in runner.optimizer_tensors()]
        losses = []
        for batch in batches(cfg, STEPS):
            tokens = token_count(batch)
            loss_sum = runner.forward_backward(batch, tokens)
            runner.finish_grads()  # sums the sequence-parallel gradients over tp
            clip_grad_norm_(params, cfg.optim.grad_clip, across=[mesh.pp_group])
            opt.step()
            runner.zero_grad()
            dist.all_reduce(loss_sum, group=mesh.pp_group)
            losses.append(float(loss_sum) / tokens)
        return losses
    finally:
        mesh.destroy()


@pytest.mark.slow
def test_pipeline_over_tensor_parallel_blocks_matches_single_process():
    cfg = job(p=2, v=2, m=4)
    cfg.model.vocab_size = 96
    ref_losses, _, _ = reference(cfg, batches(cfg, STEPS))
    results = run_local(_tp_rank_main, 4, timeout_s=200)
    for rank, losses in enumerate(results):
        for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
            assert abs(a - b) < 1e-5, f"rank {rank} step {step}: {a} vs {b}"
