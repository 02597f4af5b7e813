"""Async's adoptions on hand-worked values: delta (consensus + own steps since the snapshot) and EASGD.

No MPI: a stand-in for the bridge holds the staging the round wrote its consensus into.
"""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from flodl_mpi.worker import Replica


class Tiny(nn.Module):
    """One parameter [a, b] and one floating buffer [c]."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, 2.0]))
        self.register_buffer("stat", torch.tensor([5.0]))


def staging(replica: Replica) -> SimpleNamespace:
    """The bridge's staging: float32 tensors of the params' and buffers' shapes, apart from the model."""
    return SimpleNamespace(param_tensors=[torch.zeros_like(p) for p in replica.params],
                           buffer_tensors=[torch.zeros_like(b) for b in replica.float_buffers])


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _round(replica, bridge, consensus, buffer_consensus, trained):
    """Snapshot, train on (the round runs meanwhile), the round's consensus lands in the staging."""
    replica.snapshot(bridge)
    with torch.no_grad():
        replica.params[0].copy_(torch.tensor(trained))
        replica.float_buffers[0].copy_(torch.tensor([7.0]))
    bridge.param_tensors[0].copy_(torch.tensor(consensus))
    bridge.buffer_tensors[0].copy_(torch.tensor(buffer_consensus))


def test_delta_adoption_is_the_consensus_plus_the_ranks_own_steps_since_the_snapshot():
    # snapshot [1, 2]; trained on to [1.5, 1]; consensus [3, 4]:
    # delta: [3 + (1.5 - 1), 4 + (1 - 2)] = [3.5, 3]. The buffer by the same rule:
    # snapshot 5, trained on to 7, consensus 9: 9 + (7 - 5) = 11.
    replica = Replica(Tiny(), torch.device("cpu"))
    replica.keep_snapshot = True
    bridge = staging(replica)
    _round(replica, bridge, [3.0, 4.0], [9.0], trained=[1.5, 1.0])
    kept, live = replica.kept[0], replica.params[0]
    assert torch.equal(kept, torch.tensor([1.0, 2.0]))  # the snapshot, kept through the training after it
    assert not _overlap(kept, live) and not _overlap(kept, bridge.param_tensors[0])
    replica.adopt(bridge, delta=True)
    assert torch.equal(replica.params[0].detach(), torch.tensor([3.5, 3.0]))
    assert torch.equal(replica.float_buffers[0], torch.tensor([11.0]))
    assert replica.params[0] is live  # in place: the optimizer's Parameter keeps its storage


def test_easgd_adoption_blends_the_consensus_in():
    # live [1.5, 1], consensus [3, 4], alpha 0.5: [1.5 + 0.5 (3 - 1.5), 1 + 0.5 (4 - 1)] = [2.25, 2.5];
    # the buffer likewise: 7 + 0.5 (9 - 7) = 8.
    replica = Replica(Tiny(), torch.device("cpu"))
    bridge = staging(replica)
    _round(replica, bridge, [3.0, 4.0], [9.0], trained=[1.5, 1.0])
    replica.adopt(bridge, alpha=0.5)
    assert torch.equal(replica.params[0].detach(), torch.tensor([2.25, 2.5]))
    assert torch.equal(replica.float_buffers[0], torch.tensor([8.0]))


def test_delta_with_nothing_trained_since_the_snapshot_is_the_consensus_exactly():
    replica = Replica(Tiny(), torch.device("cpu"))
    replica.keep_snapshot = True
    bridge = staging(replica)
    replica.snapshot(bridge)
    bridge.param_tensors[0].copy_(torch.tensor([0.1, 0.7]))
    replica.adopt(bridge, delta=True)
    assert torch.equal(replica.params[0].detach(), torch.tensor([0.1, 0.7]))


def test_the_kept_snapshot_is_written_in_place_each_round_and_never_aliases():
    replica = Replica(Tiny(), torch.device("cpu"))
    replica.keep_snapshot = True
    bridge = staging(replica)
    _round(replica, bridge, [3.0, 4.0], [9.0], trained=[1.5, 1.0])
    first = replica.kept[0]
    replica.adopt(bridge, delta=True)
    _round(replica, bridge, [0.0, 0.0], [0.0], trained=[4.0, 4.0])
    assert replica.kept[0] is first and torch.equal(first, torch.tensor([3.5, 3.0]))  # the second snapshot
    for kept in replica.kept:
        for t in (*replica.params, *bridge.param_tensors):
            assert not _overlap(kept, t)


def test_delta_refuses_without_a_kept_snapshot_or_with_a_blend():
    replica = Replica(Tiny(), torch.device("cpu"))
    bridge = staging(replica)
    replica.snapshot(bridge)
    with pytest.raises(ValueError, match="a delta adoption needs alpha 1 and the params kept at the last snapshot"):
        replica.adopt(bridge, delta=True)
    replica.keep_snapshot = True
    replica.snapshot(bridge)
    with pytest.raises(ValueError, match="a delta adoption needs alpha 1"):
        replica.adopt(bridge, alpha=0.5, delta=True)


def test_consensus_in_place_holds_the_consensus_then_gives_the_live_values_back():
    replica = Replica(Tiny(), torch.device("cpu"))
    replica.keep_snapshot = True
    bridge = staging(replica)
    _round(replica, bridge, [3.0, 4.0], [9.0], trained=[1.5, 1.0])
    with replica.consensus_in_place(bridge):
        assert torch.equal(replica.params[0].detach(), torch.tensor([3.0, 4.0]))
        assert torch.equal(replica.float_buffers[0], torch.tensor([9.0]))
    assert torch.equal(replica.params[0].detach(), torch.tensor([1.5, 1.0]))
    assert torch.equal(replica.float_buffers[0], torch.tensor([7.0]))
    replica.adopt(bridge, delta=True)  # the adoption that follows is the regular one
    assert torch.equal(replica.params[0].detach(), torch.tensor([3.5, 3.0]))
