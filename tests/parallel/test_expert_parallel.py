"""Expert parallelism trains the same MoE model as one process (fp32 losses, gradient norms and
final parameters), and a layout that cannot split the experts is refused by name.

One 4-rank spawn holds every case: ep=2 carved from dp=4 (the experts' ZeRO over their
expert-data pairs), ep=2 with a 2-stage pipeline, ep=2 with tp=2 (sequence parallel: each tp
rank routes its sequence slice, the balancing counts summed over tp), and ep=4 with a skewed router (top-1 and a
routing bias that sends every token to expert 0: rank 0 of the ep group receives every row,
the others none, and the bias moves alike on every rank). A second spawn puts MoE under context
parallelism (`CP_CASES`). Tolerances: `layout_parity`.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
from layout_parity import Case, StepTrainer, compare, global_batches, job_config, rank_batch, run_cases, train
from overlap_probe import Recorder, install

from megascale.config import ConfigError
from megascale.config.schema import JobConfig, ModelConfig, MoEConfig, ParallelConfig
from megascale.parallel.mesh import init_mesh
from megascale.parallel.store import free_port
from megascale.testing.launch import run_local

CASES = [
    Case(dp=4, ep=2, model="moe", optim="lamb"),
    Case(dp=2, ep=2, pp=2, model="moe", optim="lamb"),
    Case(dp=2, ep=2, tp=2, model="moe", optim="lamb"),
    Case(dp=4, ep=4, model="moe-skew", optim="lamb"),
]
# under context parallelism (each rank routes its part of every sequence; ep groups are the dp
# ranks at one cp rank): the halo with bias balancing, ring attention, the skewed router, and
# cp x tp with sequence parallelism (the per-sequence counts summed over cp and tp)
CP_CASES = [
    Case(dp=2, ep=2, cp=2, model="moe-swa", optim="lamb"),
    Case(dp=2, ep=2, cp=2, model="moe", optim="lamb"),
    Case(dp=2, ep=2, cp=2, model="moe-skew", optim="lamb"),
    Case(cp=2, tp=2, model="moe-swa", optim="lamb"),
]
STEPS = 4


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_expert_parallel_layouts_match_one_process():
    refs = {model: train(Case(model=model, optim="lamb"), steps=STEPS) for model in ("moe", "moe-skew")}
    results = run_local(run_cases, 4, args=(CASES, [free_port() for _ in CASES], STEPS), timeout_s=540)
    for i, case in enumerate(CASES):
        errs = compare(case, [rank[i] for rank in results], refs[case.model])
        print(f"parity {case}: loss rel {errs['loss_rel']:.1e}, param abs {errs['param_abs']:.1e}")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_moe_under_context_parallelism_matches_one_process():
    refs = {model: train(Case(model=model, optim="lamb"), steps=STEPS) for model in ("moe", "moe-swa", "moe-skew")}
    results = run_local(run_cases, 4, args=(CP_CASES, [free_port() for _ in CP_CASES], STEPS), timeout_s=540)
    for i, case in enumerate(CP_CASES):
        errs = compare(case, [rank[i] for rank in results], refs[case.model])
        print(f"parity {case}: loss rel {errs['loss_rel']:.1e}, param abs {errs['param_abs']:.1e}")


def _ep_windows(chunk_counts: list[int], ports: list[int]) -> list[dict[str, tuple[int, int]]]:
    """Per setting of parallel.ep_overlap_chunks, forward and backward: (ep all-to-alls, those
    with a GEMM in flight)."""
    out = []
    for chunks, port in zip(chunk_counts, ports, strict=True):
        os.environ["MASTER_PORT"] = str(port)
        cfg = job_config(Case(dp=2, ep=2, model="moe"), 1)
        cfg = replace(cfg, parallel=replace(cfg.parallel, ep_overlap_chunks=chunks))
        mesh, recorder, undo = init_mesh(cfg.parallel, device="cpu"), Recorder(), []

        def setattr_undo(obj, name, value, undo=undo):
            undo.append((obj, name, getattr(obj, name)))
            setattr(obj, name, value)

        try:
            gemms = install(setattr_undo, recorder)
            trainer = StepTrainer(cfg, mesh)
            with gemms:
                for inputs, labels in global_batches(cfg, 1):
                    recorder.mark_step()
                    trainer.train_step(rank_batch(inputs, labels, cfg, mesh.dp_rank))
        finally:
            for obj, name, value in reversed(undo):
                setattr(obj, name, value)
            mesh.destroy()
        counts = {}
        for phase, backward in (("forward", False), ("backward", True)):
            exchanges = [c for c in recorder.of("ep.") if c.backward == backward]
            counts[phase] = (len(exchanges), sum(recorder.overlapped(c) for c in exchanges))
        out.append(counts)
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_chunked_dispatch_keeps_all_to_alls_in_flight_while_experts_compute():
    """Chunks 2, forward: part 1's dispatch and part 0's combine have expert GEMMs inside their
    windows; backward: part 0's combine gradient (in flight during part 1's experts' backward)
    and part 1's dispatch gradient (during part 0's) -- two per MoE layer per micro-batch each
    way. Chunks 1, the negative control: none either way."""
    results = run_local(_ep_windows, 2, args=([2, 1], [free_port(), free_port()]), timeout_s=240)
    micro_batches, moe_layers = 4, 2  # global batch 8 over dp 2, micro-batch 1; blocks 1 and 3
    for on, off in results:
        for phase in ("forward", "backward"):
            assert on[phase][1] >= 2 * micro_batches * moe_layers, (phase, on)
            assert off[phase][0] > 0 and off[phase][1] == 0, (phase, off)


@pytest.mark.parametrize("dp, ep, experts, valid", [(4, 3, 6, "[1, 2]"), (2, 4, 8, "[1, 2]"), (4, 4, 6, "[1, 2]")])
def test_bad_expert_layouts_are_refused_with_the_valid_choices(dp, ep, experts, valid):
    cfg = JobConfig(model=ModelConfig(moe=MoEConfig(experts=experts)), parallel=ParallelConfig(dp=dp, ep=ep))
    cfg.train.global_batch = 16
    with pytest.raises(
        ConfigError,
        match=rf"parallel.ep={ep} must divide parallel.dp={dp}.*model.moe.experts="
        rf"{experts}.*valid parallel.ep: \{valid}",
    ):
        cfg.validate()


def test_ep_without_experts_is_refused():
    with pytest.raises(ConfigError, match=r"parallel.ep=2 needs MoE layers \(model.moe.experts > 0\)"):
        JobConfig(parallel=ParallelConfig(dp=2, ep=2)).validate()


def test_cp_composes_with_ep_but_not_with_a_capacity_factor():
    moe = MoEConfig(experts=4, top_k=2)
    model = ModelConfig(seq_len=64, window=16, moe=moe)
    JobConfig(model=model, parallel=ParallelConfig(dp=2, cp=2, ep=2)).validate()
    capped = replace(model, moe=replace(moe, capacity_factor=1.25))
    with pytest.raises(
        ConfigError,
        match=r"model.moe.capacity_factor=1.25 with parallel.cp=2: .*capacity_factor=0 \(dropless\) or parallel.cp=1",
    ):
        JobConfig(model=capped, parallel=ParallelConfig(dp=2, cp=2, ep=2)).validate()
