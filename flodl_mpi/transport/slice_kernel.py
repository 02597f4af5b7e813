"""The in-place node reduce's pass over one slice: consensus, divergence sums and writes, block by block.

Concept (issue 9, the memory floor): rank k of a node owns slice ``[a, b)`` of
every rank's segment (:mod:`flodl_mpi.transport.shm_in_place`). For each block of that
slice, last block first, the pass

1. sums the segments scaled by their masses in rank order, in float64:
   ``c = s_0·x_0``, then ``c = c + s_r·x_r`` for each further rank ``r`` whose
   scale ``s_r = W·m_r`` (float64) is not 0 (a rank of mass 0 is skipped: true
   zeros, whatever its segment holds; SPEC §1);
2. divides once by the float64 total (multiplies by its float64 reciprocal,
   :func:`flodl_mpi.protocol.wire.reciprocal`, as every path does) and rounds the
   quotient to float32, once;
3. stops if the block's consensus is not finite (never writes it; flags it);
4. adds ``‖c‖²`` and each rank's ``‖x_r − c‖²`` (float64 sums; SPEC §3) and,
   when asked, each rank's ``‖x_r‖²`` (its pre-round norm; not finite exactly
   when its values are not: the check of ``--on-non-finite stop``, see
   :class:`flodl_mpi.transport.bridge.Bridge`; the compiled pass sums a block in float32
   and redoes it in float64 when that is not finite);
5. writes ``c`` into every rank's segment.

Why float64 (issue 26 item 5): a value every rank holds alike must come back
unchanged, bit for bit (a frozen layer, an embedding row no rank touched). In
float32, ``Σ fl(W·m_r·θ) / Σ W·m_r`` is not ``θ`` at W = 3 or 5 (the sum of three
equal values needs two more bits than float32 has), and a frozen layer drifted
by ulps every round. In float64 the sum and the divide err by a few 2^-53
relative, far below half a float32 ulp (2^-25 relative at least), so the one
rounding to float32 gives ``θ`` back for any masses and any W < 2^20. The
accumulator is a cache-resident block (registers and L1 in the compiled pass),
so the pass moves no more memory than before (``benchmarks/bench_slice_pass.py``).

Two implementations of the same operations: a compiled kernel (numba, one call
per slice, every step of a small block from L1 cache: measured 1.7x faster
than the numpy pass at 16M parameters, ``benchmarks/README.md``) and the numpy
pass (about eleven cache-resident calls per block), used where numba is not
installed. The consensus bits are the same in both (the same float64
operations in the same order, no fused multiply-add: the kernel is compiled
without ``fastmath``, only its float64 sums of squares may be reassociated);
the sums of squares differ by rounding (float64 accumulation in the kernel,
float32 dots added in float64 in the numpy pass). Pure math: no MPI, no threads.
"""

from __future__ import annotations

import math

import numpy as np

from flodl_mpi.protocol.wire import reciprocal, sum_squares

__all__ = ["COMPILED_MIN_ELEMENTS", "KERNELS", "STEPS", "compiled_available", "consensus_slice", "default_kernel",
           "warm_up"]

#: Implementations of the pass, fastest first.
KERNELS = ("numba", "numpy")
#: Elements per block for each: the compiled kernel keeps a block's consensus and one
#: rank's block in L1 (16 KiB each; measured: 4096 beat 1024, 16384 and 65536), the
#: numpy pass amortizes its per-call cost over 256 KiB blocks in L2.
STEPS = {"numba": 1 << 12, "numpy": 1 << 16}
#: The compiled pass is the default for a slice of at least this many elements (1 MiB
#: of float32; a model of 512K parameters at W = 2): importing numba and loading the
#: kernel cost about a second per process, which a small model's rounds never repay
#: (the numpy pass costs well under a millisecond a round there; the test suite's
#: models stay under it, so its hundreds of short runs do not pay the import).
COMPILED_MIN_ELEMENTS = 1 << 18

#: The compiled module once imported; False when numba is missing or fails to import.
_compiled = None


def compiled_available() -> bool:
    """numba is installed and imports (it is imported here, once: about a second)."""
    return _compiled_pass() is not None


def _compiled_pass():
    global _compiled
    if _compiled is None:
        try:
            from flodl_mpi.transport.slice_numba import numba_pass
        except ImportError:  # numba is an install requirement; without it (or broken), the numpy pass
            numba_pass = False
        _compiled = numba_pass
    return _compiled or None


def default_kernel(n_elements: int | None = None) -> str:
    """The pass for a slice of ``n_elements`` (None: any size): ``"numba"`` when the slice is at least
    :data:`COMPILED_MIN_ELEMENTS` (or None) and numba imports, else ``"numpy"``. The bits are the same."""
    if n_elements is not None and n_elements < COMPILED_MIN_ELEMENTS:
        return "numpy"
    return "numba" if compiled_available() else "numpy"


def consensus_slice(segs: np.ndarray, scales: np.ndarray, total: float, a: int, b: int, step: int,
                    scratch: np.ndarray, partial: np.ndarray, kernel: str = "numba", pre_sums: bool = False) -> None:
    """The pass over slice ``[a, b)`` of every segment (see the module docstring), in place.

    Args:
        segs: float32 ``(W, m)`` with C-contiguous rows, ``m >= b``: row r is
            rank r's segment; slice ``[a, b)`` of every row is overwritten with
            the consensus, block by block (blocks that follow a non-finite one
            in the pass's order are left untouched).
        scales: ``(W,)``, ``W·m_r`` per rank (0 skips the rank), taken as float64.
        total: the float64 sum of ``scales`` in rank order (> 0).
        a, b: the slice, ``0 <= a <= b <= m``.
        step: block length in elements, >= 1 (blocks ``[a + i·step, ...)``,
            the last first).
        scratch: float64 scratch of at least ``2 * min(step, b - a)`` elements
            (the float64 accumulator of a block, then its float32 consensus).
        partial: float64 ``(2W + 2,)``, added to: ``[r]`` += ``‖x_r − c‖²`` of
            the slice, ``[W]`` += ``‖c‖²``, ``[W + 1]`` set to 1.0 when a
            block's consensus was not finite (the pass stopped there),
            with ``pre_sums``, ``[W + 2 + r]`` += ``‖x_r‖²`` (the pre-round
            values, every rank, idle ones included; in the non-finite block
            too, so a NaN or an infinity of rank r there makes it non-finite:
            whose values they were); without, those stay as given.
        kernel: one of :data:`KERNELS`; ``"numba"`` needs numba installed.
        pre_sums: also sum every rank's pre-round values (step 4; about 12% of
            the compiled pass's time at 16M params: only when asked).

    Raises:
        ValueError: an unknown kernel, or numba asked for but not installed;
            ``partial`` not float64 ``(2W + 2,)``, or the slice or scratch out
            of bounds (the compiled pass indexes without bounds checks).
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    W = segs.shape[0]
    if partial.shape != (2 * W + 2,) or partial.dtype != np.float64:
        raise ValueError(f"partial must be float64 of shape ({2 * W + 2},), got {partial.dtype} {partial.shape}")
    if (not (0 <= a <= b <= segs.shape[1]) or step < 1 or scratch.dtype != np.float64
            or not scratch.flags.c_contiguous or scratch.size < 2 * min(step, b - a)):
        raise ValueError(f"slice [{a}, {b}) of segments of {segs.shape[1]}, step {step}, scratch {scratch.dtype} "
                         f"{scratch.size}: out of bounds (the scratch: float64, at least 2 * step)")
    if b <= a:
        return
    scales = np.ascontiguousarray(scales, dtype=np.float64)
    total = float(total)
    inverse = reciprocal(total)
    m = min(step, b - a)
    acc, c = scratch[:m], scratch[m : 2 * m].view(np.float32)  # c: 2m float32, the consensus and a difference
    if kernel == "numba":
        compiled = _compiled_pass()
        if compiled is None:
            raise ValueError("kernel 'numba' needs numba installed (pip install numba)")
        compiled(segs, scales, total, inverse, a, b, step, acc, c, partial, bool(pre_sums))
    else:
        _numpy_pass(segs, scales, total, inverse, a, b, step, acc, c, partial, bool(pre_sums))


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernel now, not in the first round; no-op without numba."""
    if not compiled_available():
        return
    segs = np.ones((2, 32), dtype=np.float32)
    consensus_slice(segs, np.ones(2), 2.0, 0, 32, 16, np.empty(32), np.zeros(6), "numba")


def _numpy_pass(segs, scales, total, inverse, a, b, step, acc_buf, c32, partial, pre_sums) -> None:
    W = segs.shape[0]
    live = [(segs[r], s) for r, s in enumerate(scales) if s != 0.0]
    first, rest = live[0], live[1:]
    m = min(step, b - a)
    tmp_buf = c32.view(np.float64)  # m float64: a scaled block, until the consensus is rounded into c32
    c_buf, d_buf = c32[:m], c32[m : 2 * m]
    for lo in reversed(range(a, b, step)):
        hi = min(lo + step, b)
        k = hi - lo
        # Widen first, then operate in float64 (faster than numpy's buffered casting in the multiply).
        acc, tmp = acc_buf[:k], tmp_buf[:k]
        np.copyto(acc, first[0][lo:hi])
        np.multiply(acc, first[1], out=acc)
        for seg, s in rest:
            np.copyto(tmp, seg[lo:hi])
            np.multiply(tmp, s, out=tmp)
            np.add(acc, tmp, out=acc)
        c = c_buf[:k]
        if inverse == 0.0:
            np.divide(acc, total, out=acc)
        else:
            np.multiply(acc, inverse, out=acc)
        np.copyto(c, acc)  # the float64 quotient, rounded to float32 once
        post = sum_squares(c)
        if not math.isfinite(post):  # never written; each rank's block says whose values were not finite
            for r in range(W):
                partial[W + 2 + r] += sum_squares(segs[r, lo:hi]) if pre_sums else 0.0
            partial[W + 1] = 1.0
            return
        partial[W] += post
        d = d_buf[:k]
        for r in range(W):
            x = segs[r, lo:hi]
            if pre_sums:
                partial[W + 2 + r] += sum_squares(x)
            partial[r] += sum_squares(np.subtract(x, c, out=d))
            np.copyto(x, c)
