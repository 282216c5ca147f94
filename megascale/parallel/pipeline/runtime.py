"""Plays a pipeline schedule on this rank with decoupled, asynchronous point-to-point traffic.

Each SEND is an `isend` whose handle is kept and waited lazily (completed ones are dropped as
the step goes, the rest at its end), so a send never blocks the next receive or compute. Each
RECV is an `irecv` posted where the schedule puts it (a couple of computes ahead), and a
compute waits only for its own receive. In warm-up and cool-down a forward therefore depends
on nothing but its input; in the steady phase the receives of the next actions and the sends
of the previous ones are in flight while this one computes (MegaScale section 3.2).

Under a zero-bubble schedule (`Schedule.split`) the chunks get the split backward
(`parallel/weight_grad.py`): a chunk's forward and its B run under `weight_grad.deferring` with
that (micro-batch, chunk)'s list of weight-gradient work, which its W action runs; ZeRO's
hooks then fire in W, and `after_backward` follows a chunk's last W.

Every action is timed (`pp.forward`/`pp.backward`/`pp.weight` as compute; `pp.send`, `pp.recv` and
`pp.send_wait` as p2p; `pp.send_drain` is the end-of-step wait for the last sends, when the
rank has no work left), so the bubble and the exposed communication of each rank are measured,
not guessed.

Activation shapes are not derived from the config (tensor/sequence parallel layouts change
them): the first activation sent across each chunk boundary is preceded by a small shape
message, and the receiver caches it. Gradients have the shape of the activation they answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from megascale.config.schema import JobConfig
from megascale.data import TokenBatch
from megascale.diagnostics.timers import get_timers
from megascale.parallel import weight_grad
from megascale.parallel.pipeline.schedule import (
    DEFAULT_LOOKAHEAD,
    SPLIT_KINDS,
    V_SHAPED,
    Action,
    Op,
    Schedule,
    build_schedule,
    global_chunk,
)
from megascale.parallel.runner import ModelRunner

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
_META_LEN = 8  # [dtype code, ndim, up to 6 dims]
_META_TAG = 1 << 28  # + boundary index; far above any message tag of a step


@dataclass
class _Recv:
    """A receive: posted at once when its shape is known, else at its wait (first step)."""

    peer: int
    tag: int
    shape: tuple[tuple[int, ...], torch.dtype] | None
    work: dist.Work | None = None
    buffer: torch.Tensor | None = None
    local: bool = False  # from another chunk of this rank (the V's bottom): handed over in memory


@dataclass
class _Step:
    """What one call of the schedule keeps between actions."""

    batch: TokenBatch | None
    token_count: int | None  # None: forward only
    acts: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    grads: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    weight_work: dict[tuple[int, int], list[weight_grad.WeightWork]] = field(default_factory=dict)
    recvs: dict[tuple[Op, int, int], _Recv] = field(default_factory=dict)
    loss: torch.Tensor | None = None


class PipelineRunner(ModelRunner):
    """Runs this rank's `v` chunks under the 1F1B (interleaved when v > 1), GPipe, ZB-H1 or
    ZB-V schedule (the zero-bubble ones split the chunks' backward, in place, when the runner
    is made; ZB-V's chunks must have been cut in a V, `split_model(..., v_shape=True)`).

    `decoupled=False` waits for each send right after posting it: a comparison mode for the
    benchmark (what bundled send/recv costs), never the training default. It takes effect
    from the second call: the first one learns activation shapes with receives posted only
    when needed, which a send waiting for its receive could deadlock."""

    def __init__(
        self, chunks: list[nn.Module], cfg: JobConfig, mesh, lookahead: int = DEFAULT_LOOKAHEAD, decoupled: bool = True
    ) -> None:
        super().__init__(chunks, cfg, mesh)
        self.p = mesh.pp_size
        self.v = len(chunks)
        self.rank = mesh.pp_rank
        self.kind = cfg.parallel.schedule
        self.lookahead = lookahead
        self.decoupled = decoupled
        self.group = mesh.pp_group
        c = mesh.coords
        self._peers = [mesh.grid.rank_of(r, c.dp, c.tp, c.cp) for r in range(self.p)]
        self._schedules: dict[tuple[str, int], Schedule] = {}
        self._grads_final: dict[tuple[str, int], dict[int, int]] = {}
        self._in_shape: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}  # by local chunk
        self._out_shape: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}
        self._sends: list[tuple[dist.Work, torch.Tensor, int]] = []
        self.v_shape = self.kind in V_SHAPED
        self._local: dict[int, torch.Tensor] = {}  # tag -> tensor passed between this rank's chunks
        placed = [getattr(chunk, "index", None) for chunk in chunks]
        wanted = [global_chunk(self.p, self.rank, c, self.v_shape) for c in range(self.v)]
        if self.p > 1 and placed != wanted:
            raise ValueError(
                f"pipeline rank {self.rank} holds global chunks {placed} but parallel.schedule="
                f"{self.kind!r} places {wanted} there: cut the model with split_model(..., "
                f"v_shape={self.v_shape})"
            )
        if self.v_shape and not decoupled:
            raise ValueError(
                f"parallel.schedule={self.kind!r} deadlocks when each send waits for its receive "
                "(rank 0 runs 2p-1 forwards before its first backward): use decoupled=True"
            )
        self._warm = False  # a whole step has run: every activation shape is known
        if self.kind in SPLIT_KINDS:
            for chunk in chunks:
                weight_grad.split_backward(chunk)

    # ------------------------------------------------------------------ the runner interface
    def forward_backward(self, batch: TokenBatch | None, token_count: int) -> torch.Tensor:
        self.scale_aux_losses(token_count)
        return self._run(self.kind, _Step(batch, token_count))

    @torch.no_grad()
    def eval_loss_sum(self, batch: TokenBatch | None) -> torch.Tensor:
        return self._run("forward", _Step(batch, None))

    def schedule(self, kind: str, m: int) -> Schedule:
        key = (kind, m)
        if key not in self._schedules:
            sched = build_schedule(kind, self.p, self.v, m, self.lookahead, self.v_shape)
            self._schedules[key] = sched
            self._grads_final[key] = sched.grads_final(self.rank)
        return self._schedules[key]

    # ------------------------------------------------------------------ execution
    def _run(self, kind: str, step: _Step) -> torch.Tensor:
        m = self._micro_batches(step.batch)
        sched = self.schedule(kind, m)
        grads_final = self._grads_final[(kind, m)]
        timers = get_timers()
        for i, action in enumerate(sched.ranks[self.rank]):
            op = action.op
            if op in (Op.FORWARD, Op.BACKWARD) and sched.split:
                work = step.weight_work.setdefault((action.mb, action.chunk), [])
                with weight_grad.deferring(work):
                    self._compute(action, step, timers)
            elif op is Op.WEIGHT:
                with timers.span("pp.weight", kind="compute", mb=action.mb, chunk=action.chunk):
                    weight_grad.run(step.weight_work.pop((action.mb, action.chunk)))
            elif op in (Op.FORWARD, Op.BACKWARD):
                self._compute(action, step, timers)
            if self.grad_sync is not None and grads_final.get(action.chunk) == i:
                self.grad_sync.after_backward(action.chunk)
            if op is Op.SEND_ACT:
                self._send_act(action, step, timers)
            elif op is Op.SEND_GRAD:
                self._send(step.grads.pop((action.mb, action.chunk)), action, timers)
            elif op in (Op.RECV_ACT, Op.RECV_GRAD):
                self._post_recv(action, step)
        with timers.span("pp.send_drain", kind="p2p", group="pp"):  # this rank's work is done
            for work, _, _ in self._sends:
                work.wait()
        self._sends.clear()
        self._warm = True
        assert not (step.acts or step.grads or step.recvs or step.weight_work or self._local), "schedule left state"
        if step.loss is None:  # not the last stage
            return torch.zeros((), dtype=torch.float64, device=self._device)
        return step.loss

    def _compute(self, a: Action, step: _Step, timers) -> None:
        if a.op is Op.FORWARD:
            self._forward(a, step, timers)
        else:
            self._backward(a, step, timers)

    def _forward(self, a: Action, step: _Step, timers) -> None:
        chunk = self.chunks[a.chunk]
        if self.grad_sync is not None:
            self.grad_sync.before_forward(a.chunk)
        if chunk.is_first:
            x = step.batch.inputs[a.mb].to(self._device)
        else:
            x = self._wait_recv(step.recvs.pop((Op.RECV_ACT, a.mb, a.chunk)), a, timers)
            x.requires_grad_(step.token_count is not None)
        with timers.span("pp.forward", kind="compute", mb=a.mb, chunk=a.chunk), self.autocast():
            if chunk.is_last:
                out = chunk(x, step.batch.labels[a.mb].to(self._device))
                loss = out.detach().double()
                step.loss = loss if step.loss is None else step.loss + loss
            else:
                out = chunk(x)
        if step.token_count is not None or not chunk.is_last:  # kept for backward or send
            step.acts[(a.mb, a.chunk)] = (x, out)

    def _backward(self, a: Action, step: _Step, timers) -> None:
        chunk = self.chunks[a.chunk]
        x, out = step.acts.pop((a.mb, a.chunk))
        if chunk.is_last:
            target, grad = out / step.token_count, None
        else:
            target = out
            grad = self._wait_recv(step.recvs.pop((Op.RECV_GRAD, a.mb, a.chunk)), a, timers)
        with timers.span("pp.backward", kind="compute", mb=a.mb, chunk=a.chunk):
            torch.autograd.backward(target, grad)
        if not chunk.is_first:
            step.grads[(a.mb, a.chunk)] = x.grad

    def _send_act(self, a: Action, step: _Step, timers) -> None:
        key = (a.mb, a.chunk)
        x, out = step.acts[key]
        tensor = out.detach().contiguous()
        if step.token_count is None:  # forward only: nothing to keep for a backward
            del step.acts[key]
        meta = (tuple(tensor.shape), tensor.dtype)
        announced = self._out_shape.get(a.chunk)
        g = global_chunk(self.p, self.rank, a.chunk, self.v_shape)
        if announced is None:
            self._out_shape[a.chunk] = meta
            if a.peer != self.rank:
                encoded = _encode(meta, tensor.device)
                self._sends.append((self._isend(encoded, a.peer, _META_TAG + g), encoded, a.peer))
        elif announced != meta:
            raise RuntimeError(
                f"pipeline activation of chunk {g} changed from "
                f"{announced} to {meta}; every micro-batch of a run must have one shape"
            )
        self._send(tensor, a, timers)

    def _send(self, tensor: torch.Tensor, a: Action, timers) -> None:
        if a.peer == self.rank:  # to this rank's other chunk
            self._local[a.tag] = tensor
            return
        peer = self._peers[a.peer]
        with timers.span("pp.send", kind="p2p", group="pp", peer=peer, mb=a.mb, chunk=a.chunk):
            work = self._isend(tensor, a.peer, a.tag)
        if not self.decoupled and self._warm:
            with timers.span("pp.send_wait", kind="p2p", group="pp", peer=peer, mb=a.mb):
                work.wait()
            return
        self._sends = [s for s in self._sends if not s[0].is_completed()]
        self._sends.append((work, tensor, a.peer))

    def _post_recv(self, a: Action, step: _Step) -> None:
        shape = self._shapes(a.op is Op.RECV_ACT).get(a.chunk)
        recv = _Recv(a.peer, a.tag, shape, local=a.peer == self.rank)
        if shape is not None and not recv.local:
            self._start_recv(recv)
        step.recvs[(a.op, a.mb, a.chunk)] = recv

    def _shapes(self, activation: bool) -> dict[int, tuple[tuple[int, ...], torch.dtype]]:
        """Incoming activations have the shape announced by the previous chunk; a gradient has
        the shape of the activation this chunk sent."""
        return self._in_shape if activation else self._out_shape

    def _start_recv(self, recv: _Recv) -> None:
        shape, dtype = recv.shape
        recv.buffer = torch.empty(shape, dtype=dtype, device=self._device)
        recv.work = dist.irecv(recv.buffer, src=self._peers[recv.peer], group=self.group, tag=recv.tag)

    def _wait_recv(self, recv: _Recv, a: Action, timers) -> torch.Tensor:
        if recv.local:  # the schedule ran the producing chunk first (checked by `simulate`)
            return self._local.pop(recv.tag)
        peer = self._peers[recv.peer]
        with timers.span("pp.recv", kind="p2p", group="pp", peer=peer, mb=a.mb, chunk=a.chunk):
            if recv.work is None:  # first activation over this boundary: learn its shape
                if a.op is Op.FORWARD and a.chunk not in self._in_shape:
                    meta = torch.empty(_META_LEN, dtype=torch.int64, device=self._device)
                    boundary = global_chunk(self.p, self.rank, a.chunk, self.v_shape) - 1
                    dist.recv(meta, src=peer, group=self.group, tag=_META_TAG + boundary)
                    self._in_shape[a.chunk] = _decode(meta)
                recv.shape = self._shapes(a.op is Op.FORWARD)[a.chunk]
                self._start_recv(recv)
            recv.work.wait()
        return recv.buffer

    def _isend(self, tensor: torch.Tensor, peer: int, tag: int) -> dist.Work:
        return dist.isend(tensor, dst=self._peers[peer], group=self.group, tag=tag)

    def _micro_batches(self, batch: TokenBatch | None) -> int:
        m = self.cfg.micro_batches_of(self.mesh.dp_rank)
        if batch is not None and batch.inputs.shape[0] != m:
            raise ValueError(
                f"batch has {batch.inputs.shape[0]} micro-batches but the layout expects {m} on dp rank "
                f"{self.mesh.dp_rank} ({self.cfg.shares.describe()}); every pipeline stage must run the same number"
            )
        needs = [c.is_first or c.is_last for c in self.chunks]
        if batch is None and any(needs):
            raise ValueError("the first and last pipeline stages need the batch (tokens/labels)")
        return m


def _encode(meta: tuple[tuple[int, ...], torch.dtype], device: torch.device) -> torch.Tensor:
    shape, dtype = meta
    if len(shape) > _META_LEN - 2:
        raise ValueError(f"pipeline activations of rank {len(shape)} are not supported")
    values = [_DTYPES.index(dtype), len(shape), *shape]
    return torch.tensor(values + [0] * (_META_LEN - len(values)), dtype=torch.int64, device=device)


def _decode(meta: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    values = meta.tolist()
    return tuple(values[2 : 2 + values[1]]), _DTYPES[values[0]]
