"""The chunked all-gather+GEMM and GEMM+reduce-scatter against plain single-process GEMMs.

Every rank builds the same whole tensors from one seed, runs the collective GEMM on its pieces
and checks the forward output and the input, weight and bias gradients against its slice of
the whole computation, for several chunk counts (even, uneven, more chunks than positions)
with overlap on and off. The timer spans of the collective waits are checked too: they are how
exposed communication is measured.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megascale.config.schema import ParallelConfig
from megascale.diagnostics.timers import Timers, set_timers
from megascale.model.loss import chunked_cross_entropy
from megascale.parallel.collective_gemm import all_gather_matmul, chunk_ranges, matmul_reduce_scatter
from megascale.parallel.mesh import init_mesh
from megascale.parallel.tp_comm import TPContext, copy_to_tp, vocab_combine
from megascale.testing.launch import run_local

pytestmark = pytest.mark.timeout(200)

BATCH, LOCAL_SEQ, K, N = 2, 6, 12, 8  # LOCAL_SEQ = 6: chunk counts 4 and 5 are uneven


def close(got: torch.Tensor, want: torch.Tensor, label: str) -> None:
    atol = 1e-5 * float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=atol, msg=lambda m: f"{label}: {m}")


def whole_tensors(tp: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    seq = LOCAL_SEQ * tp
    return {
        "x": torch.randn(BATCH, seq, K, generator=g),
        "w": torch.randn(N * tp, K, generator=g),
        "b": torch.randn(N * tp, generator=g),
        "gy": torch.randn(BATCH, seq, N * tp, generator=g),  # upstream gradient
        "x_row": torch.randn(BATCH, seq, K * tp, generator=g),
        "w_row": torch.randn(N, K * tp, generator=g),
        "gz": torch.randn(BATCH, seq, N, generator=g),
    }


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def check_all_gather_matmul(t: dict, tp: TPContext, label: str) -> None:
    x, w, b = leaf(t["x"]), leaf(t["w"]), leaf(t["b"])
    (x @ w.t() + b).mul(t["gy"]).sum().backward()
    seq = slice(tp.rank * LOCAL_SEQ, (tp.rank + 1) * LOCAL_SEQ)
    cols = slice(tp.rank * N, (tp.rank + 1) * N)
    xl, wl, bl = leaf(t["x"][:, seq]), leaf(t["w"][cols]), leaf(t["b"][cols])
    y = all_gather_matmul(xl, wl, bl, tp)
    close(y, (t["x"] @ t["w"].t() + t["b"])[..., cols], f"{label} AG+GEMM forward")
    y.mul(t["gy"][..., cols]).sum().backward()
    close(xl.grad, x.grad[:, seq], f"{label} AG+GEMM grad x")
    close(wl.grad, w.grad[cols], f"{label} AG+GEMM grad w")
    close(bl.grad, b.grad[cols], f"{label} AG+GEMM grad b")


def check_matmul_reduce_scatter(t: dict, tp: TPContext, label: str) -> None:
    x, w = leaf(t["x_row"]), leaf(t["w_row"])
    (x @ w.t()).mul(t["gz"]).sum().backward()
    seq = slice(tp.rank * LOCAL_SEQ, (tp.rank + 1) * LOCAL_SEQ)
    ks = slice(tp.rank * K, (tp.rank + 1) * K)
    xl, wl = leaf(t["x_row"][..., ks]), leaf(t["w_row"][:, ks])
    z = matmul_reduce_scatter(xl, wl, tp)
    close(z, (t["x_row"] @ t["w_row"].t())[:, seq], f"{label} GEMM+RS forward")
    z.mul(t["gz"][:, seq]).sum().backward()
    close(xl.grad, x.grad[..., ks], f"{label} GEMM+RS grad x")
    close(wl.grad, w.grad[:, ks], f"{label} GEMM+RS grad w")


def check_vocab_parallel_loss(tp: TPContext) -> None:
    """The chunked loss on this rank's vocabulary rows (one all-gather per chunk) gives the whole
    loss on every rank and this rank's rows of the whole gradients (the input's summed over tp)."""
    g = torch.Generator().manual_seed(5)
    vocab = 10 * tp.size
    x, w = torch.randn(40, 6, generator=g), torch.randn(vocab, 6, generator=g)
    labels = torch.randint(0, vocab, (40,), generator=g)
    labels[::7] = -100
    xw, ww = leaf(x), leaf(w)
    want = torch.nn.functional.cross_entropy(xw @ ww.t(), labels, ignore_index=-100, reduction="sum")
    want.backward()
    rows = slice(tp.rank * 10, (tp.rank + 1) * 10)
    xl, wl = leaf(x), leaf(w[rows])
    for chunk in (40, 9):
        xl.grad = wl.grad = None
        loss = chunked_cross_entropy(copy_to_tp(xl, tp), wl, labels, chunk, tp.rank * 10, vocab_combine(tp))
        loss.backward()
        close(loss, want.detach(), f"vocab-parallel loss chunk={chunk}")
        close(wl.grad, ww.grad[rows], f"vocab-parallel grad w chunk={chunk}")
        close(xl.grad, xw.grad, f"vocab-parallel grad x chunk={chunk}")


def _rank(tp_size: int, out_dir: str) -> dict:
    mesh = init_mesh(ParallelConfig(tp=tp_size), device="cpu")
    try:
        t = whole_tensors(tp_size)
        for overlap in (True, False):
            for chunks in (1, 2, 4, 5, 16):  # 16 > LOCAL_SEQ: as many chunks as positions
                tp = TPContext(mesh.tp_group, mesh.tp_rank, tp_size, True, overlap, chunks)
                label = f"tp={tp_size} overlap={overlap} chunks={chunks}"
                check_all_gather_matmul(t, tp, label)
                check_matmul_reduce_scatter(t, tp, label)
        check_vocab_parallel_loss(TPContext(mesh.tp_group, mesh.tp_rank, tp_size))
        # every collective wait is a comm span: count them for one overlapped pass
        timers = Timers(mesh.rank, {"tp": mesh.tp_rank}, "test", out_dir, enabled=True)
        set_timers(timers)
        tp = TPContext(mesh.tp_group, mesh.tp_rank, tp_size, True, True, 3)
        check_all_gather_matmul(t, tp, "timed")
        check_matmul_reduce_scatter(t, tp, "timed")
        totals = timers.end_step(1)
        timers.close()
        dist.barrier(group=mesh.tp_group)
        return {"comm": totals["comm"], "path": str(timers.path)}
    finally:
        mesh.destroy()


@pytest.mark.parametrize("tp", [2, 3])
def test_collective_gemms_match_plain_gemms(tp, tmp_path):
    results = run_local(_rank, tp, (tp, str(tmp_path)), timeout_s=180)
    for r in results:
        assert r["comm"] > 0
        spans = [json.loads(line) for line in Path(r["path"]).read_text().splitlines()]
        names = [s["name"] for s in spans if s["kind"] == "comm"]
        # 3 chunks each: AG forward + RS backward of AG+GEMM, RS forward + AG backward of GEMM+RS
        assert names.count("tp.all_gather") == 6 and names.count("tp.reduce_scatter") == 6
        assert all(s["attrs"]["group"] == "tp" for s in spans if s["kind"] == "comm")


def test_single_rank_group_and_gradcheck():
    """With a group of one the operators are plain GEMMs; gradcheck their backward in fp64."""
    tp = TPContext(None, 0, 1, True, True, 3)
    x = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: all_gather_matmul(x, w, b, tp), (x, w, b))
    assert torch.autograd.gradcheck(lambda x, w: matmul_reduce_scatter(x, w, tp), (x, w))


def test_bf16_autocast_casts_like_linear():
    """Under autocast the GEMMs (and so the collectives) run in bf16, gradients come back in
    the inputs' fp32, and the weight gradient is accumulated over chunks in fp32."""
    tp = TPContext(None, 0, 1, True, True, 3)
    t = whole_tensors(1)
    cases = (
        (lambda x, w, b: all_gather_matmul(x, w, b, tp), (t["x"], t["w"], t["b"])),
        (lambda x, w: matmul_reduce_scatter(x, w, tp), (t["x_row"], t["w_row"])),
    )
    for call, args in cases:
        fp32 = [leaf(a) for a in args]
        bf16 = [leaf(a) for a in args]
        want = call(*fp32)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = call(*bf16)
        assert got.dtype == torch.bfloat16
        want.sum().backward()
        got.float().sum().backward()
        for a, b in zip(bf16, fp32, strict=True):
            assert a.grad.dtype == torch.float32
            scale = float(b.grad.abs().max())
            torch.testing.assert_close(a.grad, b.grad, rtol=2e-2, atol=2e-2 * scale)
        scale = float(want.detach().abs().max())
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * scale)


def test_chunk_ranges():
    assert chunk_ranges(6, 4) == [(0, 1), (1, 3), (3, 4), (4, 6)]
    assert chunk_ranges(6, 1) == [(0, 6)]
    assert chunk_ranges(3, 8) == [(0, 1), (1, 2), (2, 3)]
