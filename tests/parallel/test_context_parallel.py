"""Context parallelism trains the same model as one process, and overlaps its transfers: the
halo exchange under a sliding window, ring attention under full causal attention.

One spawn of 4 gloo ranks on a mesh of cp=2 x dp=2 (the cp groups come from the rank grid),
then cp=4 over the world. Each case trains a tiny GPT 2 steps (SGD) on every rank both whole
and split along the sequence (contiguous parts with a window, the two mirrored chunks of ring
attention's load balance without): the token-weighted global loss (labels ignored unevenly, all
on rank 0's part) and the gradients summed over cp equal the single process's, for rotary and
learned positions and grouped-query attention. Ring attention alone equals causal SDPA in fp64
through both per-block kernels (fused, eager). The order of the transfers' post/wait against
the attention kernels (forward and backward) is recorded: every transfer must be in flight
while a kernel runs. Last, the real trainer (`layout_parity`) at cp2 x dp2, cp2 x tp2 and
cp2 x pp2, with a window and without, against one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megascale.config import ModelConfig, ParallelConfig
from megascale.model import GPT, sliding_window
from megascale.model.gpt import IGNORE_INDEX
from megascale.parallel import context, ring
from megascale.parallel.context import apply_context_parallel, split_sequence
from megascale.parallel.mesh import init_mesh
from megascale.parallel.store import free_port
from megascale.testing.launch import run_local

from layout_parity import Case, compare, run_cases, train  # isort: skip

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # one spawn: 105 s on the loaded 2-core machine

SEQ, STEPS = 32, 2
TRAINER_CASES = [
    Case(cp=2, dp=2, model="swa"),
    Case(cp=2, tp=2, model="swa"),
    Case(cp=2, dp=2, model="causal"),
    Case(cp=2, tp=2, model="causal"),
    Case(cp=2, pp=2, model="swa"),
    Case(cp=2, pp=2, model="causal"),
]
TRAINER_STEPS = 3
# positions, kv_heads, window (halo 6 / 8 <= 8 local positions; None: full attention, ring attention)
CASES = [("rotary", 2, 7), ("learned", 4, 9), ("rotary", 2, None), ("learned", 4, None)]


def _name(positions: str, window: int | None) -> str:
    return f"{positions}-{'ring' if window is None else 'halo'}"


def _train(cfg: ModelConfig, tokens: torch.Tensor, group=None, rank: int = 0, size: int = 1):
    model = GPT(cfg, seed=0)
    ring_layout = cfg.window is None
    if size > 1:
        apply_context_parallel(model, group, rank, size, ring_layout)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[:, :5] = IGNORE_INDEX
    count = int((labels != IGNORE_INDEX).sum())
    if size > 1:
        inputs, labels = (split_sequence(x, rank, size, 1, ring_layout) for x in (inputs, labels))
    losses, grads = [], []
    for _ in range(STEPS):
        loss = model(inputs, labels) / count
        loss.backward()
        total = loss.detach().clone()
        if size > 1:
            dist.all_reduce(total, group=group)
            for p in model.parameters():
                dist.all_reduce(p.grad, group=group)
        losses.append(total.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return losses, grads


def _record_order(group, rank: int, size: int) -> list[str]:
    """Events of one windowed attention's forward and backward on this rank."""
    events: list[str] = []
    kernel = context.sliding_window_attention
    originals = {name: getattr(context._Halo, name) for name in ("post", "wait", "post_grad", "wait_grad")}

    def recorded(q, k, v, window):
        part = "local" if q.shape[2] > window - 1 else "head"
        q = q.view_as(q)
        q.register_hook(lambda g: events.append(f"{part} backward done"))
        out = kernel(q, k, v, window)
        events.append(f"{part} forward done")
        return out

    def wrap(name):
        def call(self, *args):
            events.append(name)
            return originals[name](self, *args)

        return call

    context.sliding_window_attention = recorded
    for name in originals:
        setattr(context._Halo, name, wrap(name))
    try:
        g = torch.Generator().manual_seed(rank)
        q, k, v = (torch.randn(1, 2, 16, 8, generator=g).requires_grad_() for _ in range(3))
        context.ContextParallel(group, rank, size).attend(q, k, v, 5).sum().backward()
    finally:
        context.sliding_window_attention = kernel
        for name, fn in originals.items():
            setattr(context._Halo, name, fn)
    return events


def _record_ring_order(group, rank: int, size: int) -> list[tuple[str, int]]:
    """(event, step) of one ring attention's forward and backward: each transfer's post and wait
    (by its tag) and each block's kernel call."""
    events: list[tuple[str, int]] = []
    tags: dict[int, int] = {}
    post, wait = ring._Ring.post, ring._Ring.wait
    kernels = {"forward": ring.attention_with_lse, "backward": ring.attention_with_lse_backward}
    calls = {"forward": 0, "backward": 0}

    def posted(self, send, receive, tag):
        works = post(self, send, receive, tag)
        for work in works:
            tags[id(work)] = tag
        events.append(("post", tag))
        return works

    def waited(self, works):
        for work in works:
            events.append(("wait", tags[id(work)]))
        return wait(self, works)

    def kernel(name):
        def call(*args):
            out = kernels[name](*args)
            events.append((f"{name} kernel", calls[name]))
            calls[name] += 1
            return out

        return call

    ring._Ring.post, ring._Ring.wait = posted, waited
    ring.attention_with_lse, ring.attention_with_lse_backward = kernel("forward"), kernel("backward")
    try:
        g = torch.Generator().manual_seed(rank)
        q, k, v = (torch.randn(1, 2, 8, 4, generator=g).requires_grad_() for _ in range(3))
        context.ContextParallel(group, rank, size, ring=True).attend(q, k, v, None).sum().backward()
    finally:
        ring._Ring.post, ring._Ring.wait = post, wait
        ring.attention_with_lse, ring.attention_with_lse_backward = kernels["forward"], kernels["backward"]
    return events


def _ring_kernel_errors(group, rank: int, size: int) -> dict[str, float]:
    """Ring attention's output and q/k/v gradients against causal SDPA on the whole sequence (fp64),
    through the fused CPU kernel and the eager one."""
    g = torch.Generator().manual_seed(0)
    whole = [torch.randn(2, heads, 24, 8, generator=g, dtype=torch.float64).requires_grad_() for heads in (4, 2, 2)]
    grad = torch.randn(whole[0].shape, generator=g, dtype=torch.float64)
    want = torch.nn.functional.scaled_dot_product_attention(*whole, is_causal=True, enable_gqa=True)
    want.backward(grad)
    errors = {}
    fused = sliding_window._fused
    for name, choice in (("fused", fused), ("eager", lambda q: False)):
        sliding_window._fused = choice
        try:
            part = [split_sequence(x.detach(), rank, size, 2, True).requires_grad_() for x in whole]
            out = context.ContextParallel(group, rank, size, ring=True).attend(*part, None)
            out.backward(split_sequence(grad, rank, size, 2, True))
        finally:
            sliding_window._fused = fused
        pairs = [(out, want.detach())] + [(p.grad, w.grad) for p, w in zip(part, whole, strict=True)]
        errors[name] = max((a - split_sequence(b, rank, size, 2, True)).abs().max().item() for a, b in pairs)
    return errors


def _job(ports: list[int]) -> dict:
    mesh = init_mesh(ParallelConfig(cp=2, dp=2), device="cpu")
    out: dict = {"cp_group": mesh.grid.group_of(mesh.rank, "cp"), "errors": {}}
    try:
        tokens = torch.randint(0, 64, (2, SEQ + 1), generator=torch.Generator().manual_seed(0))
        layouts = {"cp2": (mesh.cp_group, mesh.cp_rank, 2), "cp4": (dist.group.WORLD, mesh.rank, 4)}
        for positions, kv_heads, window in CASES:
            cfg = ModelConfig(
                vocab_size=64,
                seq_len=SEQ,
                layers=2,
                hidden=32,
                heads=4,
                kv_heads=kv_heads,
                window=window,
                positions=positions,
            )
            want_losses, want_grads = _train(cfg, tokens)
            for name, (group, rank, size) in layouts.items():
                losses, grads = _train(cfg, tokens, group, rank, size)
                case = f"{name}-{_name(positions, window)}"
                out["errors"][case] = {
                    "loss": max(abs(a - b) for a, b in zip(losses, want_losses, strict=True)),
                    "grad": max(
                        (g[n] - w[n]).abs().max().item() for g, w in zip(grads, want_grads, strict=True) for n in w
                    ),
                    "loss_moved": want_losses[0] - want_losses[-1],
                }
        out["order"] = _record_order(dist.group.WORLD, mesh.rank, 4)
        out["ring_order"] = _record_ring_order(dist.group.WORLD, mesh.rank, 4)
        out["ring_kernel"] = _ring_kernel_errors(dist.group.WORLD, mesh.rank, 4)
    finally:
        mesh.destroy()
    out["trainer"] = run_cases(TRAINER_CASES, ports, TRAINER_STEPS)  # the real Trainer.train_step
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_local(_job, 4, args=([free_port() for _ in TRAINER_CASES],), timeout_s=280)


def test_the_rank_grid_puts_cp_next_to_tp(results):
    assert [r["cp_group"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]


@pytest.mark.parametrize("case", [f"{cp}-{_name(p, w)}" for cp in ("cp2", "cp4") for p, _, w in CASES])
def test_losses_and_gradients_equal_one_process(results, case):
    for rank, r in enumerate(results):
        err = r["errors"][case]
        assert err["loss_moved"] > 0.01, err  # the steps trained: step 2 sees step 1's update
        assert err["loss"] < 1e-6 and err["grad"] < 1e-6, f"rank {rank}: {err}"


def test_the_halo_is_in_flight_while_the_local_attention_runs(results):
    for rank, r in enumerate(results):
        events = r["order"]
        fwd = events.index("post"), events.index("local forward done"), events.index("wait")
        assert fwd[0] < fwd[1] < fwd[2] < events.index("head forward done"), (rank, events)
        bwd = events.index("post_grad"), events.index("local backward done"), events.index("wait_grad")
        assert events.index("head backward done") < bwd[0] < bwd[1] < bwd[2], (rank, events)


def test_ring_attention_equals_causal_attention_through_both_kernels(results):
    for rank, r in enumerate(results):
        assert max(r["ring_kernel"].values()) < 1e-12, (rank, r["ring_kernel"])


def test_each_ring_transfer_is_in_flight_while_a_block_is_computed(results):
    """Forward: step i's send/receive of the next block's keys/values is posted before the kernel
    call on the block held and waited for after it. Backward: the same for the keys/values and for
    the receive of the next block's gradient accumulator (its send follows the kernel call that
    adds to it)."""
    for rank, r in enumerate(results):
        events = [tuple(e) for e in r["ring_order"]]
        for step in range(3):  # 4 ranks: 3 transfers of keys/values each way
            for tag, kernel in ((ring.FORWARD_TAG, "forward kernel"), (ring.BACKWARD_TAG, "backward kernel")):
                posted, computed = events.index(("post", tag + step)), events.index((kernel, step))
                assert posted < computed < events.index(("wait", tag + step)), (rank, step, events)
        for step in range(4):  # gradient accumulators: received during step `step`'s kernel call
            received = events.index(("post", ring.GRAD_TAG + step))
            assert received < events.index(("backward kernel", step)) < events.index(("wait", ring.GRAD_TAG + step))


@pytest.mark.parametrize("index", range(len(TRAINER_CASES)), ids=[str(c) for c in TRAINER_CASES])
def test_the_trainer_under_cp_trains_as_one_process(results, index):
    """build_runner + Trainer.train_step: the loader's batch split by cp, the token count and the
    loss over dp and cp, gradients summed over cp after ZeRO; cp2 x dp2, cp2 x tp2 and cp2 x pp2
    (the pipeline's activations are a rank's part of the sequence), SWA and full attention."""
    reference = train(Case(model=TRAINER_CASES[index].model), steps=TRAINER_STEPS)
    compare(TRAINER_CASES[index], [r["trainer"][index] for r in results], reference)
