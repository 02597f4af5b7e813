"""The compiled slice pass of :mod:`flodl_mpi.slice_kernel` (numba): imported only when used.

Importing numba and loading the cached kernel cost about a second per process,
so :mod:`flodl_mpi.slice_kernel` imports this module only for a slice large
enough to repay it (:data:`~flodl_mpi.slice_kernel.COMPILED_MIN_ELEMENTS`) or
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
def _diff_sq_write(x, c, k):  # pragma: no cover - compiled
    s = 0.0
    for i in range(k):
        d = np.float64(x[i] - c[i])  # the float32 difference, squared in float64
        s += d * d
        x[i] = c[i]
    return s


@numba.njit(cache=True, nogil=True)
def _numba_pass(segs, scales, total, inverse, a, b, step, c, partial):  # pragma: no cover - compiled
    W = segs.shape[0]
    blocks = (b - a + step - 1) // step
    for j in range(blocks - 1, -1, -1):
        lo = a + j * step
        hi = min(lo + step, b)
        k = hi - lo
        first = True
        for r in range(W):
            s = scales[r]
            if s == 0.0:
                continue
            x = segs[r, lo:hi]
            if first:
                for i in range(k):
                    c[i] = x[i] * s
                first = False
            else:
                for i in range(k):
                    c[i] = c[i] + x[i] * s
        if inverse != 0.0:
            for i in range(k):
                c[i] = c[i] * inverse
        else:
            for i in range(k):
                c[i] = c[i] / total
        post = _sum_sq(c, k)
        if not math.isfinite(post):
            partial[W + 1] = 1.0
            return
        partial[W] += post
        for r in range(W):
            partial[r] += _diff_sq_write(segs[r, lo:hi], c, k)


numba_pass = _numba_pass
