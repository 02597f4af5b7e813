"""Multi-rank tests of the optimizer-state average through the bridge (issue 12)."""

import numpy as np
import pytest
import torch
from mpi4py import MPI

from flodl_mpi.transport.bridge import Bridge
from flodl_mpi.training.models import digits_mlp
from flodl_mpi.protocol.optimizer_state import OptimizerStateAverager
from flodl_mpi.training.replica import Replica

pytestmark = pytest.mark.mpi


def setup(opt: str, mode: str, gamma: float):
    torch.manual_seed(0)
    replica = Replica(digits_mlp((64,), 10, hidden=16), torch.device("cpu"))
    bridge = Bridge(MPI.COMM_WORLD.Dup(), [tuple(p.shape) for p in replica.params],
                    [tuple(b.shape) for b in replica.float_buffers], gamma=gamma, chunk_elems=100)
    replica.bind(bridge)
    make = {"adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
            "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)}[opt]
    optimizer = make(replica.model.parameters())
    averager = OptimizerStateAverager(optimizer, mode)
    bridge.attach_optimizer_state(averager)
    bridge.start()
    return replica, bridge, optimizer, averager


def train(replica, optimizer, rank: int, n: int) -> None:
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(n):
        x = torch.randn(32, 64, generator=gen) * (1 + rank)
        y = torch.randint(0, 10, (32,), generator=gen)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(replica.model(x), y).backward()
        optimizer.step()


def state_of(optimizer, key: str) -> np.ndarray:
    ps = [p for g in optimizer.param_groups for p in g["params"]]
    return np.concatenate([optimizer.state[p][key].numpy().astype(np.float64).ravel() for p in ps])


def one_round(replica, bridge, optimizer, averager, steps: int):
    replica.snapshot(bridge)
    averager.fill(bridge.state_tensors)
    update = bridge.round(steps=steps, window=steps)
    assert update.adopted
    replica.adopt(bridge)
    averager.adopt(bridge.state_tensors)


@pytest.mark.parametrize("opt,keys", [("adam", ("exp_avg", "exp_avg_sq")), ("sgd", ("momentum_buffer",))])
def test_mean_of_the_state_matches_a_float64_reference_for_unequal_steps(opt, keys):
    """``mean``: every state tensor becomes the mass-weighted mean (rank r trained r + 1 steps, gamma 0.5)."""
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    gamma = 0.5
    replica, bridge, optimizer, averager = setup(opt, "mean", gamma)
    steps = rank + 1
    train(replica, optimizer, rank, steps)
    before = {k: comm.allgather(state_of(optimizer, k)) for k in keys}
    counters = [float(s["step"]) for s in optimizer.state.values()] if opt == "adam" else []
    one_round(replica, bridge, optimizer, averager, steps)
    bridge.close()
    masses = np.array([(r + 1) ** gamma for r in range(size)])
    for k in keys:
        ref = sum(m * s for m, s in zip(masses, before[k])) / masses.sum()
        got = state_of(optimizer, k)
        np.testing.assert_allclose(got, ref, rtol=2e-6, atol=1e-9)
        assert not np.allclose(before[k][0], ref)  # the round changed something
    # Step counters stay each rank's own (integer-like state never travels).
    if opt == "adam":
        assert counters == [float(s["step"]) for s in optimizer.state.values()] == [float(steps)] * len(counters)


def test_corrected_second_moment_matches_a_float64_reference_for_unequal_steps():
    """``corrected``: m is the mass-weighted mean; v is rebuilt from it (hand-derivable float64 formula)."""
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    replica, bridge, optimizer, averager = setup("adam", "corrected", 1.0)
    train(replica, optimizer, rank, 2)  # a common start: each rank 2 steps, then a round
    one_round(replica, bridge, optimizer, averager, 2)
    m_prev, v_prev = state_of(optimizer, "exp_avg"), state_of(optimizer, "exp_avg_sq")
    assert np.array_equal(np.vstack(comm.allgather(m_prev)), np.tile(m_prev, (size, 1)))
    steps = rank + 1  # unequal windows
    train(replica, optimizer, rank, steps)
    m_all = comm.allgather(state_of(optimizer, "exp_avg"))
    one_round(replica, bridge, optimizer, averager, steps)
    bridge.close()
    w = np.arange(1, size + 1, dtype=np.float64)
    w /= w.sum()
    m_ref = sum(wr * m for wr, m in zip(w, m_all))
    b1 = float(np.dot(w, 0.9 ** np.arange(1, size + 1)))
    b2 = float(np.dot(w, 0.999 ** np.arange(1, size + 1)))
    g = (m_ref - b1 * m_prev) / (1 - b1)
    v_ref = b2 * v_prev + (1 - b2) * g * g
    np.testing.assert_allclose(state_of(optimizer, "exp_avg"), m_ref, rtol=2e-6, atol=1e-9)
    np.testing.assert_allclose(state_of(optimizer, "exp_avg_sq"), v_ref, rtol=1e-4, atol=1e-10)
    got = comm.allgather(state_of(optimizer, "exp_avg_sq"))
    assert all(np.array_equal(got[0], x) for x in got)  # the same on every rank
    assert [float(s["step"]) for s in optimizer.state.values()] == [2.0 + steps] * len(optimizer.state)
