import math
from functools import reduce

import numpy as np
import pytest

from flodl_mpi.protocol.wire import (WireLayout, pack_chunk, pack_piece, sum_squares, sum_squares_pieces, unpack_chunk,
                            unpack_piece)


def test_layout_offsets_and_chunks_cover_the_frame():
    layout = WireLayout([(3, 4), (5,), (), (2, 2)], chunk_elems=7)
    assert layout.n == 12 + 5 + 1 + 4 and layout.size == layout.n + 1
    assert layout.offsets == [0, 12, 17, 18, 22]
    covered = [i for lo, hi in layout.chunks for i in range(lo, hi)]
    assert covered == list(range(layout.size))
    assert all(hi - lo <= 7 for lo, hi in layout.chunks)
    assert layout.chunks[-1][1] == layout.size  # the last piece holds the mass slot


def test_views_share_memory_with_the_staging():
    layout = WireLayout([(2, 3), (4,)])
    staging = layout.new_staging()
    a, b = layout.views(staging)
    a[...] = 1.0
    b[...] = 2.0
    np.testing.assert_array_equal(staging, [1] * 6 + [2] * 4)


def _pack_all(layout, staging, scale):
    frame = layout.new_frame()
    for lo, hi in layout.chunks:
        pack_chunk(staging, frame, lo, hi, scale)
    return frame, sum_squares_pieces(staging, layout)


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_pack_scales_and_carries_the_mass(chunk):
    layout = WireLayout([(5,), (2, 2)], chunk_elems=chunk)
    staging = np.arange(1, 10, dtype=np.float32)
    frame, pre_sq = _pack_all(layout, staging, scale=6.0)
    np.testing.assert_array_equal(frame[:-1], 6.0 * staging)
    assert frame[-1] == 6.0
    assert pre_sq == float(np.sum(np.arange(1, 10, dtype=np.float64) ** 2))


def test_idle_rank_sends_true_zeros_even_with_nan():
    layout = WireLayout([(4,)], chunk_elems=2)
    staging = np.array([1.0, np.nan, np.inf, 2.0], dtype=np.float32)
    frame, _ = _pack_all(layout, staging, scale=0.0)
    assert np.all(frame == 0.0)  # 0 * nan would be nan


@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_pack_then_unpack_is_the_weighted_mean(chunk):
    # Two ranks summed by hand: the frame sum is what Allreduce(SUM) returns.
    layout = WireLayout([(3,), (2,)], chunk_elems=chunk)
    a = np.array([1, 2, 3, 4, 5], dtype=np.float32)
    b = np.array([5, 4, 3, 2, 1], dtype=np.float32)
    W, ma, mb = 2, 3.0, 1.0
    fa, _ = _pack_all(layout, a.copy(), W * ma)
    fb, _ = _pack_all(layout, b.copy(), W * mb)
    summed = fa + fb
    staging = a.copy()
    diff_sq = post_sq = 0.0
    for lo, hi in layout.chunks:
        d, p = unpack_chunk(summed, staging, lo, hi, summed[-1], layout.new_scratch())
        diff_sq, post_sq = diff_sq + d, post_sq + p
    ref = (ma * a.astype(np.float64) + mb * b) / (ma + mb)
    np.testing.assert_allclose(staging, ref, rtol=1e-6)
    assert post_sq == pytest.approx(np.sum(ref**2), rel=1e-6)
    assert diff_sq == pytest.approx(np.sum((a - ref) ** 2), rel=1e-6)


def test_layout_validates():
    with pytest.raises(ValueError, match="chunk_elems"):
        WireLayout([(2,)], chunk_elems=0)


@pytest.mark.parametrize("scale", [1e19, 1e25, 1e30])
def test_sum_squares_of_large_finite_values_does_not_overflow(scale):
    # float32 squares overflow past 1.8e19; SPEC §3 wants the sums in float64.
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(5000) * scale).astype(np.float32)
    want = float(np.sum(x.astype(np.float64) ** 2))
    assert math.isfinite(want)
    assert sum_squares(x) == pytest.approx(want, rel=1e-6)
    layout = WireLayout([(5000,)], chunk_elems=999)
    assert sum_squares_pieces(x, layout) == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_sum_squares_is_not_finite_only_for_nan_or_inf(bad):
    x = np.full(100, 1e30, dtype=np.float32)
    assert math.isfinite(sum_squares(x))
    x[37] = bad
    assert not math.isfinite(sum_squares(x))


def test_unpack_of_a_non_finite_piece_keeps_the_staging():
    layout = WireLayout([(4,)], chunk_elems=2)
    staging = np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32)
    summed = np.array([2.0, np.nan, 6.0, 8.0, 2.0], dtype=np.float32)
    _, post_sq = unpack_chunk(summed, staging, 0, 2, summed[-1], layout.new_scratch())
    assert not math.isfinite(post_sq)
    np.testing.assert_array_equal(staging, [1.0, 2.0, 3.0, 4.0])
    _, post_sq = unpack_chunk(summed, staging, 2, 4, summed[-1], layout.new_scratch())
    assert post_sq == pytest.approx(9.0 + 16.0)
    np.testing.assert_array_equal(staging, [1.0, 2.0, 3.0, 4.0])  # consensus piece equals pre here


def test_pinned_staging_is_a_zeroed_float32_array_and_falls_back_without_cuda():
    import torch

    layout = WireLayout([(3, 4), (5,)])
    staging = layout.new_staging(pinned=True)
    assert staging.dtype == np.float32 and staging.shape == (17,) and not staging.any()
    staging[:] = 2.0  # writable, and the views the bridge hands out share it
    assert all(np.all(v == 2.0) for v in layout.views(staging))
    if torch.cuda.is_available():
        assert torch.from_numpy(staging).is_pinned()


def _tree_sum(parts):
    """A pairwise (recursive-halving) sum, one order an MPI Allreduce may take."""
    if len(parts) == 1:
        return parts[0].copy()
    h = len(parts) // 2
    return _tree_sum(parts[:h]) + _tree_sum(parts[h:])


@pytest.mark.parametrize("masses", [[1.0] * 5, [(1.0 + 2 * r) ** 0.5 for r in range(5)],
                                    [float(10 * (r + 1) + 3 * r * r) for r in range(5)],
                                    [0.0, 3.0, 7.0 / 3, 0.0, 1e-3]],
                         ids=["equal", "gamma-0.5", "quotas", "idle"])
@pytest.mark.parametrize("W", [2, 3, 4, 5])
def test_the_float64_wire_gives_values_every_rank_holds_alike_back_bit_for_bit(W, masses):
    """issue 26 item 5: W simulated ranks pack the same float32 values (pack_piece into the float64
    frame, scale W·m_r), the frames are summed as an Allreduce(SUM) would (in rank order, in reverse,
    pairwise), and unpack_piece gives exactly the input back, for equal and unequal masses; the
    divergence sum is exactly 0. In float32 (the wire before) W = 3 and 5 rounded by ulps."""
    rng = np.random.default_rng(W)
    f = np.finfo(np.float32)
    values = np.concatenate([rng.standard_normal(300), rng.standard_normal(20) * 1e30, rng.standard_normal(20) * 1e-40,
                             [0.0, -0.0, f.max, -f.max, f.tiny, f.smallest_subnormal]]).astype(np.float32)
    layout = WireLayout([(values.size,)], chunk_elems=37)
    m = masses[:W] if any(masses[:W]) else [1.0] * W
    for lo, hi in layout.chunks:
        frames = []
        for r in range(W):
            out = layout.new_frame()[: hi - lo]
            pack_piece(values, lo, hi, out, W * m[r])
            frames.append(out)
        for summed in (reduce(np.add, frames), reduce(np.add, frames[::-1]), _tree_sum(frames)):
            staging = values.copy()
            post = np.empty(hi - lo, np.float32)
            d, p = unpack_piece(summed, staging, lo, hi, summed[-1] if hi > layout.n else
                                float(sum(W * x for x in m)), post, layout.new_scratch())
            assert staging.tobytes() == values.tobytes()
            assert d == 0.0 and math.isfinite(p)
            staging = values.copy()  # the whole-frame unpack, in place in the float64 frame
            d, p = unpack_chunk(np.concatenate([np.zeros(lo), summed]), staging, lo, hi,
                                float(sum(W * x for x in m)), layout.new_scratch())
            assert staging.tobytes() == values.tobytes() and d == 0.0
