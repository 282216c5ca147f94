"""3D parity: every layout trains the same model as one process, with AdamW and with LAMB.

Each layout (dp, tp, pp, v) composes tensor parallelism (with sequence parallelism), the
pipeline split and ZeRO-2 per chunk through the real `build_runner`, and runs ten steps of
the real `Trainer.train_step` on the same global batch as the single-process reference. Every
rank must report the reference's losses (the true global mean: no double counting across tp,
no missing micro-batches) and gradient norms, and the whole parameters put back together from
all ranks must equal the reference's. Tolerances: `layout_parity.LOSS_RTOL`/`PARAM_ATOL`.

One spawn per world size with all its cases inside; the 8-rank spawn is marked slow but runs
by default.
"""

from __future__ import annotations

import pytest
from layout_parity import Case, compare, run_cases, train

from megascale.parallel.launch import free_port, run_local

pytestmark = pytest.mark.timeout(900)

OPTIMIZERS = ("adamw", "lamb")
LAYOUTS_4 = [Case(dp=2, tp=2), Case(tp=2, pp=2), Case(dp=2, pp=2, vpp=2), Case(pp=4, split=(1, 3, 2, 2))]
LAYOUTS_8 = [Case(dp=2, tp=2, pp=2), Case(dp=8), Case(tp=2, pp=4), Case(dp=2, pp=4, vpp=2)]


@pytest.fixture(scope="module")
def reference() -> dict[str, dict]:
    return {opt: train(Case(optim=opt)) for opt in OPTIMIZERS}


def _matrix(world: int, layouts: list[Case], reference: dict) -> None:
    cases = [Case(c.dp, c.tp, c.pp, c.vpp, optim, split=c.split) for c in layouts for optim in OPTIMIZERS]
    assert all(c.world == world for c in cases)
    ports = [free_port() for _ in cases]
    results = run_local(run_cases, world, args=(cases, ports), timeout_s=840)
    for i, case in enumerate(cases):
        errs = compare(case, [rank[i] for rank in results], reference[case.optim])
        print(f"parity {case}: loss rel {errs['loss_rel']:.1e}, param abs {errs['param_abs']:.1e}")


def test_layouts_of_4_ranks(reference):
    _matrix(4, LAYOUTS_4, reference)


@pytest.mark.slow
def test_layouts_of_8_ranks(reference):
    _matrix(8, LAYOUTS_8, reference)
