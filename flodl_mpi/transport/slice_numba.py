"""The compiled slice pass of :mod:`flodl_mpi.transport.slice_kernel` (numba): imported only when used.

Importing numba and loading the cached kernel cost about a second per process,
so :mod:`flodl_mpi.transport.slice_kernel` imports this module only for a slice large
enough to repay it (:data:`~flodl_mpi.transport.slice_kernel.COMPILED_MIN_ELEMENTS`) or
when asked by name. The operations and their order are the numpy pass's; see
that module's docstring. Pure math: no MPI, no threads.
"""

from __future__ import annotations

import math

import numba
import numpy as np

__all__ = ["numba_pass"]

# Only the float64 sums of squares may be reassociated (vectorized); no nnan/ninf,
# so a NaN or an infinity still shows in the sum.
_SUMS = {"reassoc", "nsz", "contract"}


@numba.njit(cache=True, nogil=True, fastmath=_SUMS)
def _sum_sq(c, k):  # pragma: no cover - compiled
    s = 0.0
    for i in range(k):
        v = np.float64(c[i])
        s += v * v
    return s


@numba.njit(cache=True, nogil=True, fastmath=_SUMS)
def _sum_sq32(x, k):  # pragma: no cover - compiled
    s = np.float32(0.0)
    for i in range(k):  # float32 squares and sum: 16 lanes, no conversion (the caller checks for overflow)
        v = x[i]
        s += v * v
    return s


@numba.njit(cache=True, nogil=True, fastmath=_SUMS)
def _diff_sq_write(x, c, k):  # pragma: no cover - compiled
    s = 0.0
    for i in range(k):
        d = np.float64(x[i] - c[i])  # the float32 difference, squared in float64
        s += d * d
        x[i] = c[i]
    return s


@numba.njit(cache=True, nogil=True, fastmath=_SUMS)
def _diff_sq_write2(x, y, c, k):  # pragma: no cover - compiled
    sx = 0.0
    sy = 0.0
    for i in range(k):  # two segments in one sweep: c is read once for both
        v = c[i]
        dx = np.float64(x[i] - v)
        dy = np.float64(y[i] - v)
        sx += dx * dx
        sy += dy * dy
        x[i] = v
        y[i] = v
    return sx, sy


# The consensus of a block, c = (s_0·x_0 + s_1·x_1 + ...) / total, accumulated in float64 in
# rank order into ``acc``, the last add fused with the divide (or the multiply by the exact
# reciprocal), rounded to float32 once into ``c``. Each expression rounds every float64
# operation as the separate loops of the numpy pass do (no fastmath here, so no fused
# multiply-add and no reordering): the same bits. The float64 scales, sums and divide err
# far below half a float32 ulp, so identical inputs come back unchanged (slice_kernel).
@numba.njit(cache=True, nogil=True)
def _one(x, s, total, inverse, c, k):  # pragma: no cover - compiled
    if inverse != 0.0:
        for i in range(k):
            c[i] = np.float32((np.float64(x[i]) * s) * inverse)
    else:
        for i in range(k):
            c[i] = np.float32((np.float64(x[i]) * s) / total)


@numba.njit(cache=True, nogil=True)
def _two(x, y, s, t, total, inverse, last, acc, c, k):  # pragma: no cover - compiled
    if not last:
        for i in range(k):
            acc[i] = np.float64(x[i]) * s + np.float64(y[i]) * t
    elif inverse != 0.0:
        for i in range(k):
            c[i] = np.float32((np.float64(x[i]) * s + np.float64(y[i]) * t) * inverse)
    else:
        for i in range(k):
            c[i] = np.float32((np.float64(x[i]) * s + np.float64(y[i]) * t) / total)


@numba.njit(cache=True, nogil=True)
def _add(x, s, total, inverse, last, acc, c, k):  # pragma: no cover - compiled
    if not last:
        for i in range(k):
            acc[i] = acc[i] + np.float64(x[i]) * s
    elif inverse != 0.0:
        for i in range(k):
            c[i] = np.float32((acc[i] + np.float64(x[i]) * s) * inverse)
    else:
        for i in range(k):
            c[i] = np.float32((acc[i] + np.float64(x[i]) * s) / total)


@numba.njit(cache=True, nogil=True)
def _numba_pass(segs, scales, total, inverse, a, b, step, acc, c, partial, pre):  # pragma: no cover - compiled
    W = segs.shape[0]
    live = np.empty(W, np.int64)  # the ranks with a scale, in rank order (0 skips: true zeros)
    n_live = 0
    for r in range(W):
        if scales[r] != 0.0:
            live[n_live] = r
            n_live += 1
    blocks = (b - a + step - 1) // step
    for j in range(blocks - 1, -1, -1):
        lo = a + j * step
        hi = min(lo + step, b)
        k = hi - lo
        r0 = live[0]
        if n_live == 1:
            _one(segs[r0, lo:hi], scales[r0], total, inverse, c, k)
        else:
            r1 = live[1]
            _two(segs[r0, lo:hi], segs[r1, lo:hi], scales[r0], scales[r1], total, inverse, n_live == 2, acc, c, k)
            for q in range(2, n_live):
                r = live[q]
                _add(segs[r, lo:hi], scales[r], total, inverse, q == n_live - 1, acc, c, k)
        post = _sum_sq(c, k)
        if not math.isfinite(post):  # never written; each rank's block says whose values were not finite
            if pre:
                for r in range(W):
                    partial[W + 2 + r] += _sum_sq(segs[r, lo:hi], k)
            partial[W + 1] = 1.0
            return
        partial[W] += post
        if pre:  # every rank's pre-round block, from L1 before it is overwritten
            for r in range(W):
                p32 = _sum_sq32(segs[r, lo:hi], k)
                if math.isfinite(p32):
                    partial[W + 2 + r] += np.float64(p32)
                else:  # overflowed float32, or a NaN/infinity: float64 holds any finite block's sum
                    partial[W + 2 + r] += _sum_sq(segs[r, lo:hi], k)
        r = 0
        while r + 1 < W:  # the writes two segments per sweep
            dx, dy = _diff_sq_write2(segs[r, lo:hi], segs[r + 1, lo:hi], c, k)
            partial[r] += dx
            partial[r + 1] += dy
            r += 2
        if r < W:
            partial[r] += _diff_sq_write(segs[r, lo:hi], c, k)


numba_pass = _numba_pass
