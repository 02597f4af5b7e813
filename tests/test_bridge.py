"""Multi-rank tests of the bridge thread through its public behaviour."""

import hashlib

import numpy as np
import pytest
import torch
from mpi4py import MPI

from flodl_mpi.bridge import Bridge
from flodl_mpi.divergence import divergence_triple
from flodl_mpi.errors import InputError, NonFiniteError, RoundError
from flodl_mpi.models import digits_mlp
from flodl_mpi.worker import Replica
from flodl_mpi.world import agree

pytestmark = pytest.mark.mpi


def make_replica() -> Replica:
    torch.manual_seed(0)
    return Replica(digits_mlp((64,), 10, hidden=16), torch.device("cpu"))


def make_bridge(replica: Replica, **kw) -> Bridge:
    bridge = Bridge(
        MPI.COMM_WORLD.Dup(),
        [tuple(p.shape) for p in replica.params],
        [tuple(b.shape) for b in replica.float_buffers],
        **kw,
    )
    bridge.start()
    return bridge


def local_steps(replica: Replica, rank: int, n: int) -> None:
    """n SGD steps on rank-specific data: params and BatchNorm stats diverge."""
    opt = torch.optim.SGD(replica.model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(n):
        x = torch.randn(32, 64, generator=gen) * (1 + rank)
        y = torch.randint(0, 10, (32,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(replica.model(x), y).backward()
        opt.step()


def flat(tensors) -> np.ndarray:
    return np.concatenate([t.detach().numpy().astype(np.float64).ravel() for t in tensors])


@pytest.mark.parametrize("bound", [False, True], ids=["copies", "bound"])
def test_round_with_batchnorm_matches_reference(bound):
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    replica = make_replica()
    steps = rank + 1  # unequal work
    local_steps(replica, rank, steps)
    pre_params = [p.detach().numpy().copy() for p in replica.params]
    all_params = comm.allgather(flat(replica.params))
    all_buffers = comm.allgather(flat(replica.float_buffers))
    all_steps = comm.allgather(steps)

    gamma = 0.5
    bridge = make_bridge(replica, gamma=gamma, chunk_elems=100)
    if bound:  # the CPU path: params live in the staging, no copies
        assert replica.bind(bridge)
        assert all(p.data_ptr() == v.data_ptr() for p, v in zip(replica.params, bridge.param_tensors))
    replica.snapshot(bridge)
    update = bridge.round(steps=steps, window=steps)
    replica.adopt(bridge)
    bridge.close()

    masses = np.array([n**gamma for n in all_steps])
    ref_params = sum(m * p for m, p in zip(masses, all_params)) / masses.sum()
    ref_buffers = sum(all_buffers) / size  # buffers: equal weight among movers
    got = flat(replica.params)
    assert np.linalg.norm(got - ref_params) / np.linalg.norm(ref_params) <= 1e-6
    np.testing.assert_allclose(flat(replica.float_buffers), ref_buffers, rtol=1e-5, atol=1e-7)
    nbt = replica.model.get_buffer("2.num_batches_tracked")
    assert nbt.dtype == torch.int64 and int(nbt) == steps  # local value, still an integer
    assert update.adopted and update.version == 1 and update.steps_at_snapshot == steps
    d, post_norm, pre_norm = divergence_triple(pre_params, [p.detach().numpy() for p in replica.params])
    assert update.divergence == pytest.approx(d, rel=1e-4)
    assert update.post_norm == pytest.approx(post_norm, rel=1e-6)
    assert update.pre_norm == pytest.approx(pre_norm, rel=1e-6)
    digests = comm.allgather(hashlib.sha256(got.tobytes()).hexdigest())
    assert len(set(digests)) == 1


def test_all_idle_round_is_skipped_and_changes_nothing():
    replica = make_replica()
    local_steps(replica, MPI.COMM_WORLD.rank, 1)  # ranks differ, but nobody reports a step
    before = flat(replica.params), flat(replica.float_buffers)
    bridge = make_bridge(replica)
    replica.snapshot(bridge)
    update = bridge.round(steps=0, window=0)
    if update.adopted:
        replica.adopt(bridge)
    second = bridge.round(steps=0, window=0)
    bridge.close()
    assert not update.adopted and update.divergence == 0.0
    assert (update.version, second.version) == (1, 2)  # skipped rounds still count
    np.testing.assert_array_equal(flat(replica.params), before[0])
    np.testing.assert_array_equal(flat(replica.float_buffers), before[1])
    assert update.pre_norm == pytest.approx(np.linalg.norm(before[0]), rel=1e-6)


def test_stop_flag_from_one_rank_reaches_every_rank():
    replica = make_replica()
    bridge = make_bridge(replica)
    replica.snapshot(bridge)
    update = bridge.round(steps=1, window=1, stop=MPI.COMM_WORLD.rank == MPI.COMM_WORLD.size - 1)
    bridge.close()
    assert update.stop


def test_error_in_a_round_crosses_to_the_training_thread():
    def fault(round_, stage):
        if stage == "params reduce":  # every rank, before the collective: nobody is left waiting
            raise MemoryError("staging allocation failed (injected)")

    replica = make_replica()
    bridge = make_bridge(replica, fault=fault)
    replica.snapshot(bridge)
    with pytest.raises(RoundError, match=r"round 0 failed at stage 'params reduce': MemoryError"):
        bridge.round(steps=1, window=1)
    with pytest.raises(RoundError, match="already failed"):
        bridge.round(steps=1, window=1)


def test_non_finite_params_name_the_rank_on_every_rank():
    comm = MPI.COMM_WORLD
    replica = make_replica()
    bad = comm.size - 1
    if comm.rank == bad:
        with torch.no_grad():
            replica.params[0][0, 0] = float("nan")
    bridge = make_bridge(replica)
    replica.snapshot(bridge)
    with pytest.raises(NonFiniteError, match=rf"rank\(s\) {bad} had NaN"):
        bridge.round(steps=1, window=1)


def test_agree_turns_one_rank_failure_into_an_error_everywhere():
    comm = MPI.COMM_WORLD

    def step():
        if comm.rank == comm.size - 1:
            raise FileNotFoundError("--data 'x.h5': no such file")
        return comm.rank

    prefix = f"rank\\(s\\) {comm.size - 1}: " if comm.size > 1 else ""
    with pytest.raises(InputError, match=f"^{prefix}--data 'x.h5': no such file$"):
        agree(comm, "data", step)
    def missing_everywhere():
        raise FileNotFoundError("--data 'x.h5': no such file")

    with pytest.raises(InputError, match="^--data 'x.h5': no such file$"):  # every rank alike: no prefix
        agree(comm, "data", missing_everywhere)
    assert agree(comm, "ok", lambda: comm.rank * 2) == comm.rank * 2
