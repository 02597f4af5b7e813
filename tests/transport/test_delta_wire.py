"""The delta wires (``--wire bf16-delta``, ``--wire int8-delta``) over 2 and 3 ranks (mpiexec, --with-mpi).

Against a float64 numpy reference of the same quantisation written here independently (bf16 by
round-to-nearest-even on the float32 bits; int8 on the grid of the ranks' largest |delta| per tensor),
which every rank computes for every rank; the consensus bit-identical on every rank; error feedback
keeping the accumulated error within a quantisation step over many rounds (the reference without it
drifts past that bound); identical values on every rank.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from mpi4py import MPI

from flodl_mpi.protocol.wire import WireLayout
from flodl_mpi.transport.reduce import Reducer, WireOptions

pytestmark = pytest.mark.mpi

#: Tensors that cross the pieces' boundaries (chunk of 64 elements), of very different magnitudes.
SHAPES = [(150,), (7, 11), (5,), (40,)]
MAGNITUDES = [1.0, 1e-3, 10.0, 0.1]
KINDS = ["bf16", "int8"]


@pytest.fixture
def comm():
    c = MPI.COMM_WORLD.Dup()
    yield c
    c.Free()


def make(comm, kind):
    layout = WireLayout(SHAPES, chunk_elems=64)
    red = Reducer(comm, layout, WireOptions("auto", "auto", delta=kind))
    assert red.path == f"allgather-{kind}-delta" and len(layout.chunks) > 1
    return layout, red


def initial(r: int, layout) -> np.ndarray:
    rng = np.random.default_rng(100 + r)
    return np.concatenate([m * rng.standard_normal(n) for m, n in zip(MAGNITUDES, layout.sizes)]).astype(np.float32)


def bf16_ref(d: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 -> float32, round to nearest even on the bits (finite values)."""
    u = d.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def int8_ref(ds: list[np.ndarray], layout) -> list[np.ndarray]:
    """Every rank's dequantised deltas on the shared per-tensor grid, float64."""
    out = [np.empty(layout.n) for _ in ds]
    for o, k in zip(layout.offsets[:-1], layout.sizes):
        mx = max(float(np.max(np.abs(d[o : o + k].astype(np.float64)))) for d in ds)
        step = mx / 127 if mx > 0 else 0.0
        for d, q in zip(ds, out):
            q[o : o + k] = (np.rint(d[o : o + k].astype(np.float64) / step) * step) if step else 0.0
    return out


def reference_round(kind, layout, c, thetas, errors, masses, feedback=True):
    """The consensus and every rank's new error feedback, float64 arithmetic, float32 results."""
    ds = [(t - c) + e for t, e in zip(thetas, errors)]  # float32, as each rank forms it
    deq = [bf16_ref(d) for d in ds] if kind == "bf16" else int8_ref(ds, layout)
    total = float(sum(masses))
    mean = sum(m * q for m, q in zip(masses, deq)) / total
    post = (c.astype(np.float64) + mean).astype(np.float32)
    new_err = [(d.astype(np.float64) - q).astype(np.float32) if feedback else np.zeros_like(d)
               for d, q in zip(ds, deq)]
    return post, new_err


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def one_round(red, staging, theta, mass):
    staging[:] = theta
    stats = red.reduce(staging, mass)
    assert stats.realized and stats.post_finite
    return stats


@pytest.mark.parametrize("kind", KINDS)
def test_rounds_match_the_float64_reference_and_agree_bit_for_bit(comm, kind):
    layout, red = make(comm, kind)
    W, r = comm.size, comm.rank
    masses = [1.0 + q for q in range(W)]  # uneven work
    staging = layout.new_staging()
    try:
        # round 0: no reference yet, the exact float64 wire
        thetas = [initial(q, layout) for q in range(W)]
        stats = one_round(red, staging, thetas[r], masses[r])
        exact = (sum(m * t.astype(np.float64) for m, t in zip(masses, thetas)) / sum(masses)).astype(np.float32)
        np.testing.assert_array_max_ulp(staging, exact, maxulp=1)
        assert stats.bytes == 8 * layout.size
        c = staging.copy()
        errors = [np.zeros(layout.n, np.float32) for _ in range(W)]
        for t in range(1, 6):
            rng = [np.random.default_rng(1000 * t + q) for q in range(W)]
            thetas = [(c + np.concatenate([0.01 * m * g.standard_normal(k) for m, k in zip(MAGNITUDES, layout.sizes)])
                       ).astype(np.float32) for g in rng]
            stats = one_round(red, staging, thetas[r], masses[r])
            post, errors = reference_round(kind, layout, c, thetas, errors, masses)
            np.testing.assert_array_max_ulp(staging, post, maxulp=1)
            np.testing.assert_allclose(red._delta.error, errors[r], rtol=0, atol=float(np.max(np.spacing(post))))
            assert len(set(comm.allgather(digest(staging)))) == 1  # the consensus, bit for bit on every rank
            per = 2 if kind == "bf16" else 1
            assert stats.bytes == per * layout.n + 8 * len(layout.chunks) + (8 * len(SHAPES) if kind == "int8" else 0)
            c = staging.copy()
    finally:
        red.free()


@pytest.mark.parametrize("kind", KINDS)
def test_error_feedback_keeps_the_drift_within_a_step(comm, kind):
    """A constant per-rank drift g_r for 60 rounds: the consensus follows c_0 + t·mean(g) within about one
    quantisation step, where the same quantisation without error feedback drifts t times its bias."""
    layout, red = make(comm, kind)
    W, r, rounds = comm.size, comm.rank, 60
    masses = [1.0] * W
    staging = layout.new_staging()
    drift = [np.concatenate([1e-2 * m * np.random.default_rng(7 + q).standard_normal(k)
                             for m, k in zip(MAGNITUDES, layout.sizes)]).astype(np.float32) for q in range(W)]
    mean_drift = sum(d.astype(np.float64) for d in drift) / W
    try:
        one_round(red, staging, initial(r, layout), 1.0)  # the exact first round: the reference
        c0 = staging.astype(np.float64)
        c_nofb, err_nofb = staging.copy(), [np.zeros(layout.n, np.float32) for _ in range(W)]
        for t in range(1, rounds + 1):
            one_round(red, staging, (staging + drift[r]).astype(np.float32), 1.0)
            c_nofb, err_nofb = reference_round(kind, layout, c_nofb, [(c_nofb + d).astype(np.float32) for d in drift],
                                               err_nofb, masses, feedback=False)
        target = c0 + rounds * mean_drift
        # one quantisation step of the per-round delta, per element (bf16: 2^-8 relative; int8: the tensor's grid)
        step = np.concatenate([np.full(k, max(float(np.max(np.abs(d[o : o + k]))) for d in drift) / 127)
                               for o, k in zip(layout.offsets[:-1], layout.sizes)]) if kind == "int8" else \
            np.max(np.abs(np.stack(drift)), axis=0) * 2.0**-8
        fp32_rounding = rounds * np.spacing(np.abs(target).astype(np.float32)).astype(np.float64)
        bound = 2 * step + fp32_rounding
        with_fb = np.abs(staging - target)
        without = np.abs(c_nofb - target)
        assert np.all(with_fb <= bound), float(np.max(with_fb / bound))
        assert np.mean(without > bound) > 0.2, float(np.mean(without > bound))  # the test can fail
        assert len(set(comm.allgather(digest(staging)))) == 1
    finally:
        red.free()


@pytest.mark.parametrize("kind", KINDS)
def test_identical_values_on_every_rank(comm, kind):
    """Issue 26 item 5 on the delta wire: values every rank holds alike and that did not move since the
    consensus come back bit for bit (delta 0); values that moved alike come back within the step, and the
    consensus plus each rank's error feedback is what they held."""
    layout, red = make(comm, kind)
    staging = layout.new_staging()
    try:
        one_round(red, staging, initial(0, layout), 1.0 + comm.rank)  # every rank alike
        c = staging.copy()
        np.testing.assert_array_equal(c, initial(0, layout))  # the exact first round: unchanged
        moved = c.copy()
        moved[::3] += np.float32(1e-3) * (1 + np.arange(len(moved[::3]), dtype=np.float32) % 7)
        one_round(red, staging, moved, 1.0 + comm.rank)
        still = np.ones(layout.n, bool)
        still[::3] = False
        np.testing.assert_array_equal(staging[still], c[still])  # unmoved: bit for bit
        assert np.array_equal(red._delta.error[still], np.zeros(int(still.sum()), np.float32))
        back = staging.astype(np.float64) + red._delta.error
        np.testing.assert_allclose(back, moved, rtol=0, atol=float(np.max(np.spacing(moved))) * 2)
        assert np.max(np.abs(staging - moved)) < 1e-3 * 7 / 100  # within the step (bf16 2^-8, int8 1/127)
        one_round(red, staging, staging.copy(), 1.0 + comm.rank)  # nothing moved: the remainder is sent
        np.testing.assert_allclose(staging, moved, rtol=0, atol=float(np.max(np.spacing(moved))) * 2)
    finally:
        red.free()


@pytest.mark.parametrize("kind", KINDS)
def test_under_the_outer_step_the_reference_is_where_every_rank_starts(kind):
    """With ``--outer nesterov`` the next round's deltas are taken from the outer step's result (what every
    rank adopts), not from the plain consensus: the reference equals the adopted parameters bit for bit on
    every rank, and the run stays within the quantisation of the float64 wire's run on the same steps."""
    import torch

    from flodl_mpi.protocol.outer import OuterOptimizer
    from flodl_mpi.training.models import digits_mlp
    from flodl_mpi.training.replica import Replica
    from flodl_mpi.transport.bridge import Bridge

    comm = MPI.COMM_WORLD
    finals = []
    for wire in (WireOptions("mpi", "off"), WireOptions("auto", "auto", delta=kind)):
        torch.manual_seed(0)
        replica = Replica(digits_mlp((64,), 10, hidden=16), torch.device("cpu"))
        n = sum(p.numel() for p in replica.params)
        bridge = Bridge(comm.Dup(), [tuple(p.shape) for p in replica.params], [], outer=OuterOptimizer("nesterov", n),
                        wire=wire)
        bridge.start()
        opt = torch.optim.SGD(replica.model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(100 + comm.rank)
        for _ in range(4):
            for _ in range(3):  # a window of 3 local steps on rank-specific data
                opt.zero_grad()
                torch.nn.functional.cross_entropy(replica.model(torch.randn(32, 64, generator=gen)),
                                                  torch.randint(0, 10, (32,), generator=gen)).backward()
                opt.step()
            replica.snapshot(bridge)
            update = bridge.round(steps=3, window=3)
            assert update.adopted and update.outer_stepped
            replica.adopt(bridge)
            adopted = np.concatenate([p.detach().numpy().ravel() for p in replica.params])
            if wire.delta != "off":
                assert np.array_equal(bridge.reducer._delta.reference, adopted)
            assert len(set(comm.allgather(digest(adopted)))) == 1
        bridge.close()
        finals.append(adopted.astype(np.float64))
    exact, quantised = finals
    moved = np.abs(exact - np.concatenate([p.detach().numpy().ravel() for p in
                                           Replica(_seeded_mlp(), torch.device("cpu")).params]))
    assert np.max(np.abs(quantised - exact)) < (0.02 if kind == "bf16" else 0.05) * np.max(moved)


def _seeded_mlp():
    import torch

    from flodl_mpi.training.models import digits_mlp

    torch.manual_seed(0)
    return digits_mlp((64,), 10, hidden=16)
