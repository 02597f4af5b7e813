"""Multi-rank tests of the collectives (run under mpiexec with --with-mpi)."""

import hashlib

import numpy as np
import pytest
from mpi4py import MPI

from flodl_mpi.protocol.realized_work import gamma_mass
from flodl_mpi.transport.reduce import control_gather, sumcount_reduce
from flodl_mpi.protocol.wire import WireLayout

pytestmark = pytest.mark.mpi

SHAPES = [(17, 5), (5,), (3, 3, 3), (1,), (40,)]


@pytest.fixture
def comm():
    c = MPI.COMM_WORLD.Dup()
    yield c
    c.Free()


def rank_tensors(r: int) -> list[np.ndarray]:
    """Rank r's tensors; every rank can rebuild every rank's for the reference."""
    rng = np.random.default_rng(1000 + r)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def test_control_gather_gives_every_rank_the_same_matrix(comm):
    row = np.array([comm.rank, 10.0 * comm.rank, -1.0])
    m = control_gather(comm, row)
    expected = np.array([[r, 10.0 * r, -1.0] for r in range(comm.size)])
    np.testing.assert_array_equal(m, expected)


@pytest.mark.parametrize("chunk_elems", [1, 7, 100])
def test_chunked_reduce_equals_the_single_call(comm, chunk_elems):
    # Pieces of chunk_elems elements (down to one per Allreduce call) against one
    # call over the whole frame: every element's sum is the same.
    results = []
    for chunk in (chunk_elems, 10**6):
        layout = WireLayout(SHAPES, chunk_elems=chunk)
        staging = layout.new_staging()
        staging[:] = np.concatenate([t.ravel() for t in rank_tensors(comm.rank)])
        sumcount_reduce(comm, layout, staging, layout.new_frame(), 1.0 + comm.rank, layout.new_scratch())
        results.append(staging)
    assert len(WireLayout(SHAPES, chunk_elems=chunk_elems).chunks) > 1
    assert len(WireLayout(SHAPES, chunk_elems=10**6).chunks) == 1
    np.testing.assert_allclose(results[0], results[1], rtol=1e-6, atol=1e-7)
    assert len(set(comm.allgather(digest(results[0])))) == 1


@pytest.mark.parametrize("chunk_elems", [3, 64, 1 << 18])
def test_consensus_matches_float64_reference(comm, chunk_elems):
    # Unequal step counts and gamma 0.5; with 3+ ranks the last rank is idle.
    gamma = 0.5
    steps = [3 + 2 * r for r in range(comm.size)]
    if comm.size >= 3:
        steps[-1] = 0
    layout = WireLayout(SHAPES, chunk_elems=chunk_elems)
    staging = layout.new_staging()
    for view, t in zip(layout.views(staging), rank_tensors(comm.rank)):
        view[...] = t
    pre = staging.astype(np.float64)
    stats = sumcount_reduce(comm, layout, staging, layout.new_frame(), gamma_mass(steps[comm.rank], gamma),
                            layout.new_scratch())

    masses = [0.0 if n == 0 else n**gamma for n in steps]  # SPEC §1, by hand
    flat = [np.concatenate([t.ravel() for t in rank_tensors(r)]).astype(np.float64) for r in range(comm.size)]
    ref = sum(m * f for m, f in zip(masses, flat)) / sum(masses)
    assert stats.realized
    assert np.linalg.norm(staging - ref) / np.linalg.norm(ref) <= 1e-7  # float64 sums, one float32 rounding
    assert stats.total_mass == pytest.approx(comm.size * sum(masses), rel=1e-12)
    assert stats.post_sq == pytest.approx(float(np.sum(ref**2)), rel=1e-5)
    assert stats.diff_sq == pytest.approx(float(np.sum((pre - ref) ** 2)), rel=1e-4)
    assert len(set(comm.allgather(digest(staging)))) == 1  # identical on every rank


def test_idle_rank_with_nan_does_not_poison_the_consensus(comm):
    layout = WireLayout(SHAPES, chunk_elems=50)
    staging = layout.new_staging()
    idle = comm.size - 1
    if comm.rank == idle and comm.size > 1:
        staging[:] = np.nan
    else:
        staging[:] = 1.0 + comm.rank
    mass = 0.0 if (comm.rank == idle and comm.size > 1) else 1.0
    stats = sumcount_reduce(comm, layout, staging, layout.new_frame(), mass, layout.new_scratch())
    movers = [1.0 + r for r in range(comm.size) if not (r == idle and comm.size > 1)]
    np.testing.assert_allclose(staging, np.mean(movers), rtol=1e-7)
    assert stats.realized


def test_all_idle_mass_is_not_realized_and_keeps_local(comm):
    layout = WireLayout(SHAPES, chunk_elems=16)
    staging = layout.new_staging()
    staging[:] = comm.rank + 0.5
    stats = sumcount_reduce(comm, layout, staging, layout.new_frame(), 0.0, layout.new_scratch())
    assert not stats.realized and stats.total_mass == 0.0
    assert np.all(staging == comm.rank + 0.5)


@pytest.mark.parametrize("scale", [1e19, 1e25, 1e30])
def test_large_finite_values_give_a_finite_consensus_and_norms(comm, scale):
    # float32 squares overflow past ~1.8e19: the sums of squares must be float64 (SPEC §3).
    layout = WireLayout(SHAPES, chunk_elems=64)
    staging = layout.new_staging()
    flat = [np.concatenate([t.ravel() for t in rank_tensors(r)]).astype(np.float32) * np.float32(scale)
            for r in range(comm.size)]
    staging[:] = flat[comm.rank]
    stats = sumcount_reduce(comm, layout, staging, layout.new_frame(), 1.0, layout.new_scratch())
    ref = np.mean([f.astype(np.float64) for f in flat], axis=0)
    assert stats.realized and stats.post_finite
    assert np.linalg.norm(staging - ref) / np.linalg.norm(ref) <= 1e-6
    assert stats.post_sq == pytest.approx(float(np.sum(ref**2)), rel=1e-5)
    assert stats.diff_sq == pytest.approx(float(np.sum((flat[comm.rank] - ref) ** 2)), rel=1e-3)


def test_a_non_finite_reduced_piece_stops_every_rank_before_it_is_unpacked(comm):
    # Rank 0 (mass > 0) sends an inf in the first tensor: the pieces reduced before it
    # are unpacked, that piece and the rest are not, on every rank alike.
    layout = WireLayout(SHAPES, chunk_elems=16)
    staging = layout.new_staging()
    staging[:] = 1.0 + comm.rank
    if comm.rank == 0:
        staging[3] = np.inf
    before = staging.copy()
    stats = sumcount_reduce(comm, layout, staging, layout.new_frame(), 1.0, layout.new_scratch())
    assert stats.realized and not stats.post_finite
    lo = layout.chunks[0][1]  # the first piece (reduced last) holds element 3
    np.testing.assert_array_equal(staging[:lo], before[:lo])
    np.testing.assert_allclose(staging[lo:], np.mean([1.0 + r for r in range(comm.size)]), rtol=1e-6)
    assert stats.bytes == 8 * layout.size  # every piece was reduced once (float64), the last one included
