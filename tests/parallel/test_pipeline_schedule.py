"""Pipeline schedules as data, checked without processes: ordering, message pairing, per-link
order, deadlock freedom (decoupled and coupled sends), the bubble formula and peak memory."""

from __future__ import annotations

from collections import Counter

import pytest

from megascale.config.fields import ConfigError
from megascale.parallel.pipeline.schedule import (
    COMPUTE,
    RECVS,
    SENDS,
    Op,
    build_schedule,
    check_layout,
    compute_order,
    simulate,
)

LAYOUTS = [(2, 1, 1), (2, 1, 4), (4, 1, 2), (4, 1, 8), (3, 1, 5), (2, 2, 2), (2, 2, 4),
           (4, 2, 4), (4, 2, 8), (4, 3, 8), (2, 4, 8), (8, 2, 16)]
CASES = [(k, p, v, m) for k in ("1f1b", "gpipe") for p, v, m in LAYOUTS]


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
        seen_f, seen_b = set(), set()
        for a in sched.compute(rank):
            key = (a.mb, a.chunk)
            if a.op is Op.FORWARD:
                assert key not in seen_f
                seen_f.add(key)
            else:
                assert key in seen_f, f"rank {rank}: backward {key} before its forward"
                assert key not in seen_b
                seen_b.add(key)
        every = {(mb, c) for mb in range(m) for c in range(v)}
        assert seen_f == every and seen_b == every


@pytest.mark.parametrize(("kind", "p", "v", "m"), CASES)
def test_sends_pair_with_receives_posted_before_use(kind, p, v, m):
    sched = build_schedule(kind, p, v, m)
    sends = Counter()
    recvs = Counter()
    for rank in range(p):
        posted = set()
        for a in sched.ranks[rank]:
            g = a.chunk * p + rank
            if a.op in SENDS:
                dst_g = g + 1 if a.op is Op.SEND_ACT else g - 1
                assert a.peer == dst_g % p
                sends[(rank, a.peer, a.tag, a.op is Op.SEND_GRAD, a.mb, dst_g // p)] += 1
            elif a.op in RECVS:
                src_g = g - 1 if a.op is Op.RECV_ACT else g + 1
                assert a.peer == src_g % p
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


@pytest.mark.parametrize(("kind", "p", "v", "m"), CASES)
def test_coupled_comparison_mode_runs_with_default_lookahead(kind, p, v, m):
    """The benchmark's coupled mode (each send waits for the receive) must not deadlock."""
    simulate(build_schedule(kind, p, v, m), coupled=True)


@pytest.mark.parametrize(("kind", "p", "v", "m"), CASES)
@pytest.mark.parametrize("t_bwd", [1.0, 2.0])
def test_idle_slots_equal_the_formula(kind, p, v, m, t_bwd):
    """Each rank idles (p-1)(t_f + t_b) chunk-times: the bubble is (p-1)/(v*m) of the compute."""
    sim = simulate(build_schedule(kind, p, v, m), t_fwd=1.0, t_bwd=t_bwd)
    for rank in range(p):
        assert sim.idle[rank] == pytest.approx((p - 1) * (1.0 + t_bwd))
        assert sim.busy[rank] == pytest.approx(m * v * (1.0 + t_bwd))
        assert sim.idle[rank] / sim.busy[rank] == pytest.approx((p - 1) / (v * m))


@pytest.mark.parametrize(("kind", "p", "v", "m"), CASES)
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
    check_layout(4, 1, 3)  # plain 1F1B runs any number of micro-batches
    check_layout(4, 2, 6, "gpipe")
