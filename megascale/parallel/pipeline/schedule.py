"""Pipeline schedules as data: for each pipeline rank, the ordered list of actions it runs.

A schedule is built without processes, so its properties (forward before backward, every send
matched by a receive, no deadlock, the bubble, peak activation memory) are checked by unit
tests and by `simulate` below, and the runtime only plays the list.

Layout (Megatron interleaving): with `p` ranks and `v` chunks per rank the model is cut into
`p*v` global chunks; chunk `c` of rank `r` is global chunk `c*p + r`. Activations flow from
global chunk g to g+1 (so from rank r to r+1, and from the last rank back to rank 0 one chunk
later), gradients the other way.

Zero-bubble ZB-H1 (Qi et al., ICLR 2024; `kind="zb-h1"`, v = 1) splits each backward into B
(input gradient: what the previous stage waits for) and W (weight gradient: wanted by nobody
until the optimizer step, `parallel/weight_grad.py`). Rank r runs 1F1B's p-r-1 warm-up forwards,
then F, B and -- after the first r steady rounds -- the oldest pending W, then the cool-down B's
(each followed by a W once past those r rounds), then the W's still pending. With F = B = W in
time that is 3m + p - 1 per rank (m >= p): the bubble is (p-1)/(3m), a third of 1F1B's, for
p micro-batches held at once on every rank (F to W; 1F1B's rank 0 holds p, rank r p-r).

ZB-V (`kind="zbv"`, v = 2) places the two chunks of each rank in a V: rank r holds global
chunks r and 2p-1-r, so the forward runs down the ranks on chunk 0 and back up on chunk 1, and
the last rank passes its chunk 0's output to its own chunk 1 without a message. The order is
`torch.distributed.pipelining`'s ScheduleZBVZeroBubble (the paper's section 6): with
F = B = W per chunk and m >= 2p - 1 the bubble is near zero, and each rank holds at most 2p
chunk-activations, i.e. p micro-batches of a whole stage: 1F1B's rank 0.

Communication is decoupled (MegaScale): a SEND is posted right after the compute that made
its tensor and is never waited for before the next action; a RECV is *posted* a few compute
actions before the one that needs it (`lookahead`), and a compute action waits only for its own
receive. Nothing on a rank ever waits for a peer to receive.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from megascale.config.fields import ConfigError


class Op(str, Enum):
    FORWARD = "F"
    BACKWARD = "B"
    WEIGHT = "W"
    SEND_ACT = "send_act"
    RECV_ACT = "recv_act"
    SEND_GRAD = "send_grad"
    RECV_GRAD = "recv_grad"


COMPUTE = (Op.FORWARD, Op.BACKWARD, Op.WEIGHT)
SENDS = (Op.SEND_ACT, Op.SEND_GRAD)
RECVS = (Op.RECV_ACT, Op.RECV_GRAD)
KINDS = ("1f1b", "gpipe", "zb-h1", "zbv", "forward")  # "1f1b" is interleaved when v > 1; "forward" = eval
SPLIT_KINDS = ("zb-h1", "zbv")  # backward split into B (input gradient) and W (weight gradient)
V_SHAPED = ("zbv",)  # chunks placed in a V (rank r: global chunks r and 2p-1-r)
# Receives are posted two computes ahead: one is enough for decoupled sends, but the coupled
# comparison mode (a send waits for its receive) deadlocks interleaved 1F1B with one.
DEFAULT_LOOKAHEAD = 2


@dataclass(frozen=True)
class Action:
    """One step of a rank's program. `chunk` is the local chunk index (0..v-1); `peer` is the
    pipeline rank at the other end of a send/recv; `tag` identifies the message (unique within
    one schedule, identical on both ends)."""

    op: Op
    mb: int
    chunk: int
    peer: int | None = None
    tag: int | None = None

    def __str__(self) -> str:
        peer = "" if self.peer is None else f"@{self.peer}"
        return f"{self.op.value}({self.mb},{self.chunk}){peer}"


@dataclass(frozen=True)
class Schedule:
    kind: str
    p: int
    v: int
    m: int
    ranks: tuple[tuple[Action, ...], ...]
    v_shape: bool = False  # chunk placement: a V (ZB-V, and its evaluation) or interleaved

    def compute(self, rank: int) -> list[Action]:
        return [a for a in self.ranks[rank] if a.op in COMPUTE]

    @property
    def split(self) -> bool:
        """Backwards are split into B and W actions."""
        return self.kind in SPLIT_KINDS

    def grads_final(self, rank: int) -> dict[int, int]:
        """Local chunk -> index (in the rank's action list) of its last BACKWARD, or its last
        WEIGHT when the backward is split: where ZeRO's reduce-scatter of that chunk may start."""
        last = Op.WEIGHT if self.split else Op.BACKWARD
        out: dict[int, int] = {}
        for i, a in enumerate(self.ranks[rank]):
            if a.op is last:
                out[a.chunk] = i
        return out

    def describe(self, rank: int) -> str:
        return " ".join(str(a) for a in self.compute(rank))


def global_chunk(p: int, rank: int, chunk: int, v_shape: bool = False) -> int:
    """The global chunk that local chunk `chunk` of `rank` holds: c*p + r interleaved, or in
    a V (two chunks per rank) r for chunk 0 and 2p-1-r for chunk 1."""
    if v_shape:
        return rank if chunk == 0 else 2 * p - 1 - rank
    return chunk * p + rank


def rank_of(p: int, g: int, v_shape: bool = False) -> int:
    """The pipeline rank holding global chunk g (the inverse of `global_chunk`)."""
    if v_shape:
        return g if g < p else 2 * p - 1 - g
    return g % p


def check_layout(p: int, v: int, m: int, kind: str = "1f1b") -> None:
    """Raise a ConfigError naming the keys when (p, v, m) cannot fill the schedule."""
    if kind not in KINDS:
        raise ConfigError(f"parallel.schedule must be one of {KINDS[:4]}, got {kind!r}")
    if p < 1 or v < 1 or m < 1:
        raise ConfigError(f"parallel.pp={p}, parallel.vpp={v} and the micro-batches per step ({m}) must be >= 1")
    if v > 1 and p == 1:
        raise ConfigError("parallel.vpp > 1 needs parallel.pp > 1 (interleaving is across stages)")
    if v > 1 and kind == "zb-h1":
        raise ConfigError(f"parallel.schedule={kind!r} runs one chunk per stage: set parallel.vpp=1")
    if v != 2 and kind in V_SHAPED:
        raise ConfigError(f"parallel.schedule={kind!r} runs two chunks per stage in a V: set parallel.vpp=2")
    if v > 1 and kind == "1f1b" and m % p:
        raise ConfigError(
            f"interleaved 1F1B needs the micro-batches per step ({m} = train.global_batch / "
            f"(train.micro_batch * parallel.dp)) to be a multiple of parallel.pp={p}"
        )


def compute_order(kind: str, p: int, v: int, m: int, rank: int, v_shape: bool = False) -> list[tuple[Op, int, int]]:
    """The (op, micro-batch, chunk) compute sequence of one rank.

    Forwards walk micro-batches in groups of p through the chunks (Megatron's interleaving:
    the k-th forward runs chunk (k // p) % v on micro-batch (k // (p*v)) * p + k % p; with
    v = 1 simply micro-batch k, so any m works); backwards the same with chunks reversed.
    1F1B runs `warmup` forwards, then alternates one forward and one backward, then drains the
    backwards; GPipe runs all forwards first."""
    check_layout(p, v, m, kind)
    total = m * v

    def mb_of(k: int) -> int:
        return k if v == 1 else (k // (p * v)) * p + k % p

    def fwd(k: int) -> tuple[Op, int, int]:
        return Op.FORWARD, mb_of(k), (k // p) % v

    def bwd(k: int) -> tuple[Op, int, int]:
        return Op.BACKWARD, mb_of(k), v - 1 - (k // p) % v

    if kind == "forward" and v_shape:
        return [(Op.FORWARD, mb, c) for c in range(v) for mb in range(m)]
    if kind == "forward":
        return [fwd(k) for k in range(total)]
    if kind == "gpipe":
        return [fwd(k) for k in range(total)] + [bwd(k) for k in range(total)]
    if kind == "zb-h1":
        return _zb_h1(p, m, rank)
    if kind == "zbv":
        return _zbv(p, m, rank)
    warmup = min(total, p - rank - 1 if v == 1 else (p - rank - 1) * 2 + (v - 1) * p)
    order = [fwd(k) for k in range(warmup)]
    for i in range(total - warmup):
        order += [fwd(warmup + i), bwd(i)]
    order += [bwd(k) for k in range(total - warmup, total)]
    return order


def _zb_h1(p: int, m: int, rank: int) -> list[tuple[Op, int, int]]:
    """ZB-H1 on one rank (v = 1): 1F1B's order with each B followed by the oldest pending W,
    except in the first `rank` steady rounds, whose W's are left for the end; the deferred W's
    fill the cool-down, where 1F1B's rank r idles while the gradients come back."""
    warmup = min(m, p - rank - 1)
    order = [(Op.FORWARD, k, 0) for k in range(warmup)]
    weights = 0
    for i in range(m):  # round i: the B of micro-batch i, preceded in steady state by a forward
        if warmup + i < m:
            order.append((Op.FORWARD, warmup + i, 0))
        order.append((Op.BACKWARD, i, 0))
        if i >= rank:
            order.append((Op.WEIGHT, weights, 0))
            weights += 1
    return order + [(Op.WEIGHT, k, 0) for k in range(weights, m)]


def _zbv(p: int, m: int, rank: int) -> list[tuple[Op, int, int]]:
    """ZB-V on one rank (v = 2; local chunk 0 is global chunk r, chunk 1 is 2p-1-r), as
    torch.distributed.pipelining's ScheduleZBVZeroBubble builds it: warm-up forwards of chunk 0
    (more on the first ranks, which the V reaches first), then chunk-1 forwards each followed
    by its B and W, a steady phase alternating (F, B, W) on chunk 0 and on chunk 1, a cool-down
    of B's whose W's are deferred into the gaps, then the W's left. It is written for
    n = max(m, 2p - 1) micro-batches; the surplus ones (m < 2p - 1) are dropped."""
    n = max(m, 2 * p - 1)
    order: list[tuple[Op, int, int]] = []
    count = {(op, c): 0 for op in COMPUTE for c in (0, 1)}  # the next micro-batch of each

    def add(*steps: tuple[Op, int]) -> None:
        for op, c in steps:
            order.append((op, count[(op, c)], c))
            count[(op, c)] += 1

    F, B, W = Op.FORWARD, Op.BACKWARD, Op.WEIGHT
    add(*[(F, 0)] * (2 * (p - rank) - 1))
    add(*[(F, 1), (F, 0)] * rank)
    add(*[(F, 1), (B, 1), (W, 1)] * (p - rank))
    while count[(F, 1)] < count[(F, 0)] or count[(F, 0)] < n:
        if count[(F, 0)] < n:
            add((F, 0))
        add((B, 0), (W, 0), (F, 1), (B, 1), (W, 1))
    add(*[(B, 0), (B, 1)] * rank)  # cool-down: these W's are deferred into the gaps
    add(*[(B, 0), (W, 0)] * (p - rank))
    add(*[(W, 1)] * (count[(B, 1)] - count[(W, 1)]))
    add(*[(W, 0)] * (count[(B, 0)] - count[(W, 0)]))
    return [(op, mb, c) for op, mb, c in order if mb < m]


def build_schedule(
    kind: str, p: int, v: int, m: int, lookahead: int = DEFAULT_LOOKAHEAD, v_shape: bool | None = None
) -> Schedule:
    """Every rank's action list: compute, each send right after the compute producing it, and
    each receive posted `lookahead` compute actions before the one that consumes it. `v_shape`
    (default: the kind's own placement) is the chunk placement; evaluation of a ZB-V run passes
    True. A message between two chunks of one rank (the V's bottom) is a SEND and a RECV with
    that rank as the peer: the runtime hands the tensor over in memory."""
    v_shape = kind in V_SHAPED if v_shape is None else v_shape
    if v_shape and v != 2:
        raise ConfigError(f"chunks placed in a V need parallel.vpp=2, got {v}")
    chunks = p * v
    orders = [compute_order(kind, p, v, m, rank, v_shape) for rank in range(p)]
    sends: list[list[list[Action]]] = [[[] for _ in order] for order in orders]
    wanted: dict[int, tuple[int, Action]] = {}  # tag -> (index of the consumer, the receive)
    for rank, order in enumerate(orders):
        for i, (op, mb, chunk) in enumerate(order):
            g = global_chunk(p, rank, chunk, v_shape)
            need = needed_message(op, g, mb, p, v, m, v_shape)
            if need is not None:
                recv = Op.RECV_ACT if op is Op.FORWARD else Op.RECV_GRAD
                wanted[need[1]] = (i, Action(recv, mb, chunk, need[0], need[1]))
            if op is Op.FORWARD and g < chunks - 1:
                peer = rank_of(p, g + 1, v_shape)
                sends[rank][i].append(Action(Op.SEND_ACT, mb, chunk, peer, message_tag(False, g, mb, m)))
            if op is Op.BACKWARD and g > 0:
                peer = rank_of(p, g - 1, v_shape)
                sends[rank][i].append(Action(Op.SEND_GRAD, mb, chunk, peer, message_tag(True, g - 1, mb, m)))
    # Each link's receives are posted in the order its sends are (what NCCL's order-matching
    # needs): a receive whose consumer comes early moves the ones sent before it up with it.
    posts: list[list[tuple[int, int, Action]]] = [[] for _ in orders]  # (consumer, sent order, recv)
    for src in range(p):
        for dst in range(p):
            sent = [a.tag for slot in sends[src] for a in slot if a.peer == dst]
            first = len(orders[dst])
            for n, tag in reversed(list(enumerate(sent))):
                first = min(first, wanted[tag][0])
                posts[dst].append((first, n, wanted[tag][1]))
    recvs: list[list[list[Action]]] = [[[] for _ in order] for order in orders]
    for rank in range(p):
        for consumer, _, recv in sorted(posts[rank], key=lambda post: post[:2]):
            recvs[rank][max(0, consumer - lookahead)].append(recv)
    ranks = []
    for rank, order in enumerate(orders):
        actions: list[Action] = []
        for i, (op, mb, chunk) in enumerate(order):
            actions += recvs[rank][i]
            actions.append(Action(op, mb, chunk))
            actions += sends[rank][i]
        ranks.append(tuple(actions))
    schedule = Schedule(kind, p, v, m, tuple(ranks), v_shape)
    check_schedule(schedule)
    return schedule


class ScheduleError(ValueError):
    pass


def check_schedule(schedule: Schedule) -> None:
    """The checker every built schedule passes: on each rank every (micro-batch, local chunk)
    runs F, then B, then W when the backward is split (F alone for evaluation), each exactly
    once; then the whole schedule plays to its end in `simulate`, so it cannot deadlock.
    Raises ScheduleError (or Deadlock) naming the rank and the action."""
    steps = (Op.FORWARD,) if schedule.kind == "forward" else (Op.FORWARD, Op.BACKWARD)
    steps += (Op.WEIGHT,) if schedule.split else ()
    names = "".join(op.value for op in steps)
    head = f"{schedule.kind} p={schedule.p} v={schedule.v} m={schedule.m}"
    for rank in range(schedule.p):
        done: dict[tuple[int, int], int] = {(mb, c): 0 for mb in range(schedule.m) for c in range(schedule.v)}
        for a in schedule.compute(rank):
            key = (a.mb, a.chunk)
            if key not in done:
                raise ScheduleError(f"{head} rank {rank}: {a} is outside the layout")
            if done[key] == len(steps) or a.op is not steps[done[key]]:
                raise ScheduleError(
                    f"{head} rank {rank}: {a} is out of order; each (micro-batch, "
                    f"chunk) runs {names} once, in that order"
                )
            done[key] += 1
        missing = [f"{steps[n].value}{key}" for key, n in done.items() if n < len(steps)]
        if missing:
            raise ScheduleError(f"{head} rank {rank}: missing {', '.join(missing[:4])}")
    simulate(schedule)


def message_tag(grad: bool, boundary: int, mb: int, m: int) -> int:
    """Unique tag of the message crossing the boundary after global chunk `boundary`."""
    return 2 * (boundary * m + mb) + int(grad)


def needed_message(op: Op, g: int, mb: int, p: int, v: int, m: int, v_shape: bool = False) -> tuple[int, int] | None:
    """(source pipeline rank, tag) of the message a compute on global chunk g waits for: the
    activation from chunk g-1 (forward), the gradient from chunk g+1 (backward), or None (a
    weight-gradient action needs only what its own B left)."""
    if op is Op.WEIGHT:
        return None
    if op is Op.FORWARD:
        return None if g == 0 else (rank_of(p, g - 1, v_shape), message_tag(False, g - 1, mb, m))
    return None if g == p * v - 1 else (rank_of(p, g + 1, v_shape), message_tag(True, g, mb, m))


# --------------------------------------------------------------------------- simulation
@dataclass
class SimResult:
    makespan: float
    busy: list[float]  # compute time per rank
    idle: list[float]  # makespan - busy, per rank
    peak_activations: list[int]  # chunk-activations held at once (forward done, backward not)
    peak_held: list[int]  # (micro-batch, chunk)s holding anything: forward done, last W (or B) not
    timeline: list[list[tuple[float, float, Action]]]  # per rank: (start, end, compute action)


class Deadlock(RuntimeError):
    pass


def simulate(
    schedule: Schedule,
    t_fwd: float = 1.0,
    t_bwd: float = 1.0,
    coupled: bool = False,
    latency: float = 0.0,
    t_wgt: float = 1.0,
    duration: Callable[[int, Action], float] | None = None,
) -> SimResult:
    """Play every rank's actions in lock-step with fixed compute times (or `duration(rank,
    action)`, e.g. times measured on a real run, to predict its bubble with ideal links).
    `t_bwd` is a whole backward, or only its B when the schedule splits it (W takes `t_wgt`).

    Decoupled (default): a send costs nothing and never waits; a compute waits for its own
    message, which arrives `latency` after the peer sent it. Coupled: a send blocks its rank
    until the peer has posted the matching receive and the transfer is over (what waiting on
    each send, or bundling it with the next receive, does).
    Raises Deadlock, naming each rank's stuck action, if no rank can move."""
    p = schedule.p
    pos = [0] * p
    clock = [0.0] * p
    posted: dict[tuple[int, int], float] = {}  # (dst, tag) -> time the receive was posted
    arrived: dict[tuple[int, int], float] = {}  # (dst, tag) -> time the data is there
    timeline: list[list[tuple[float, float, Action]]] = [[] for _ in range(p)]
    live, held = [0] * p, [0] * p
    peak, peak_held = [0] * p, [0] * p
    times = {Op.FORWARD: t_fwd, Op.BACKWARD: t_bwd, Op.WEIGHT: t_wgt}
    release = Op.WEIGHT if schedule.split else Op.BACKWARD
    while True:
        progressed = False
        for r in range(p):
            actions = schedule.ranks[r]
            while pos[r] < len(actions):
                a = actions[pos[r]]
                if a.op in RECVS:
                    posted[(r, a.tag)] = clock[r]
                elif a.op in SENDS:
                    key = (a.peer, a.tag)
                    if a.peer == r:  # the V's bottom: handed over in memory
                        arrived[key] = clock[r]
                    elif coupled:  # blocked until the transfer into the posted receive is done
                        if key not in posted:
                            break
                        clock[r] = max(clock[r], posted[key]) + latency
                        arrived[key] = clock[r]
                    else:
                        arrived[key] = clock[r] + latency
                else:
                    g = global_chunk(p, r, a.chunk, schedule.v_shape)
                    need = needed_message(a.op, g, a.mb, p, schedule.v, schedule.m, schedule.v_shape)
                    if need is not None:
                        key = (r, need[1])
                        if key not in arrived or key not in posted:
                            break
                        clock[r] = max(clock[r], arrived[key])
                    start = clock[r]
                    clock[r] += duration(r, a) if duration is not None else times[a.op]
                    timeline[r].append((start, clock[r], a))
                    live[r] += {Op.FORWARD: 1, Op.BACKWARD: -1}.get(a.op, 0)
                    held[r] += 1 if a.op is Op.FORWARD else -1 if a.op is release else 0
                    peak[r], peak_held[r] = max(peak[r], live[r]), max(peak_held[r], held[r])
                pos[r] += 1
                progressed = True
        if all(pos[r] == len(schedule.ranks[r]) for r in range(p)):
            break
        if not progressed:
            stuck = {r: str(schedule.ranks[r][pos[r]]) for r in range(p) if pos[r] < len(schedule.ranks[r])}
            raise Deadlock(f"{schedule.kind} p={p} v={schedule.v} m={schedule.m}: stuck {stuck}")
    makespan = max(clock)
    busy = [sum(e - s for s, e, _ in tl) for tl in timeline]
    return SimResult(makespan, busy, [makespan - b for b in busy], peak, peak_held, timeline)
