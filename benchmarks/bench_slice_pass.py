"""The in-place node reduce's slice pass alone: numba kernel vs numpy pass vs torch ops, one process.

    python benchmarks/bench_slice_pass.py [--params 16000000] [--world 2] [--repeats 5]

Rank 0's slice of a W-rank node (``[0, P/W)`` of W segments of P float32 each,
random values, unequal masses): the pass of ``flodl_mpi.transport.slice_kernel`` (sum in
rank order, one divide, ``‖c‖²`` and each rank's ``‖x_r − c‖²``, the consensus
written into every segment) as the numba kernel and as the numpy pass, both at
their own block sizes and at others, and the same operations as torch CPU ops
(``mul``, ``add_(alpha=)``, ``div_``, ``dot``, ``sub``, ``copy_``; torch's
``add_`` with alpha may fuse a multiply-add, so its bits can differ). For
scale: a plain copy of the same bytes (read P, write P: the pass's traffic) and
the read-only pre-round pass over one rank's P (``wire.sum_squares_pieces``).
Times are this thread's CPU time (``time.thread_time``, best of the repeats), so
other jobs on the machine inflate them less than wall time; before timing, each
variant's consensus is compared bit for bit with the numpy pass. The kept passes
sum and divide in float64 (issue 26 item 5: values every rank holds alike come
back unchanged); the variants not kept (the pass before its fused sweeps, torch
ops, the scratch variant) still sum in float32, so they differ by float32 rounding.

Also timed, not kept (issue 9, idea "drop the pre-pass"): the consensus into a
private scratch of P/W floats with every rank's slice norm (whose finiteness
would ride the partial sums' Allgather instead of the control gather), then a
second pass copying it into every segment. Per rank it reads (1 + 1/W)·P and
writes (1 + 1/W)·P floats, against 2P read and P written by the pre-round pass
plus the pass, and holds P/W floats more.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import numpy as np
import torch

try:
    import numba
except ImportError:  # the scratch variant needs it
    numba = None

from flodl_mpi.transport.slice_kernel import KERNELS, STEPS, consensus_slice, default_kernel
from flodl_mpi.protocol.wire import WireLayout, sum_squares_pieces


def torch_pass(segs: np.ndarray, scales: np.ndarray, total: np.float32, a: int, b: int, step: int) -> np.ndarray:
    """The pass as torch CPU ops (one thread), block by block, last block first; returns the partial sums."""
    W = segs.shape[0]
    T = torch.from_numpy(segs)
    acc, tmp = torch.empty(step), torch.empty(step)
    partial = np.zeros(2 * W + 2)
    sc, tot = [float(s) for s in scales], float(total)
    for lo in reversed(range(a, b, step)):
        hi = min(lo + step, b)
        c = torch.mul(T[0, lo:hi], sc[0], out=acc[: hi - lo])
        for r in range(1, W):
            c.add_(T[r, lo:hi], alpha=sc[r])
        c.div_(tot)
        partial[W] += float(torch.dot(c, c))
        d = tmp[: hi - lo]
        for r in range(W):
            x = T[r, lo:hi]
            torch.sub(x, c, out=d)
            partial[r] += float(torch.dot(d, d))
            x.copy_(c)
    return partial


if numba is not None:
    from flodl_mpi.transport.slice_numba import _sum_sq as _sq  # the kept kernel's sum of squares

    @numba.njit(nogil=True, fastmath={"reassoc", "nsz", "contract"})
    def _dsq(x, c, k):
        s = 0.0
        for i in range(k):
            d = np.float64(x[i] - c[i])
            s += d * d
        return s

    from flodl_mpi.transport.slice_numba import _diff_sq_write

    @numba.njit(nogil=True)
    def before_pass(segs, scales, total, inverse, a, b, step, c, partial):
        """The compiled pass before its fused sweeps (issue 9, ``5d5da0e``): per block one sweep per
        segment for the sum, one for the divide, one per segment for its difference and write. The same
        float32 operations in the same order as the kept kernel before issue 26 item 5 (its float64 sum)."""
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
            post = _sq(c, k)
            if not math.isfinite(post):
                partial[W + 1] = 1.0
                return
            partial[W] += post
            for r in range(W):
                partial[r] += _diff_sq_write(segs[r, lo:hi], c, k)

    @numba.njit(nogil=True)
    def scratch_pass(segs, scales, total, a, b, step, out, partial):
        """Measured, not kept: the consensus of the slice into ``out`` (P/W floats) with every rank's
        slice norm (its finiteness: the check that would ride the partial sums) and divergence sums;
        the segments untouched until a second pass copies ``out`` into each."""
        W = segs.shape[0]
        blocks = (b - a + step - 1) // step
        for j in range(blocks - 1, -1, -1):
            lo = a + j * step
            hi = min(lo + step, b)
            k = hi - lo
            c = out[lo - a : hi - a]
            for r in range(W):
                x = segs[r, lo:hi]
                partial[W + 2 + r] += _sq(x, k)
                if r == 0:
                    for i in range(k):
                        c[i] = x[i] * scales[r]
                else:
                    for i in range(k):
                        c[i] = c[i] + x[i] * scales[r]
            for i in range(k):
                c[i] = c[i] / total
            partial[W] += _sq(c, k)
            for r in range(W):
                partial[r] += _dsq(segs[r, lo:hi], c, k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=16_000_000, help="P, float32 elements per rank")
    ap.add_argument("--world", type=int, default=2, help="W, ranks of the node (segments)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    P, W = args.params, args.world
    base = np.random.default_rng(0).standard_normal((W, P)).astype(np.float32)
    segs = base.copy()
    a, b = 0, -(-P // W)
    scales = np.array([W * (1.0 + 0.5 * r) for r in range(W)], dtype=np.float64)
    total = float(sum(scales.tolist()))  # float64, rank order: the kept pass (issue 26 item 5)
    scales32 = scales.astype(np.float32)  # the float32 variants below (not kept): their own masses
    total32 = np.float32(0.0)
    for s in scales32:
        total32 = np.float32(total32 + s)

    def run(kernel, step, pre_sums=False):
        consensus_slice(segs, scales, total, a, b, step, np.empty(2 * step), np.zeros(2 * W + 2), kernel,
                        pre_sums)

    def timed(fn) -> float:
        best = math.inf
        for _ in range(args.repeats):
            segs[:] = base
            t = time.thread_time()
            fn()
            best = min(best, time.thread_time() - t)
        return 1e3 * best

    segs[:] = base
    run("numpy", STEPS["numpy"])
    want = segs.copy()
    layout = WireLayout([(P,)])
    rows = [("copy of the slice pair (read P, write P)",
             lambda: [np.copyto(segs[r, a:b], base[(r + 1) % W, a:b]) for r in range(W)], None),
            ("pre-round pass over one rank's P (read only)", lambda: sum_squares_pieces(segs[0], layout), None)]
    kernels = [k for k in KERNELS if k != "numba" or default_kernel() == "numba"]
    for kernel in kernels:
        for step in sorted({1 << 10, 1 << 12, 1 << 14, 1 << 16, STEPS[kernel]}):
            mark = " (its default)" if step == STEPS[kernel] else ""
            rows.append((f"{kernel} pass, blocks of {step}{mark}", lambda k=kernel, s=step: run(k, s), True))
        rows.append((f"{kernel} pass with the pre-round sums (stop)", lambda k=kernel: run(k, STEPS[k], True), True))
    if numba is not None:
        rows.append(("numba pass before its fused sweeps, blocks of 4096",
                     lambda: before_pass(segs, scales32, total32, np.float32(0.0), a, b, 4096,
                                         np.empty(2 * 4096, np.float32), np.zeros(2 * W + 2)), True))
    rows.append(("torch ops, blocks of 65536", lambda: torch_pass(segs, scales32, total32, a, b, 1 << 16), True))
    if numba is not None:  # no pre-round pass: consensus into a scratch of P/W, then copied into every segment
        out = np.empty(b - a, np.float32)
        first = lambda: scratch_pass(segs, scales32, total32, a, b, STEPS["numba"], out,  # noqa: E731
                                     np.zeros(2 * W + 2))
        second = lambda: [np.copyto(segs[r, a:b], out) for r in range(W)]  # noqa: E731
        rows += [("scratch variant: pass 1 (no write to segments)", first, None),
                 ("scratch variant: pass 2 (copy into W segments)", second, None),
                 ("scratch variant: both passes", lambda: (first(), second()), True)]
    print(f"P = {P:,} float32 per rank, W = {W}, slice [{a}, {b}); ms of this thread's CPU time, best of "
          f"{args.repeats}; 1-min load average {os.getloadavg()[0]:.1f} ({os.cpu_count()} cores); numba "
          f"{'installed' if default_kernel() == 'numba' else 'not installed'}")
    for name, fn, check in rows:
        ms = timed(fn)
        same = ""
        if check:
            segs[:] = base
            fn()
            same = "  same bits as numpy" if np.array_equal(segs, want) else \
                f"  differs from numpy by up to {float(np.abs(segs - want).max()):.1e}"
        print(f"{name:<48} {ms:8.2f}{same}")


if __name__ == "__main__":
    main()
