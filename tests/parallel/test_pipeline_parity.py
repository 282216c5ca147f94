"""Pipeline parity on real gloo processes: loss, every gradient and five optimizer steps equal the
single-process model with the same weights, for (p, v) in {(2,1), (2,2), (4,1), (4,2)}, GPipe,
ZB-H1 and ZB-V (split backward; ZB-V's chunks in a V, m = 2p-1 at p = 4) at p = 2 and 4; and,
on two ranks, the ZeRO hooks' placement, the per-action timer spans, and by order that ZB-H1
defers the weight gradients to its W actions.

One spawn per world size; each rank loops over the cases and also computes the single-process
reference itself (the model is tiny), so a mismatch names the rank, the case and the parameter.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megascale.config import JobConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from megascale.data import TokenBatch
from megascale.diagnostics.timers import Timers, set_timers
from megascale.model import GPT, IGNORE_INDEX
from megascale.optim import build_optimizer, clip_grad_norm_
from megascale.parallel import init_mesh, weight_grad
from megascale.parallel.pipeline import PipelineRunner, split_model
from megascale.parallel.pipeline.schedule import V_SHAPED
from megascale.testing.launch import run_local

pytestmark = pytest.mark.timeout(300)

STEPS = 5  # each a schedule of latency-bound p2p; ten took 73 s at p = 4 in a loaded CI run


def job(p: int, v: int, m: int, schedule: str = "1f1b") -> JobConfig:
    cfg = JobConfig(
        model=ModelConfig(vocab_size=97, seq_len=32, layers=8, hidden=64, heads=4),
        optim=OptimConfig(name="adamw", lr=3e-3, warmup_steps=0, grad_clip=0.5),
        parallel=ParallelConfig(pp=p, vpp=v, schedule=schedule),
        train=TrainConfig(micro_batch=2, global_batch=2 * m, device="cpu"),
    )
    cfg.validate()
    return cfg


def batches(cfg: JobConfig, steps: int) -> list[TokenBatch]:
    g = torch.Generator().manual_seed(7)
    shape = (cfg.micro_batches, cfg.train.micro_batch, cfg.model.seq_len)
    out = []
    for _ in range(steps):
        inputs = torch.randint(0, cfg.model.vocab_size, shape, generator=g)
        labels = torch.randint(0, cfg.model.vocab_size, shape, generator=g)
        labels[..., :3] = IGNORE_INDEX  # some positions carry no loss
        out.append(TokenBatch(inputs, labels))
    return out


def token_count(batch: TokenBatch) -> int:
    return int((batch.labels != IGNORE_INDEX).sum())


def reference(cfg: JobConfig, data: list[TokenBatch]) -> tuple[list[float], dict, float]:
    """Single process: first step's gradients, eval loss, and the losses of STEPS steps."""
    torch.manual_seed(0)
    model = GPT(cfg.model)
    opt = build_optimizer(model.named_parameters(), cfg.optim)
    losses, first_grads, eval_loss = [], {}, 0.0
    for step, batch in enumerate(data):
        tokens = token_count(batch)
        total = 0.0
        for inputs, labels in zip(batch.inputs, batch.labels, strict=True):
            loss = model(inputs, labels)
            (loss / tokens).backward()
            total += float(loss.detach())
        losses.append(total / tokens)
        if step == 0:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            with torch.no_grad():
                pairs = zip(batch.inputs, batch.labels, strict=True)
                eval_loss = sum(float(model(i, lab)) for i, lab in pairs)
        clip_grad_norm_(list(model.parameters()), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, first_grads, eval_loss


def pipelined(cfg: JobConfig, mesh, data: list[TokenBatch]) -> tuple[list[float], dict, float]:
    """The same on this rank's pipeline chunks; losses reduced over the pipeline group."""
    torch.manual_seed(0)
    model = GPT(cfg.model)
    v_shape = cfg.parallel.schedule in V_SHAPED
    chunks = split_model(model, cfg.parallel.pp, cfg.parallel.vpp, mesh.pp_rank, v_shape=v_shape)
    runner = PipelineRunner(chunks, cfg, mesh)
    needs_data = any(c.is_first or c.is_last for c in chunks)
    opt = build_optimizer(runner.optimizer_tensors(), cfg.optim)
    params = [t for _, t in runner.optimizer_tensors()]
    losses, first_grads, eval_loss = [], {}, 0.0
    for step, batch in enumerate(data):
        tokens = token_count(batch)
        loss_sum = runner.forward_backward(batch if needs_data else None, tokens)
        torch.distributed.all_reduce(loss_sum, group=mesh.pp_group)
        losses.append(float(loss_sum) / tokens)
        if step == 0:
            first_grads = {n: p.grad.clone() for n, p in runner.named_parameters()}
            ev = runner.eval_loss_sum(batch if needs_data else None)
            torch.distributed.all_reduce(ev, group=mesh.pp_group)
            eval_loss = float(ev)
        clip_grad_norm_(params, cfg.optim.grad_clip, across=[mesh.pp_group])
        opt.step()
        runner.zero_grad()
    return losses, first_grads, eval_loss


class HookRecorder:
    """Stands where ZeRO's grad_sync goes: records the hook calls, and at `after_backward(c)`
    copies chunk c's gradients, which must already be final then."""

    def __init__(self, chunks: list) -> None:
        self.chunks = chunks
        self.calls: list[tuple[str, int]] = []
        self.grads_at_hook: dict[int, list[torch.Tensor]] = {}

    def before_forward(self, chunk: int) -> None:
        self.calls.append(("before_forward", chunk))

    def after_backward(self, chunk: int) -> None:
        self.calls.append(("after_backward", chunk))
        self.grads_at_hook[chunk] = [p.grad.clone() for p in self.chunks[chunk].parameters()]


def hooks_and_timers(mesh, out_dir: str) -> dict:
    """One interleaved step with the hook recorder and file-backed timers."""
    cfg = job(2, 2, 4)
    timers = Timers(mesh.rank, mesh.coords._asdict(), "test", out_dir, enabled=True)
    set_timers(timers)
    torch.manual_seed(0)
    chunks = split_model(GPT(cfg.model), 2, 2, mesh.pp_rank)
    runner = PipelineRunner(chunks, cfg, mesh)
    runner.grad_sync = recorder = HookRecorder(chunks)
    batch = batches(cfg, 1)[0]
    runner.forward_backward(batch, token_count(batch))
    timers.end_step(1)
    timers.close()
    final_ok = all(
        torch.equal(g, p.grad)
        for c, grads in recorder.grads_at_hook.items()
        for g, p in zip(grads, chunks[c].parameters(), strict=True)
    )
    return {"calls": recorder.calls, "final_ok": final_ok, "path": str(timers.path)}


def weight_order(mesh) -> dict:
    """One ZB-H1 step with every B, every W and every parameter's gradient accumulation (ZeRO's
    hook) logged in order, and the hook recorder where ZeRO's grad_sync goes."""
    cfg = job(2, 1, 4, "zb-h1")
    torch.manual_seed(0)
    chunks = split_model(GPT(cfg.model), 2, 1, mesh.pp_rank)
    runner = PipelineRunner(chunks, cfg, mesh)
    runner.grad_sync = recorder = HookRecorder(chunks)
    events: list[tuple] = []
    for name, p in chunks[0].named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, n=name: events.append(("grad", n)))
    compute, run = runner._compute, weight_grad.run

    def logged_compute(a, step, timers):
        events.append((a.op.value, a.mb))
        compute(a, step, timers)
        events.append(("end",))

    def logged_run(work):
        events.append(("W", len(events)))
        run(work)
        events.append(("end",))

    runner._compute, weight_grad.run = logged_compute, logged_run
    try:
        batch = batches(cfg, 1)[0]
        runner.forward_backward(batch, token_count(batch))
    finally:
        weight_grad.run = run
    final_ok = all(
        torch.equal(g, p.grad) for g, p in zip(recorder.grads_at_hook[0], chunks[0].parameters(), strict=True)
    )
    return {
        "events": events,
        "calls": recorder.calls,
        "final_ok": final_ok,
        "params": [n for n, _ in chunks[0].named_parameters()],
    }


def _rank_main(cases: list[tuple[int, int, int, str]], out_dir: str | None = None) -> dict:
    p = cases[0][0]
    mesh = init_mesh(ParallelConfig(pp=p), device="cpu")
    set_timers(Timers(mesh.rank, mesh.coords._asdict(), "test", None, enabled=True))
    report = {}
    try:
        if out_dir is not None:
            report["hooks"] = hooks_and_timers(mesh, out_dir)
            report["weight_order"] = weight_order(mesh)
        for p_, v, m, schedule in cases:
            cfg = job(p_, v, m, schedule)
            data = batches(cfg, STEPS)
            ref_losses, ref_grads, ref_eval = reference(cfg, data)
            losses, grads, ev = pipelined(cfg, mesh, data)
            names = sorted(grads)
            errs = {n: float((grads[n] - ref_grads[n]).abs().max()) for n in names}
            scale = max(float(ref_grads[n].abs().max()) for n in names)
            report[(v, m, schedule)] = {
                "names": names,
                "max_grad_err": max(errs.values()) / scale,
                "worst": max(errs, key=errs.get),
                "loss_err": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
                "eval_err": abs(ev - ref_eval) / ref_eval,
                "losses": losses,
            }
    finally:
        mesh.destroy()
    return report


def _check(results: list[dict], cases, layers: int = 8) -> None:
    all_names: set[str] = set()
    for _, v, m, schedule in cases:
        per_rank = [r[(v, m, schedule)] for r in results]
        names = [n for r in per_rank for n in r["names"]]
        assert len(names) == len(set(names)), "a parameter lives on two pipeline ranks"
        all_names = set(names)
        for rank, r in enumerate(per_rank):
            case = f"p={len(results)} v={v} m={m} {schedule} rank {rank}"
            assert r["max_grad_err"] < 1e-5, f"{case}: gradient of {r['worst']} differs"
            assert r["loss_err"] < 1e-5, f"{case}: losses {r['losses']}"
            assert r["eval_err"] < 1e-6, case
    reference_names = {n for n, _ in GPT(job(2, 1, 2).model).named_parameters()}
    assert all_names == reference_names  # every parameter, under its single-process name
    assert any(n.startswith(f"blocks.{layers - 1}.") for n in all_names)


def _check_hooks_and_timers(results: list[dict]) -> None:
    m, v = 4, 2
    for rank, res in enumerate(results):
        hooks = res.pop("hooks")
        calls = hooks["calls"]
        assert calls.count(("before_forward", 0)) == calls.count(("before_forward", 1)) == m
        assert [c for c in calls if c[0] == "after_backward"] == [("after_backward", 1), ("after_backward", 0)]
        assert calls[-1] == ("after_backward", 0)
        assert hooks["final_ok"], f"rank {rank}: after_backward came before a chunk's last backward"
        spans = [json.loads(line) for line in Path(hooks["path"]).read_text().splitlines()]
        fwd = [s for s in spans if s["name"] == "pp.forward"]
        bwd = [s for s in spans if s["name"] == "pp.backward"]
        assert len(fwd) == len(bwd) == m * v
        assert all(s["kind"] == "compute" for s in fwd + bwd)
        assert {(s["attrs"]["mb"], s["attrs"]["chunk"]) for s in fwd} == {(mb, c) for mb in range(m) for c in range(v)}
        p2p = [s for s in spans if s["kind"] == "p2p"]
        assert {s["name"] for s in p2p} >= {"pp.send", "pp.recv"}
        assert {s["attrs"]["peer"] for s in p2p if "peer" in s["attrs"]} == {1 - rank}


TWO_STAGES = [(2, 1, 3, "1f1b"), (2, 2, 4, "1f1b"), (2, 2, 4, "gpipe"), (2, 1, 4, "zb-h1"), (2, 2, 4, "zbv")]


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory) -> list[dict]:
    out_dir = str(tmp_path_factory.mktemp("timers"))
    return run_local(_rank_main, 2, (TWO_STAGES, out_dir), timeout_s=240)


@pytest.mark.slow
def test_pipeline_parity_two_stages(two_stages):
    results = [dict(r) for r in two_stages]
    _check_hooks_and_timers(results)
    _check(results, TWO_STAGES)


def _windows(events: list[tuple], op: str) -> list[tuple[int, list[str]]]:
    """(micro-batch or position, parameters whose gradient accumulated inside) per `op` window."""
    out, i = [], 0
    while i < len(events):
        if events[i][0] == op:
            j = events.index(("end",), i)
            out.append((events[i][1], [e[1] for e in events[i:j] if e[0] == "grad"]))
            i = j
        i += 1
    return out


@pytest.mark.slow
def test_zb_h1_weight_gradients_wait_for_their_w_action(two_stages):
    """By order: no split parameter's gradient accumulates in a B (only the head's, which the
    loss computes in its forward), each one accumulates once in every W, the last rank's first
    W runs after its second B, and ZeRO's hook follows the last W with the gradients final."""
    m = 4
    for rank, res in enumerate(two_stages):
        order = res["weight_order"]
        events, params = order["events"], order["params"]
        in_b = {n for _, names in _windows(events, "B") for n in names}
        assert in_b <= {"head.out.weight"}, f"rank {rank}: {sorted(in_b)} accumulated in B"
        in_w = _windows(events, "W")
        assert len(in_w) == m
        for _, names in in_w:
            assert sorted(names) == sorted(n for n in params if n != "head.out.weight")
        steps = [e[0] for e in events if e[0] in ("B", "W")]
        assert steps.index("W") == rank + 1  # rank r runs its first W after its (r+1)-th B
        assert order["calls"][-1] == ("after_backward", 0)
        assert events[-1] == ("end",) and order["final_ok"]


@pytest.mark.slow
def test_pipeline_parity_four_stages():
    cases = [(4, 1, 6, "1f1b"), (4, 2, 8, "1f1b"), (4, 1, 4, "zb-h1"), (4, 2, 7, "zbv")]
    _check(run_local(_rank_main, 4, (cases,), timeout_s=280), cases)
