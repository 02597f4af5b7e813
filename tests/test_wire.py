import numpy as np
import pytest

from flodl_mpi.wire import WireLayout, pack_chunk, unpack_chunk


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
    pre_sq = sum(pack_chunk(staging, frame, lo, hi, scale) for lo, hi in layout.chunks)
    return frame, pre_sq


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
