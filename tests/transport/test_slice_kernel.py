"""The in-place reduce's slice pass (flodl_mpi.transport.slice_kernel): numba and numpy against a float64 reference."""

import numpy as np
import pytest

from flodl_mpi.transport.slice_kernel import KERNELS, STEPS, consensus_slice, default_kernel

pytestmark = pytest.mark.skipif(default_kernel() != "numba", reason="numba is not installed")


def case(W, n, seed=0, masses=None):
    rng = np.random.default_rng(seed)
    segs = np.zeros((W, n + 5), dtype=np.float32)  # rows longer than the frame, as the segments' padding
    segs[:, :n] = rng.standard_normal((W, n)).astype(np.float32)
    masses = masses if masses is not None else [1.0 + r * 0.7 for r in range(W)]
    scales = np.array([W * m for m in masses], dtype=np.float64)
    total = 0.0
    for s in scales.tolist():
        total += s
    return segs, scales, total


def run(kernel, segs, scales, total, a, b, step, pre_sums=True):
    out = segs.copy()
    partial = np.zeros(2 * segs.shape[0] + 2)
    consensus_slice(out, scales, total, a, b, step, np.empty(2 * step), partial, kernel, pre_sums)
    return out, partial


@pytest.mark.parametrize("step", [1, 7, 4096])
@pytest.mark.parametrize("W", [2, 3, 4])
def test_both_kernels_equal_a_float64_reference_and_each_other_bit_for_bit(W, step):
    n = 5000
    masses = [1.0 + 0.7 * r for r in range(W)]
    if W >= 3:
        masses[1] = 0.0  # an idle rank with NaN in its segment: true zeros
    segs, scales, total = case(W, n, masses=masses)
    if W >= 3:
        segs[1, :n] = np.nan
    a, b = 1040, 4100  # a slice inside the frame: nothing outside it is touched
    outs = {k: run(k, segs, scales, total, a, b, step) for k in KERNELS}
    ref = sum(m * segs[r, a:b].astype(np.float64) for r, m in enumerate(masses) if m) / sum(masses)
    for out, partial in outs.values():
        for r in range(W):
            np.testing.assert_array_equal(out[r, :a], segs[r, :a])
            np.testing.assert_array_equal(out[r, b:], segs[r, b:])
            np.testing.assert_array_equal(out[r, a:b], out[0, a:b])  # the consensus in every segment
        np.testing.assert_allclose(out[0, a:b], ref, rtol=1e-7, atol=1e-12)  # one float32 rounding
        assert partial[W] == pytest.approx(float(np.sum(ref**2)), rel=1e-5)
        for r in range(W):
            if masses[r]:
                want = float(np.sum((segs[r, a:b].astype(np.float64) - ref) ** 2))
                assert partial[r] == pytest.approx(want, rel=1e-4)
        assert partial[W + 1] == 0.0
        for r in range(W):  # every rank's pre-round norm, the idle one's NaN included
            want = float(np.sum(segs[r, a:b].astype(np.float64) ** 2))
            assert partial[W + 2 + r] == pytest.approx(want, rel=1e-5, nan_ok=True)
            assert np.isfinite(partial[W + 2 + r]) == bool(masses[r] or W < 3)
    (o1, p1), (o2, p2) = outs.values()
    assert o1.tobytes() == o2.tobytes()  # the same float64 operations in the same order: no FMA
    for k in KERNELS:  # not asked: the same consensus and sums, the pre sums left as given
        out, partial = run(k, segs, scales, total, a, b, step, pre_sums=False)
        assert out.tobytes() == o1.tobytes() and partial[: W + 2].tobytes() == outs[k][1][: W + 2].tobytes()
        assert not partial[W + 2 :].any()
    assert p1[W] == pytest.approx(p2[W], rel=1e-6)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_power_of_two_total_gives_the_divide_s_bits(kernel):
    W, n = 4, 3000
    segs, scales, total = case(W, n, masses=[1.0] * W)  # total 16: multiplied by 1/16
    out, _ = run(kernel, segs, scales, total, 0, n, 512)
    s = segs[0, :n] * scales[0]  # float64: float32 values times float64 scales
    for r in range(1, W):
        s = s + segs[r, :n] * scales[r]
    np.testing.assert_array_equal(out[2, :n], (s / total).astype(np.float32))


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_non_finite_block_is_never_written_and_stops_the_slice(kernel):
    # Blocks go last to first: those after the bad one (higher) hold the consensus,
    # the bad block and those before it keep their values; the flag is set.
    W, n, step = 3, 1000, 100
    segs, scales, total = case(W, n)
    segs[2, 450] = np.inf
    out, partial = run(kernel, segs, scales, total, 0, n, step)
    assert partial[W + 1] == 1.0
    np.testing.assert_array_equal(out[:, :500], segs[:, :500])
    assert np.isfinite(out[:, 500:n]).all() and (out[0, 500:n] == out[1, 500:n]).all()
    assert not np.array_equal(out[0, 500:n], segs[0, 500:n])


def test_unknown_kernel_is_refused():
    segs, scales, total = case(2, 10)
    with pytest.raises(ValueError, match="kernel must be one of numba, numpy"):
        run("cython", segs, scales, total, 0, 10, 4)


def test_steps_are_positive():
    assert set(STEPS) == set(KERNELS) and min(STEPS.values()) >= 1


def test_a_small_slice_takes_the_numpy_pass_without_importing_numba():
    """numba's import costs about a second per process: a slice under COMPILED_MIN_ELEMENTS never pays it."""
    import subprocess
    import sys

    code = ("import sys; from flodl_mpi.transport import shm_in_place; from flodl_mpi.transport.slice_kernel import "
            "COMPILED_MIN_ELEMENTS as n, default_kernel as k; "
            "print(k(n - 1), 'numba' in sys.modules, k(n), 'numba' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["numpy", "False", "numba", "True"]


@pytest.mark.parametrize("equal", [False, True], ids=["unequal", "equal"])
@pytest.mark.parametrize("W", [1, 2, 3, 4, 5])
def test_every_set_of_live_ranks_gives_the_numpy_pass_s_bits(W, equal):
    # The compiled pass fuses the first two scaled segments and the last add with the divide
    # (or the exact reciprocal's multiply, equal masses at a power-of-two total), and writes
    # two segments per sweep (an odd one alone): for every set of live ranks (1 to W, idle
    # ones holding NaN) the bits are the numpy pass's and the values the float64 mean's.
    n, a, b = 300, 16, 290
    for live in range(1, 2**W):
        masses = [(1.0 if equal else 1.0 + 0.3 * r) if live >> r & 1 else 0.0 for r in range(W)]
        segs, scales, total = case(W, n, seed=live, masses=masses)
        for r in range(W):
            if not masses[r]:
                segs[r, :n] = np.nan
        outs = {k: run(k, segs, scales, total, a, b, 64) for k in KERNELS}
        (o1, p1), (o2, p2) = outs.values()
        assert o1.tobytes() == o2.tobytes(), (W, live)
        ref = sum(m * segs[r, a:b].astype(np.float64) for r, m in enumerate(masses) if m) / sum(masses)
        np.testing.assert_allclose(o1[0, a:b], ref, rtol=1e-7, atol=1e-12)  # one float32 rounding
        for r in range(W):
            np.testing.assert_array_equal(o1[r, a:b], o1[0, a:b])
            if masses[r]:
                want = float(np.sum((segs[r, a:b].astype(np.float64) - ref) ** 2))
                assert p1[r] == pytest.approx(want, rel=1e-4, abs=1e-9)
        assert p1[W + 1] == p2[W + 1] == 0.0


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_partial_or_slice_out_of_bounds_is_refused_before_the_pass(kernel):
    # The compiled pass indexes without bounds checks: a partial of the old (W + 2) length, a
    # slice past the segments or a short scratch would write outside them.
    segs, scales, total = case(2, 100)
    c = np.empty(64)
    with pytest.raises(ValueError, match=r"partial must be float64 of shape \(6,\)"):
        consensus_slice(segs, scales, total, 0, 32, 16, c, np.zeros(4), kernel)
    with pytest.raises(ValueError, match="out of bounds"):
        consensus_slice(segs, scales, total, 0, segs.shape[1] + 1, 16, c, np.zeros(6), kernel)
    with pytest.raises(ValueError, match="out of bounds"):
        consensus_slice(segs, scales, total, 0, 32, 16, np.empty(8), np.zeros(6), kernel)
    with pytest.raises(ValueError, match=r"out of bounds \(the scratch: float64"):  # the old float32 scratch
        consensus_slice(segs, scales, total, 0, 32, 16, np.empty(64, np.float32), np.zeros(6), kernel)
    np.testing.assert_array_equal(segs, case(2, 100)[0])  # nothing written


@pytest.mark.parametrize("kernel", KERNELS)
def test_pre_sums_of_finite_values_past_float32_squares_stay_finite(kernel):
    # A finite value near 1e20 squares past float32's 3.4e38: the compiled pass's float32 block
    # sum overflows and is redone in float64, so --on-non-finite stop never names a finite rank.
    segs, scales, total = case(2, 9000)
    segs[1, 17] = 1e20
    segs[0, 8999] = -3e19
    out, partial = run(kernel, segs, scales, total, 0, 9000, 4096)
    assert partial[3] == 0.0  # the consensus is finite
    for r in range(2):
        want = float(np.sum(segs[r, :9000].astype(np.float64) ** 2))
        assert np.isfinite(partial[4 + r]) and partial[4 + r] == pytest.approx(want, rel=1e-6)


def alike_values() -> np.ndarray:
    """float32 values of every kind a layer holds: normal ones, large, tiny, subnormal, signed zeros, the extremes."""
    rng = np.random.default_rng(26)
    f = np.finfo(np.float32)
    return np.concatenate([rng.standard_normal(700), rng.standard_normal(40) * 1e30, rng.standard_normal(40) * 1e-30,
                           rng.standard_normal(20) * 1e-42, [0.0, -0.0, 1.0, -1.0, 3.0, 1 / 3, f.max, -f.max,
                                                             f.tiny, f.smallest_subnormal]]).astype(np.float32)


#: Masses a round gives: equal (sync), gamma-weighted unequal steps, cadence quotas, with an idle rank.
ALIKE_MASSES = {
    "equal": lambda W: [1.0] * W,
    "gamma-0.5": lambda W: [(1.0 + 2 * r) ** 0.5 for r in range(W)],
    "quotas": lambda W: [float(10 * (r + 1) + 3 * r * r) for r in range(W)],
    "idle": lambda W: [0.0 if r == W // 2 else 7.0 / (r + 1) for r in range(W)],
}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("masses", list(ALIKE_MASSES), ids=list(ALIKE_MASSES))
@pytest.mark.parametrize("W", [2, 3, 4, 5, 7])
def test_values_every_rank_holds_alike_come_back_bit_for_bit(kernel, masses, W):
    """issue 26 item 5: segments that hold the same float32 values on every (live) rank give those
    values back, bit for bit, for equal and unequal masses at every W (in float32 the sum of three
    equal values already rounds, and a frozen layer drifted by ulps every round), and every live
    rank's ``‖x_r − c‖²`` is exactly 0 (identical replicas, divergence 0)."""
    values = alike_values()
    n = values.size
    m = ALIKE_MASSES[masses](W)
    segs, scales, total = case(W, n, masses=m)
    segs[:, :n] = values
    for r in range(W):
        if not m[r]:
            segs[r, :n] = np.nan  # an idle rank's segment: skipped, overwritten with the consensus
    for step in (64, STEPS[kernel]):
        out, partial = run(kernel, segs, scales, total, 0, n, step)
        for r in range(W):
            assert out[r, :n].tobytes() == values.tobytes(), (r, step)
            if m[r]:
                assert partial[r] == 0.0
        assert partial[W + 1] == 0.0
