"""Overlap is there, checked by order rather than by time: compute runs while collectives fly.

One spawn of 4 gloo ranks trains the layout-parity model through the real `Trainer.train_step`
with every collective and GEMM recorded (`overlap_probe`):

- dp=2 tp=2 under bf16 autocast: tensor-parallel all-gathers/reduce-scatters of the collective
  GEMMs have GEMMs inside their windows; ZeRO's reduce-scatters run during backward; the
  parameter all-gather issued after the optimizer step is waited for in the next step; GEMMs
  and the tensor-parallel traffic are bf16.
- the same with `tp_overlap = dp_overlap = false`: no window holds a GEMM (the negative
  control: the checks above can fail).
- dp=2 pp=2 v=2: pipeline sends are not waited for before the next computes (decoupled), and
  chunk 1's parameter all-gather is prefetched while chunk 0 computes.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from layout_parity import Case, StepTrainer, global_batches, job_config, rank_batch
from overlap_probe import Recorder, install

from megascale.parallel.mesh import init_mesh
from megascale.parallel.store import free_port
from megascale.testing.launch import run_local

pytestmark = pytest.mark.timeout(300)

STEPS = 3


def _config(case: Case, overlap: bool, bf16: bool):
    cfg = job_config(case, STEPS)
    parallel = replace(
        cfg.parallel, tp_overlap=overlap, dp_overlap=overlap, dp_bucket_mb=64 * 4 / 2**20
    )  # small buckets: several per step
    train = replace(cfg.train, dtype="bf16" if bf16 else "fp32")
    return replace(cfg, parallel=parallel, train=train)


def _record(case: Case, overlap: bool, bf16: bool) -> dict:
    import os

    cfg = _config(case, overlap, bf16)
    mesh = init_mesh(cfg.parallel, device="cpu")
    recorder = Recorder()
    originals: list[tuple[object, str, object]] = []

    def setattr_undo(obj, name, value):
        originals.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    try:
        gemms = install(setattr_undo, recorder)
        trainer = StepTrainer(cfg, mesh)
        with gemms:
            for inputs, labels in global_batches(cfg, STEPS):
                recorder.mark_step()
                trainer.train_step(rank_batch(inputs, labels, cfg, mesh.dp_rank))
        return _summary(recorder) | {"rank": int(os.environ["RANK"])}
    finally:
        for obj, name, value in reversed(originals):
            setattr(obj, name, value)
        mesh.destroy()


def _summary(r: Recorder) -> dict:
    def share(items, test) -> float:
        return sum(map(test, items)) / len(items) if items else -1.0

    tp = r.of("tp.")
    gathers = [c for c in r.of("dp.all_gather") if c.waited is not None]
    return {
        "tp": len(tp),
        "tp_overlapped": share(tp, r.overlapped),
        "tp_bf16": share(tp, lambda c: c.dtype == torch.bfloat16),
        "gemm_bf16": share(r.gemms, lambda g: g[1] == torch.bfloat16),
        "dp_rs": len(r.of("dp.reduce_scatter")),
        "dp_rs_overlapped": share(r.of("dp.reduce_scatter"), r.overlapped),
        "dp_ag_overlapped": share(gathers, r.overlapped),
        "dp_ag_across_steps": share(gathers, r.spans_a_step_start),
        "pp_sends": len(r.of("pp.send", first_step=2)),  # step 1 learns activation shapes
        "pp_sends_overlapped": share(r.of("pp.send", first_step=2), r.overlapped),
    }


def _rank(ports: list[int]) -> list[dict]:
    import os

    out = []
    cases = [(Case(dp=2, tp=2), True, True), (Case(dp=2, tp=2), False, True), (Case(dp=2, pp=2, vpp=2), True, False)]
    for (case, overlap, bf16), port in zip(cases, ports, strict=True):
        os.environ["MASTER_PORT"] = str(port)
        out.append(_record(case, overlap, bf16))
    return out


@pytest.fixture(scope="module")
def recorded() -> list[list[dict]]:
    return run_local(_rank, 4, args=([free_port() for _ in range(3)],), timeout_s=280)


@pytest.mark.slow
def test_tensor_parallel_collectives_hide_behind_gemms(recorded):
    for on, off, _ in recorded:
        assert on["tp"] > off["tp"] > 0  # two chunks per collective GEMM with overlap, one without
        # chunked collective GEMMs: every chunk after the first gathers (and every reduce-
        # scatter but the last) while a GEMM runs; unchunked ones (embedding) have no partner
        assert on["tp_overlapped"] >= 0.3, on
        assert off["tp_overlapped"] == 0.0, off  # waited as soon as issued


def test_zero_reduce_scatters_run_during_backward_and_gathers_are_prefetched(recorded):
    for on, off, pipelined in recorded:
        assert on["dp_rs"] > 1 and on["dp_rs_overlapped"] > 0.5, on
        assert off["dp_rs_overlapped"] == 0.0, off
        # the all-gathers of the updated parameters are issued after the optimizer step and
        # waited for by the next step's first forward: the data of the next step loads meanwhile.
        # Only IN_FLIGHT buckets a chunk are gathered ahead (their buffers bound the memory); the
        # rest are issued as those land, so some but not all gathers span the step's start
        assert 0.0 < on["dp_ag_across_steps"] < 1.0, on
        assert off["dp_ag_across_steps"] == 0.0, off
        # with two chunks, chunk 1's gather flies while chunk 0 computes
        assert pipelined["dp_ag_overlapped"] > 0.0, pipelined


def test_pipeline_sends_are_decoupled_from_compute(recorded):
    for *_, pipelined in recorded:
        assert pipelined["pp_sends"] > 0
        assert pipelined["pp_sends_overlapped"] >= 0.75, pipelined  # the last ones drain at the end


def test_bf16_autocast_reaches_gemms_and_tensor_parallel_traffic(recorded):
    for on, *_ in recorded:
        assert on["gemm_bf16"] >= 0.9, on  # LayerNorm and the loss stay fp32; GEMMs do not
        assert on["tp_bf16"] >= 0.5, on  # the collective GEMMs communicate in the compute dtype
