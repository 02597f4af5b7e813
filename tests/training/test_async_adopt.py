"""Async's adoptions on hand-worked values: delta (consensus + own steps since the snapshot) and EASGD
(theta + alpha (consensus - snapshot): the elastic pull at the snapshot, the own steps kept).

No MPI: a stand-in for the bridge holds the staging the round wrote its consensus into.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from flodl_mpi.training.replica import Replica


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


def test_easgd_adoption_pulls_at_the_snapshot_and_keeps_the_ranks_own_steps():
    # EASGD's elastic pull is computed where the round measured it, at the snapshot:
    # theta + alpha (consensus - snapshot). Snapshot [1, 2], trained on to [1.5, 1],
    # consensus [3, 4], alpha 0.5: [1.5 + 0.5 (3 - 1), 1 + 0.5 (4 - 2)] = [2.5, 2];
    # the buffer likewise: 7 + 0.5 (9 - 5) = 9. (Blending the live values instead,
    # theta + alpha (consensus - theta), gave [2.25, 2.5] and 8: it also pulled back half
    # of the steps trained since the snapshot.)
    snap, live, cons = np.array([1.0, 2.0]), np.array([1.5, 1.0]), np.array([3.0, 4.0])
    for alpha in (0.5, 0.25, 0.1):
        replica = Replica(Tiny(), torch.device("cpu"))
        replica.keep_snapshot = True
        bridge = staging(replica)
        _round(replica, bridge, cons.tolist(), [9.0], trained=live.tolist())
        replica.adopt(bridge, alpha=alpha, delta=True)
        np.testing.assert_allclose(replica.params[0].detach().numpy(), live + alpha * (cons - snap), rtol=0,
                                   atol=1e-6)
        np.testing.assert_allclose(replica.float_buffers[0].numpy(), [7.0 + alpha * (9.0 - 5.0)], rtol=0, atol=1e-6)
    assert torch.equal(replica.params[0].detach(), torch.tensor([1.5 + 0.1 * 2, 1.0 + 0.1 * 2]))


def test_easgd_at_alpha_one_is_the_delta_adoption_bit_for_bit():
    got = []
    for alpha in (1.0, None):
        replica = Replica(Tiny(), torch.device("cpu"))
        replica.keep_snapshot = True
        bridge = staging(replica)
        _round(replica, bridge, [0.3, 0.7], [0.9], trained=[1.1, 2.3])
        replica.adopt(bridge, delta=True) if alpha is None else replica.adopt(bridge, alpha=alpha, delta=True)
        got.append((replica.params[0].detach().clone(), replica.float_buffers[0].clone()))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])


def _easgd_reference(steps: np.ndarray, alpha: float, windows: int) -> np.ndarray:
    """Float64 reference of async EASGD over equal-mass ranks: per window each rank moves by its
    ``steps``; the round in flight (snapshot s, consensus c = mean(s)) is adopted as
    theta + alpha (c - s); then the next snapshot. Returns the last round's consensus."""
    theta = np.zeros_like(steps)
    snap = None
    for _ in range(windows):
        theta = theta + steps
        if snap is not None:
            theta = theta + alpha * (snap.mean(axis=0) - snap)
        snap = theta.copy()
    return snap.mean(axis=0)


@pytest.mark.parametrize("alpha", [0.5, 0.25, 1.0])
def test_async_easgd_advances_the_ranks_mean_at_their_full_pace(alpha):
    # Two ranks, one parameter of 2 elements each; rank r moves by steps[r] every window.
    # The pull keeps the mean (equal masses), so after k windows the consensus is
    # k * mean(steps), whatever alpha: [6 * 1, 6 * -0.5] = [6, -3]. The old live
    # blend advanced it by (1 - alpha) of that per window: at alpha 1, not at all.
    steps = np.array([[1.0, -1.0], [1.0, 0.0]])
    windows = 6
    replicas = [Replica(Tiny(), torch.device("cpu")) for _ in steps]
    bridges = [staging(r) for r in replicas]
    for r in replicas:
        r.keep_snapshot = True
        with torch.no_grad():
            r.params[0].zero_()
    in_flight = False
    for _ in range(windows):
        for r, d in zip(replicas, steps):
            with torch.no_grad():
                r.params[0].add_(torch.from_numpy(d).float())
        if in_flight:
            mean = sum(b.param_tensors[0] for b in bridges) / len(bridges)
            for r, b in zip(replicas, bridges):
                b.param_tensors[0].copy_(mean)
                r.adopt(b, alpha=alpha, delta=True)
        for r, b in zip(replicas, bridges):
            r.snapshot(b)
        in_flight = True
    consensus = (sum(b.param_tensors[0] for b in bridges) / len(bridges)).numpy()
    np.testing.assert_allclose(consensus, _easgd_reference(steps, alpha, windows), rtol=0, atol=1e-5)
    np.testing.assert_allclose(consensus, windows * steps.mean(axis=0), rtol=0, atol=1e-5)


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


def test_delta_refuses_without_a_kept_snapshot_and_a_pull_without_delta():
    replica = Replica(Tiny(), torch.device("cpu"))
    bridge = staging(replica)
    replica.snapshot(bridge)
    with pytest.raises(ValueError, match="a delta adoption needs the params kept at the last snapshot"):
        replica.adopt(bridge, delta=True)
    replica.keep_snapshot = True
    replica.snapshot(bridge)
    with pytest.raises(ValueError, match="a pull alpha < 1 is computed at the snapshot: it needs delta = True"):
        replica.adopt(bridge, alpha=0.5)
    with pytest.raises(ValueError, match=r"alpha must be in \(0, 1\], got 0"):
        replica.adopt(bridge, alpha=0.0, delta=True)


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
