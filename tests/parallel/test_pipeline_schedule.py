"""Pipeline schedules as data, checked without processes: ordering, message pairing, per-link
order, deadlock freedom (decoupled and coupled sends), the bubble formula and peak memory; for
ZB-H1 and ZB-V also the split backward's W actions and the checker that rejects a missing or
misordered W; for ZB-V the V-shaped chunk placement, its bubble and its memory."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from megascale.config.fields import ConfigError
from megascale.parallel.pipeline.schedule import (
    COMPUTE,
    RECVS,
    SENDS,
    Deadlock,
    Op,
    ScheduleError,
    build_schedule,
    check_layout,
    check_schedule,
    compute_order,
    global_chunk,
    rank_of,
    simulate,
)

LAYOUTS = [
    (2, 1, 1),
    (2, 1, 4),
    (4, 1, 2),
    (4, 1, 8),
    (3, 1, 5),
    (2, 2, 2),
    (2, 2, 4),
    (4, 2, 4),
    (4, 2, 8),
    (4, 3, 8),
    (2, 4, 8),
    (8, 2, 16),
]
ZB_LAYOUTS = [(2, 1, 1), (2, 1, 4), (4, 1, 2), (4, 1, 8), (3, 1, 5), (8, 1, 16)]
CASES = [(k, p, v, m) for k in ("1f1b", "gpipe") for p, v, m in LAYOUTS]
CASES += [("zb-h1", p, v, m) for p, v, m in ZB_LAYOUTS]
ZBV_LAYOUTS = [(2, 2, 1), (2, 2, 2), (2, 2, 4), (3, 2, 5), (4, 2, 3), (4, 2, 8), (8, 2, 16)]
CASES += [("zbv", p, v, m) for p, v, m in ZBV_LAYOUTS]
FULL_BACKWARD = [c for c in CASES if c[0] not in ("zb-h1", "zbv")]


def expected_peak(kind: str, p: int, v: int, m: int, rank: int) -> int:
    """Chunk-activations alive at once: 1F1B keeps the warm-up forwards plus one."""
    if kind == "gpipe":
        return m * v
    warmup = p - rank - 1 if v == 1 else 2 * (p - rank - 1) + (v - 1) * p
    return min(warmup + 1, m * v)


@pytest.mark.parametrize(("kind", "p", "v", "m"), CASES)
def test_every_forward_precedes_its_backward(kind, p, v, m):
    sched = build_schedule(kind, p, v, m)
    for rank in range(p):
        seen_f, seen_b, seen_w = set(), set(), set()
        for a in sched.compute(rank):
            key = (a.mb, a.chunk)
            if a.op is Op.FORWARD:
                assert key not in seen_f
                seen_f.add(key)
            elif a.op is Op.WEIGHT:
                assert key in seen_b and key not in seen_w, f"rank {rank}: W {key} before its B"
                seen_w.add(key)
            else:
                assert key in seen_f, f"rank {rank}: backward {key} before its forward"
                assert key not in seen_b
                seen_b.add(key)
        every = {(mb, c) for mb in range(m) for c in range(v)}
        assert seen_f == every and seen_b == every
        assert seen_w == (every if kind in ("zb-h1", "zbv") else set())


@pytest.mark.parametrize(("kind", "p", "v", "m"), CASES)
def test_sends_pair_with_receives_posted_before_use(kind, p, v, m):
    sched = build_schedule(kind, p, v, m)
    sends = Counter()
    recvs = Counter()
    for rank in range(p):
        posted = set()
        for a in sched.ranks[rank]:
            g = global_chunk(p, rank, a.chunk, sched.v_shape)
            if a.op in SENDS:
                dst_g = g + 1 if a.op is Op.SEND_ACT else g - 1
                assert a.peer == rank_of(p, dst_g, sched.v_shape)
                dst_chunk = next(c for c in range(v) if global_chunk(p, a.peer, c, sched.v_shape) == dst_g)
                sends[(rank, a.peer, a.tag, a.op is Op.SEND_GRAD, a.mb, dst_chunk)] += 1
            elif a.op in RECVS:
                src_g = g - 1 if a.op is Op.RECV_ACT else g + 1
                assert a.peer == rank_of(p, src_g, sched.v_shape)
                recvs[(a.peer, rank, a.tag, a.op is Op.RECV_GRAD, a.mb, a.chunk)] += 1
                posted.add((a.op is Op.RECV_ACT, a.mb, a.chunk))
            elif (a.op is Op.FORWARD and g > 0) or (a.op is Op.BACKWARD and g < p * v - 1):
                assert (a.op is Op.FORWARD, a.mb, a.chunk) in posted, f"{a} on rank {rank}"
    assert sends == recvs
    assert set(sends.values()) == {1}
    # one activation and one gradient across each of the p*v - 1 chunk boundaries per micro-batch
    assert sum(sends.values()) == 2 * (p * v - 1) * m


@pytest.mark.parametrize(("kind", "p", "v", "m"), CASES + [("forward", 4, 2, 8)])
@pytest.mark.parametrize("lookahead", [1, 2, 3])
def test_each_link_receives_in_the_order_it_sends(kind, p, v, m, lookahead):
    """What a tag-less transport (NCCL matches by order per pair) needs: on every directed link
    the receiver posts its receives in the order the sender posts its sends."""
    sched = build_schedule(kind, p, v, m, lookahead)
    for src in range(p):
        for dst in range(p):
            sent = [a.tag for a in sched.ranks[src] if a.op in SENDS and a.peer == dst]
            posted = [a.tag for a in sched.ranks[dst] if a.op in RECVS and a.peer == src]
            assert sent == posted, f"link {src}->{dst}"


@pytest.mark.parametrize(("kind", "p", "v", "m"), CASES)
@pytest.mark.parametrize("lookahead", [1, 2, 3])
def test_decoupled_never_deadlocks(kind, p, v, m, lookahead):
    simulate(build_schedule(kind, p, v, m, lookahead), latency=0.3)


@pytest.mark.parametrize(("kind", "p", "v", "m"), [c for c in CASES if c[0] != "zbv"])
def test_coupled_comparison_mode_runs_with_default_lookahead(kind, p, v, m):
    """The benchmark's coupled mode (each send waits for the receive) must not deadlock."""
    simulate(build_schedule(kind, p, v, m), coupled=True)


def test_zbv_needs_decoupled_sends():
    """ZB-V's first rank runs 2p-1 forwards before its first receive of a gradient: with each
    send waiting for its receive it deadlocks (so the runtime refuses `decoupled=False`)."""
    with pytest.raises(Deadlock):
        simulate(build_schedule("zbv", 4, 2, 8), coupled=True)


@pytest.mark.parametrize(("kind", "p", "v", "m"), FULL_BACKWARD)
@pytest.mark.parametrize("t_bwd", [1.0, 2.0])
def test_idle_slots_equal_the_formula(kind, p, v, m, t_bwd):
    """Each rank idles (p-1)(t_f + t_b) chunk-times: the bubble is (p-1)/(v*m) of the compute."""
    sim = simulate(build_schedule(kind, p, v, m), t_fwd=1.0, t_bwd=t_bwd)
    for rank in range(p):
        assert sim.idle[rank] == pytest.approx((p - 1) * (1.0 + t_bwd))
        assert sim.busy[rank] == pytest.approx(m * v * (1.0 + t_bwd))
        assert sim.idle[rank] / sim.busy[rank] == pytest.approx((p - 1) / (v * m))


@pytest.mark.parametrize(("kind", "p", "v", "m"), FULL_BACKWARD)
def test_peak_in_flight_activations(kind, p, v, m):
    sim = simulate(build_schedule(kind, p, v, m))
    assert sim.peak_activations == [expected_peak(kind, p, v, m, r) for r in range(p)]


def test_interleaving_cuts_the_bubble_and_costs_memory():
    plain = simulate(build_schedule("1f1b", 4, 1, 8), t_bwd=2.0)
    inter = simulate(build_schedule("1f1b", 4, 2, 8), t_bwd=2.0)
    # in units of a full stage's forward (a chunk is half a stage when v = 2)
    assert inter.makespan / 2 < plain.makespan
    assert (plain.makespan - inter.makespan / 2) == pytest.approx(3 * 3 / 2)
    assert inter.peak_activations[0] / 2 > plain.peak_activations[0]
    gpipe = simulate(build_schedule("gpipe", 4, 1, 8))
    assert max(gpipe.peak_activations) == 8 > max(plain.peak_activations) == 4


def test_decoupled_sends_hide_latency_coupled_ones_expose_it():
    sched = build_schedule("1f1b", 4, 2, 8)
    free = simulate(sched, latency=0.2)
    coupled = simulate(sched, latency=0.2, coupled=True)
    assert free.makespan < coupled.makespan


def test_megatron_interleaved_order():
    """Rank 0 of p=2, v=2, m=4: warm-up of 2*(p-1) + (v-1)*p = 4 forwards, then 1F1B."""
    order = [(op.value, mb, c) for op, mb, c in compute_order("1f1b", 2, 2, 4, 0)]
    assert order[:5] == [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1), ("F", 2, 0)]
    assert order[5] == ("B", 0, 1)  # the first backward runs the last chunk
    assert sum(1 for o in order if o[0] == "B") == 8


def test_compute_only_in_compute_slots():
    sched = build_schedule("1f1b", 2, 2, 4)
    assert all(a.op in COMPUTE for a in sched.compute(0))
    assert sched.grads_final(0).keys() == {0, 1}


def test_layout_errors_name_the_keys():
    with pytest.raises(ConfigError, match="multiple of parallel.pp=4"):
        check_layout(4, 2, 6)
    with pytest.raises(ConfigError, match="parallel.vpp"):
        check_layout(1, 2, 4)
    with pytest.raises(ConfigError, match="parallel.schedule"):
        check_layout(2, 1, 4, "zero-bubble")
    with pytest.raises(ConfigError, match="parallel.vpp=1"):
        check_layout(2, 2, 4, "zb-h1")
    with pytest.raises(ConfigError, match="parallel.vpp=2"):
        check_layout(2, 1, 4, "zbv")
    with pytest.raises(ConfigError, match="parallel.vpp=2"):
        build_schedule("forward", 2, 3, 4, v_shape=True)
    check_layout(4, 2, 3, "zbv")  # ZB-V runs any number of micro-batches
    check_layout(4, 1, 3)  # plain 1F1B runs any number of micro-batches
    check_layout(4, 2, 6, "gpipe")


@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 8), (3, 5), (4, 4), (4, 8), (8, 16)])
def test_zb_h1_idles_a_third_of_1f1b(p, m):
    """F = B = W: each rank idles p-1 in 3m of compute, (p-1)/(3m), where 1F1B (B+W = 2) idles
    3(p-1); every rank holds p micro-batches from F to W, and full activations (F to B) as 1F1B."""
    zb = simulate(build_schedule("zb-h1", p, 1, m))
    plain = simulate(build_schedule("1f1b", p, 1, m), t_bwd=2.0)
    assert zb.makespan == 3 * m + p - 1
    for rank in range(p):
        assert zb.busy[rank] == 3 * m
        assert zb.idle[rank] / zb.busy[rank] == pytest.approx((p - 1) / (3 * m))
        assert plain.idle[rank] == 3 * (p - 1)
    assert zb.peak_held == [p] * p
    assert zb.peak_activations == plain.peak_activations == [p - r for r in range(p)]


def test_zb_h1_defers_rank_r_weights_by_r_rounds():
    """Rank r's first W follows its (r+1)-th B: the late ranks' deferred W's fill the cool-down."""
    for rank in range(4):
        order = [(a.op.value, a.mb) for a in build_schedule("zb-h1", 4, 1, 8).compute(rank)]
        assert order.index(("W", 0)) > order.index(("B", rank))
        assert order.index(("W", 0)) < order.index(("B", rank + 1))
        assert order[-1] == ("W", 7)


def _without(sched, rank: int, drop):
    return replace(
        sched, ranks=tuple(tuple(a for a in acts if not (r == rank and drop(a))) for r, acts in enumerate(sched.ranks))
    )


def test_checker_rejects_a_missing_or_misordered_weight_action():
    sched = build_schedule("zb-h1", 4, 1, 8)
    check_schedule(sched)
    with pytest.raises(ScheduleError, match=r"rank 2: missing W\(5, 0\)"):
        check_schedule(_without(sched, 2, lambda a: a.op is Op.WEIGHT and a.mb == 5))
    actions = list(sched.ranks[1])  # W(3) moved in front of its B
    w = next(a for a in actions if a.op is Op.WEIGHT and a.mb == 3)
    actions.remove(w)
    actions.insert(actions.index(next(a for a in actions if a.op is Op.BACKWARD and a.mb == 3)), w)
    misordered = replace(sched, ranks=(sched.ranks[0], tuple(actions), *sched.ranks[2:]))
    with pytest.raises(ScheduleError, match=r"rank 1: W\(3,0\) is out of order"):
        check_schedule(misordered)
    with pytest.raises(ScheduleError, match="out of order"):  # no W in an unsplit schedule
        check_schedule(replace(sched, kind="1f1b"))
    with pytest.raises(ScheduleError, match=r"missing W"):  # a split schedule needs every W
        check_schedule(replace(build_schedule("1f1b", 2, 1, 4), kind="zb-h1"))


def test_checker_rejects_a_schedule_that_deadlocks():
    sched = build_schedule("zb-h1", 2, 1, 4)  # rank 0 never sends micro-batch 2's activation
    with pytest.raises(Deadlock, match=r"stuck \{0: 'B\(2,0\)', 1: 'F\(2,0\)'\}"):
        check_schedule(_without(sched, 0, lambda a: a.op is Op.SEND_ACT and a.mb == 2))


def test_zbv_places_chunks_in_a_v():
    """Rank r holds global chunks r and 2p-1-r: the last rank holds the V's bottom (p-1, p) and
    hands its activation to itself; rank 0 holds the embedding's and the head's chunks."""
    p = 4
    assert [[global_chunk(p, r, c, True) for c in (0, 1)] for r in range(p)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert all(rank_of(p, global_chunk(p, r, c, True), True) == r for r in range(p) for c in (0, 1))
    last = build_schedule("zbv", p, 2, 8).ranks[p - 1]
    assert [a.peer for a in last if a.op is Op.SEND_ACT and a.chunk == 0] == [p - 1] * 8
    assert [a.peer for a in last if a.op is Op.SEND_GRAD and a.chunk == 1] == [p - 1] * 8


@pytest.mark.parametrize(("p", "m"), [(2, 3), (2, 8), (3, 5), (4, 7), (4, 8), (8, 16)])
def test_zbv_idles_half_of_zb_h1(p, m):
    """F = B = W per chunk (a chunk is half a stage), m >= 2p-1: every rank idles p-1 chunk-ops
    in 6m, a bubble of (p-1)/(6m), half of ZB-H1's; every rank holds at most 2p
    chunk-activations (p whole micro-batches, as 1F1B's first rank) from F to W."""
    zbv = simulate(build_schedule("zbv", p, 2, m))
    assert zbv.busy == [6 * m] * p
    assert zbv.idle == [p - 1] * p
    assert zbv.peak_held == [2 * p] * p
    assert max(zbv.peak_activations) == 2 * p


def test_checker_rejects_a_missing_or_misordered_weight_action_in_zbv():
    sched = build_schedule("zbv", 2, 2, 4)
    with pytest.raises(ScheduleError, match=r"rank 1: missing W\(2, 1\)"):
        check_schedule(_without(sched, 1, lambda a: a.op is Op.WEIGHT and a.mb == 2 and a.chunk == 1))
    actions = list(sched.ranks[0])  # chunk 0's W(1) moved in front of its B
    w = next(a for a in actions if a.op is Op.WEIGHT and a.mb == 1 and a.chunk == 0)
    actions.remove(w)
    b = next(a for a in actions if a.op is Op.BACKWARD and a.mb == 1 and a.chunk == 0)
    actions.insert(actions.index(b), w)
    with pytest.raises(ScheduleError, match=r"rank 0: W\(1,0\) is out of order"):
        check_schedule(replace(sched, ranks=(tuple(actions), sched.ranks[1])))
    with pytest.raises(ScheduleError, match="missing W"):  # interleaved 1F1B has no W
        check_schedule(replace(build_schedule("1f1b", 2, 2, 4), kind="zbv"))
