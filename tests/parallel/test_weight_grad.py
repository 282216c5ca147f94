"""The split backward on one process: under `weight_grad.deferring` a backward (B) gives the
input gradients and leaves every split layer's weight gradient for `run` (W), which yields the
gradients of the plain backward. Checked by order: which parameters' post-accumulate-grad hooks
(ZeRO's trigger) fire in B and which in W."""

from __future__ import annotations

import contextlib
import copy
import weakref

import pytest
import torch

from megascale.config import ModelConfig
from megascale.model import GPT
from megascale.model.efficiency import apply_recompute
from megascale.model.gpt import JoinedWeight
from megascale.parallel import weight_grad

VARIANTS = {
    "serial-layernorm": {},
    "fused-parallel-rmsnorm-swiglu-learned": dict(block="parallel", norm="rmsnorm", mlp="swiglu", positions="learned"),
    "no-bias": dict(bias=False),
}
# the loss computes the head's gradient in its forward; learned positions are an add
NOT_SPLIT = {"head.out.weight", "embed.positions.weight"}


def _models(variant: str, recompute: str) -> tuple[GPT, GPT]:
    cfg = ModelConfig(vocab_size=50, seq_len=16, layers=2, hidden=32, heads=4, **VARIANTS[variant])
    torch.manual_seed(0)
    plain = GPT(cfg)
    for block in plain.blocks:
        block.fuse_gemms = block.fusable
    split = copy.deepcopy(plain)
    weight_grad.split_backward(split)
    apply_recompute(split.blocks, recompute)
    return plain, split


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_b_leaves_weight_gradients_to_w_which_equal_the_plain_backward(variant, recompute):
    plain, split = _models(variant, recompute)
    tokens, labels = torch.randint(0, 50, (2, 2, 16)), torch.randint(0, 50, (2, 2, 16))
    for mb in range(2):  # two micro-batches accumulate, as in a step
        plain(tokens[mb], labels[mb]).backward()
    fired: list[str] = []
    for name, p in split.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, n=name: fired.append(n))
    for mb in range(2):
        work: list = []
        with weight_grad.deferring(work):
            split(tokens[mb], labels[mb]).backward()
        in_b, fired[:] = set(fired), []
        assert in_b == NOT_SPLIT & dict(split.named_parameters()).keys()
        assert work, "B deferred nothing"
        weight_grad.run(work)
        assert sorted(fired) == sorted(n for n, _ in split.named_parameters() if n not in in_b)
        assert not work
        fired.clear()
    for (name, a), b in zip(plain.named_parameters(), split.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_split_layers_are_the_plain_ones_outside_deferring():
    plain, split = _models("serial-layernorm", "none")
    tokens, labels = torch.randint(0, 50, (2, 16)), torch.randint(0, 50, (2, 16))
    assert torch.equal(plain(tokens, labels), split(tokens, labels))
    with pytest.raises(RuntimeError, match="outside weight_grad.deferring"):
        with weight_grad.deferring([]):
            loss = split(tokens, labels)
        loss.backward()


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("split", [False, True], ids=["plain", "split"])
def test_fused_weights_are_rebuilt_for_the_backward_not_kept(split, recompute, monkeypatch):
    """The parallel block's concatenated weights die with its forward (the backward rebuilds
    them), also while a split backward's weight gradients wait for W, and the gradients are
    the unfused model's."""
    cfg = ModelConfig(vocab_size=50, seq_len=16, layers=2, hidden=32, heads=4, block="parallel", mlp="swiglu")
    torch.manual_seed(0)
    unfused = GPT(cfg)
    fused = copy.deepcopy(unfused)
    for block in fused.blocks:
        block.fuse_gemms = True
    if split:
        weight_grad.split_backward(fused)
    apply_recompute(fused.blocks, recompute)
    made: list[weakref.ref] = []
    init = JoinedWeight.__init__

    def recording(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        made.append(weakref.ref(self.weight))

    saved_joined: list[tuple] = []  # what autograd saved on a (live) concatenation's storage

    def pack(t: torch.Tensor) -> torch.Tensor:
        live = {w.untyped_storage()._cdata for w in (ref() for ref in made) if w is not None}
        if t.untyped_storage()._cdata in live:
            saved_joined.append(tuple(t.shape))
        return t

    monkeypatch.setattr(JoinedWeight, "__init__", recording)
    tokens, labels = torch.randint(0, 50, (2, 16)), torch.randint(0, 50, (2, 16))
    unfused(tokens, labels).backward()
    work: list = []
    with weight_grad.deferring(work) if split else contextlib.nullcontext():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = fused(tokens, labels)
        assert len(made) == 2 * cfg.layers and all(ref() is None for ref in made)
        assert not saved_joined
        loss.backward()
    assert all(ref() is None for ref in made)  # also those remade by recomputation
    weight_grad.run(work)
    for (name, a), b in zip(unfused.named_parameters(), fused.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)
