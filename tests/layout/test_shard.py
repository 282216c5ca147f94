"""ShardSpec: the one piece of layout metadata a local tensor carries."""

import copy
import pickle

import torch

from megascale.layout.shard import ShardSpec, local_piece, set_shard_spec, shard_spec, tp_slice


def test_an_unannotated_tensor_is_the_whole_parameter():
    t = torch.zeros(3, 4)
    assert shard_spec(t) == ShardSpec((3, 4)) and shard_spec(t).matrix
    assert not shard_spec(torch.zeros(5)).matrix


def test_pieces_are_cut_from_the_whole():
    whole = torch.arange(24.0).view(4, 6)
    spec = ShardSpec((4, 6), tp_dim=1, tp_rank=1, tp_size=2)
    assert torch.equal(tp_slice(whole, spec), whole[:, 3:])
    flat = spec.with_flat_range(8, 14)  # past the 12 elements of the slice: zero padding
    assert torch.equal(local_piece(whole, flat), torch.tensor([17.0, 21.0, 22.0, 23.0, 0, 0]))
    assert flat.matrix  # a flat ZeRO shard of a matrix still decays like one


def test_groups_add_up_stay_in_process_and_never_compare():
    tp, dp = object(), object()
    spec = ShardSpec((8,)).split_over(tp, None).split_over(dp).with_sp_partial()
    assert spec.groups == (tp, dp) and spec.sp_partial
    assert spec == ShardSpec((8,), sp_partial=True)  # groups are runtime state, not identity
    sent = pickle.loads(pickle.dumps(spec))  # to another process: its groups are not ours
    assert sent == spec and sent.groups == ()
    assert copy.deepcopy(spec) is spec  # immutable; a copied model keeps its groups
    t = torch.zeros(8)
    set_shard_spec(t, spec)
    assert shard_spec(copy.deepcopy(t)).groups == (tp, dp)
