"""Expert parallelism trains the same MoE model as one process (fp32 losses, gradient norms and
final parameters), and a layout that cannot split the experts is refused by name.

One 4-rank spawn holds every case: ep=2 carved from dp=4 (the experts' ZeRO over their
expert-data pairs), ep=2 with a 2-stage pipeline, and ep=4 with a skewed router (top-1 and a
routing bias that sends every token to expert 0: rank 0 of the ep group receives every row,
the others none, and the bias moves alike on every rank). Tolerances: `layout_parity`.
"""

from __future__ import annotations

import pytest
from layout_parity import Case, compare, run_cases, train

from megascale.config import ConfigError
from megascale.config.schema import JobConfig, ModelConfig, MoEConfig, ParallelConfig
from megascale.parallel.store import free_port
from megascale.testing.launch import run_local

CASES = [Case(dp=4, ep=2, model="moe", optim="lamb"), Case(dp=2, ep=2, pp=2, model="moe", optim="lamb"),
         Case(dp=4, ep=4, model="moe-skew", optim="lamb")]
STEPS = 4


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_expert_parallel_layouts_match_one_process():
    refs = {model: train(Case(model=model, optim="lamb"), steps=STEPS) for model in ("moe", "moe-skew")}
    results = run_local(run_cases, 4, args=(CASES, [free_port() for _ in CASES], STEPS), timeout_s=540)
    for i, case in enumerate(CASES):
        errs = compare(case, [rank[i] for rank in results], refs[case.model])
        print(f"parity {case}: loss rel {errs['loss_rel']:.1e}, param abs {errs['param_abs']:.1e}")


@pytest.mark.parametrize("dp, ep, experts, valid", [(4, 3, 6, "[1, 2]"), (2, 4, 8, "[1, 2]"), (4, 4, 6, "[1, 2]")])
def test_bad_expert_layouts_are_refused_with_the_valid_choices(dp, ep, experts, valid):
    cfg = JobConfig(model=ModelConfig(moe=MoEConfig(experts=experts)), parallel=ParallelConfig(dp=dp, ep=ep))
    cfg.checkpoint.every = 0
    cfg.train.global_batch = 16
    with pytest.raises(ConfigError, match=rf"parallel.ep={ep} must divide parallel.dp={dp}.*model.moe.experts="
                                          rf"{experts}.*valid parallel.ep: \{valid}"):
        cfg.validate()


def test_ep_without_experts_is_refused():
    with pytest.raises(ConfigError, match=r"parallel.ep=2 needs MoE layers \(model.moe.experts > 0\)"):
        JobConfig(parallel=ParallelConfig(dp=2, ep=2)).validate()
