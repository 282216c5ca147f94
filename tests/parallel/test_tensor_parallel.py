"""Tensor + sequence parallelism trains the same model as one process.

Each multi-process test spawns its ranks once and loops over many layouts inside: every case
builds the full model from one seed, computes the single-process loss, logits and gradients in
the same rank, then shards a copy with `apply_tensor_parallel` on a real gloo mesh and checks
that the loss, the logits and this rank's slice of every parameter's gradient agree (fp32).
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from megascale.config.fields import ConfigError
from megascale.config.schema import (
    JobConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RopeScaling,
    check_tensor_parallel,
)
from megascale.layout.shard import shard_spec, tp_slice
from megascale.model.efficiency import set_loss_chunk
from megascale.model.gpt import GPT, IGNORE_INDEX
from megascale.optim import build_optimizer, clip_grad_norm_
from megascale.parallel.mesh import init_mesh
from megascale.parallel.tensor import apply_tensor_parallel, parallelize, sync_sequence_parallel_grads
from megascale.parallel.tp_comm import TPContext
from megascale.testing.launch import run_local

pytestmark = pytest.mark.timeout(300)

RTOL = 1e-5  # and an absolute tolerance of RTOL * the largest magnitude of the tensor
BATCH, SEQ = 2, 32


def model_config(**overrides) -> ModelConfig:
    base = dict(vocab_size=64, seq_len=SEQ, layers=2, hidden=64, heads=4)
    return ModelConfig(**{**base, **overrides})


def job_config(model: ModelConfig, tp: int, sp: bool, overlap: bool, chunks: int = 2) -> JobConfig:
    return JobConfig(
        model=model,
        parallel=ParallelConfig(tp=tp, sequence_parallel=sp, tp_overlap=overlap, tp_overlap_chunks=chunks),
    )


def batch(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    labels = (tokens * 7 + 3) % vocab  # learnable, so that training visibly moves the loss
    labels[0, :5] = IGNORE_INDEX
    labels[1, -3:] = IGNORE_INDEX
    return tokens, labels


def forward_backward(model: GPT, tokens, labels, mesh=None, bf16: bool = False) -> dict:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = model(tokens, labels)
        loss.backward()
        sync_sequence_parallel_grads(model.parameters(), None if mesh is None else mesh.tp_group)
        with torch.no_grad():
            logits = model(tokens).float()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return {"loss": loss.detach(), "logits": logits, "grads": grads, "model": model}


def close(got: torch.Tensor, want: torch.Tensor, label: str, rtol: float = RTOL) -> None:
    """fp32 parity: summation order differs between layouts, so elements near zero are held
    to the tensor's scale rather than to their own."""
    atol = rtol * float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{label}: {m}")


def compare(got: dict, want: dict, label: str, rtol: float = RTOL) -> None:
    """`got` is a tensor-parallel run, `want` the single-process one (whole gradients)."""
    close(got["loss"], want["loss"], label, rtol)
    close(got["logits"], want["logits"], label, rtol)
    params = dict(got["model"].named_parameters())
    assert params.keys() == want["grads"].keys(), label
    for name, grad in got["grads"].items():
        assert grad.dtype == torch.float32, f"{label}: {name} gradient is {grad.dtype}"
        expected = tp_slice(want["grads"][name], shard_spec(params[name]))
        close(grad, expected, f"{label}: {name}", rtol)


def _cases(tp: int) -> list[tuple[str, ModelConfig, bool, bool, int]]:
    """(label, model, sequence_parallel, overlap, chunks): the full matrix, then variants."""
    cases = []
    for block, window, sp in itertools.product(("serial", "parallel"), (None, 8), (True, False)):
        model = model_config(block=block, window=window)
        for overlap, chunks in ((True, 2), (False, 1)):
            label = f"tp={tp} {block} window={window} sp={sp} overlap={overlap}"
            cases.append((label, model, sp, overlap, chunks))
    # vocabulary not divisible by tp (replicated embedding/head), learned positions, tied
    # embeddings, no biases, uneven chunks
    for block, sp in itertools.product(("serial", "parallel"), (True, False)):
        odd = model_config(vocab_size=67, positions="learned", tie_embeddings=True, bias=False, block=block)
        cases.append((f"tp={tp} {block} vocab=67 learned tied no-bias sp={sp}", odd, sp, True, 3))
    tied = model_config(tie_embeddings=True, positions="learned", block="parallel")
    cases.append((f"tp={tp} parallel vocab-parallel tied learned", tied, True, True, 4))
    # Llama-family layers: grouped-query attention (whole key/value groups per rank), SwiGLU
    # (gate and up sliced together), RMSNorm, Llama-3 rotary scaling; Qwen 2's QKV-only bias in
    # the fused parallel block; GPT-NeoX's norm per branch, exact GeLU and partial rotary
    llama = dict(heads=8, kv_heads=4, norm="rmsnorm", mlp="swiglu", ffn_hidden=96, bias=False)
    scaling = RopeScaling(kind="llama3", factor=4.0, original_max_positions=16)
    cases.append(
        (
            f"tp={tp} llama gqa swiglu rmsnorm rope-scaled",
            model_config(block="serial", rope_scaling=scaling, **llama),
            True,
            True,
            2,
        )
    )
    cases.append(
        (
            f"tp={tp} parallel llama swa qkv-bias",
            model_config(block="parallel", window=8, qkv_bias=True, **llama),
            True,
            True,
            2,
        )
    )
    neox = model_config(block="parallel", parallel_norms=2, mlp="gelu_exact", rotary_fraction=0.25)
    cases.append((f"tp={tp} neox two norms partial rotary no-sp", neox, False, True, 2))
    # Qwen 3's query/key head norms: each rank normalises its heads (gradients summed over tp
    # with or without SP); in the fused parallel block too
    for block, sp in (("serial", True), ("parallel", False)):
        qk = model_config(block=block, qk_norm=True, **llama)
        cases.append((f"tp={tp} {block} llama qk-norm sp={sp}", qk, sp, True, 2))
    return cases


def _parity_rank(tp: int) -> list[str]:
    mesh = init_mesh(ParallelConfig(tp=tp), device="cpu")
    done = []
    try:
        results = {}
        for label, mcfg, sp, overlap, chunks in _cases(tp):
            tokens, labels = batch(mcfg.vocab_size, seed=7)
            torch.manual_seed(0)
            reference = GPT(mcfg)
            model = copy.deepcopy(reference)
            want = forward_backward(reference, tokens, labels)
            apply_tensor_parallel(model, job_config(mcfg, tp, sp, overlap, chunks).parallel, mesh)
            got = forward_backward(model, tokens, labels, mesh)
            compare(got, want, label)
            flagged = [n for n, p in model.named_parameters() if shard_spec(p).sp_partial]
            assert bool(flagged) == (sp or mcfg.qk_norm), label
            results[label] = got
            if not overlap:  # overlap on and off give the same numbers
                on = results[label.replace("overlap=False", "overlap=True")]
                close(got["loss"], on["loss"], label, rtol=1e-6)
                for name, grad in got["grads"].items():
                    close(grad, on["grads"][name], f"{label}: {name}", rtol=1e-6)
            done.append(label)
        # the head and loss in chunks of 24 tokens (64 per batch: an uneven last chunk), against
        # the single-process model's loss in one chunk; vocabulary-parallel (64) and replicated (67)
        for vocab, sp in itertools.product((64, 67), (True, False)):
            mcfg = model_config(vocab_size=vocab, block="parallel")
            tokens, labels = batch(vocab, seed=7)
            torch.manual_seed(0)
            reference = GPT(mcfg)
            model = copy.deepcopy(reference)
            want = forward_backward(reference, tokens, labels)
            apply_tensor_parallel(model, job_config(mcfg, tp, sp, True).parallel, mesh)
            set_loss_chunk(model, 24)
            compare(forward_backward(model, tokens, labels, mesh), want, f"tp={tp} vocab={vocab} sp={sp} loss_chunk=24")
            done.append(f"tp={tp} vocab={vocab} sp={sp} chunked loss")
        # bf16 autocast (the GPU training path, here on CPU): the collective GEMMs cast like
        # F.linear, communicate bf16 and return fp32 gradients; bf16 rounding tolerance
        for block in ("serial", "parallel"):
            mcfg = model_config(block=block, window=8)
            tokens, labels = batch(mcfg.vocab_size, seed=7)
            torch.manual_seed(0)
            reference = GPT(mcfg)
            model = copy.deepcopy(reference)
            want = forward_backward(reference, tokens, labels, bf16=True)
            apply_tensor_parallel(model, job_config(mcfg, tp, True, True, 2).parallel, mesh)
            got = forward_backward(model, tokens, labels, mesh, bf16=True)
            compare(got, want, f"tp={tp} {block} bf16 autocast", rtol=3e-2)
            done.append(f"tp={tp} {block} bf16")
        # a model the mesh cannot split stops before any collective: the group stays in step
        five_heads = model_config(hidden=40, heads=5)
        with pytest.raises(ConfigError, match=rf"tp={tp} must divide model.heads=5"):
            apply_tensor_parallel(GPT(five_heads), job_config(five_heads, tp, True, True).parallel, mesh)
        check = torch.ones(1)
        torch.distributed.all_reduce(check, group=mesh.tp_group)
        assert check.item() == tp
        return done
    finally:
        mesh.destroy()


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_parity_matrix(tp):
    done = run_local(_parity_rank, tp, (tp,), timeout_s=280)
    assert done[0] == done[-1] and len(done[0]) == len(_cases(tp)) + 6


def test_tp1_rewrite_in_process():
    """The tensor-parallel layers with a group of one rank (no collectives) match the model."""
    for block, sp, overlap in itertools.product(("serial", "parallel"), (True, False), (True, False)):
        mcfg = model_config(block=block, window=8)
        tokens, labels = batch(mcfg.vocab_size, seed=1)
        torch.manual_seed(0)
        reference = GPT(mcfg)
        model = copy.deepcopy(reference)
        want = forward_backward(reference, tokens, labels)
        parallelize(model, TPContext(None, 0, 1, sp, overlap, 3))
        compare(forward_backward(model, tokens, labels), want, f"tp=1 {block} sp={sp}")
    with pytest.raises(RuntimeError, match="already tensor-parallel"):
        parallelize(model, TPContext(None, 0, 1))


def _train(model: GPT, optim: OptimConfig, steps: int, vocab: int, mesh=None) -> list[float]:
    opt = build_optimizer(model.named_parameters(), optim)
    losses = []
    for step in range(steps):
        tokens, labels = batch(vocab, seed=100 + step)
        count = int((labels != IGNORE_INDEX).sum())
        loss = model(tokens, labels)
        (loss / count).backward()
        sync_sequence_parallel_grads(model.parameters(), None if mesh is None else mesh.tp_group)
        clip_grad_norm_(list(model.parameters()), optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item() / count)
    return losses


def _training_rank() -> list[tuple[str, list[float], list[float]]]:
    mesh = init_mesh(ParallelConfig(tp=2), device="cpu")
    out = []
    try:
        runs = [
            ("adamw parallel sp overlap", model_config(block="parallel"), "adamw", True),
            ("lamb serial swa sp overlap", model_config(block="serial", window=8), "lamb", True),
            ("lamb parallel no-sp", model_config(block="parallel"), "lamb", False),
        ]
        for label, mcfg, name, sp in runs:
            # a large lr and a tight clip so that every step moves and clipping is active
            optim = OptimConfig(name=name, lr=1e-2, weight_decay=0.1, grad_clip=0.5)
            torch.manual_seed(0)
            reference = GPT(mcfg)
            model = copy.deepcopy(reference)
            want = _train(reference, optim, 10, mcfg.vocab_size)
            apply_tensor_parallel(model, job_config(mcfg, 2, sp, True).parallel, mesh)
            got = _train(model, optim, 10, mcfg.vocab_size, mesh)
            # the weights after ten steps, too (Adam turns near-zero gradient noise into O(lr) steps)
            for name_, p in model.named_parameters():
                whole = dict(reference.named_parameters())[name_].detach()
                close(p.detach(), tp_slice(whole, shard_spec(p)), f"{label}: {name_}", rtol=2e-3)
            out.append((label, got, want))
        return out
    finally:
        mesh.destroy()


@pytest.mark.slow
def test_ten_steps_match_one_process():
    per_rank = run_local(_training_rank, 2, timeout_s=280)
    for rank_runs in per_rank:
        for label, got, want in rank_runs:
            assert got == pytest.approx(want, rel=1e-5), label
            assert want[-1] < want[0] - 0.05, f"{label}: the reference did not train {want}"
    assert per_rank[0] == per_rank[1]  # every tp rank reports the same losses


def test_bad_layouts_name_the_numbers(monkeypatch):
    bad_heads = job_config(model_config(), tp=3, sp=True, overlap=True)
    with pytest.raises(ConfigError, match=r"parallel.tp=3 must divide model.heads=4"):
        bad_heads.validate()
    with pytest.raises(ConfigError, match=r"tp=4 must divide model.heads=6"):
        check_tensor_parallel(model_config(hidden=48, heads=6), 4, sequence_parallel=True)
    with pytest.raises(ConfigError, match=r"tp=3 must divide model.seq_len=32 with sequence parallelism"):
        check_tensor_parallel(model_config(heads=3, hidden=48), 3, sequence_parallel=True)
    check_tensor_parallel(model_config(heads=3, hidden=48), 3, sequence_parallel=False)
    with pytest.raises(ConfigError, match=r"tp=4 must divide model.kv_heads=2: each tp rank holds whole key/value"):
        check_tensor_parallel(model_config(heads=8, kv_heads=2), 4, sequence_parallel=True)
    # world size mismatch: refused by the mesh before the process group exists
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match=r"1\*2\*1 = 2 but WORLD_SIZE=3"):
        init_mesh(ParallelConfig(tp=2), device="cpu")
    assert not torch.distributed.is_initialized()
