"""The delta wires' round (``--wire bf16-delta``, ``--wire int8-delta``): quantised deltas gathered over the world.

Invariant: every rank holds the same float32 reference ``c`` (the last consensus, or
the outer optimizer's step on it: :meth:`DeltaReduce.rebase`), bit for bit; a round
makes the next one from gathered values only, in rank order, in float64, so it is
bit-identical on every rank too. Each rank sends ``Q(θ − c + e)`` and its exact mass
``W·m`` (float64 bits); every rank sums ``Σ W·m_r · deq(q_r)`` and ``Σ W·m_r`` in
float64 in rank order and unpacks ``c + sum / Σ W·m`` with the one divide of every path
(:func:`~flodl_mpi.protocol.wire.unpack_piece`: the float64 quotient rounded to float32
once), so the consensus is ``c`` plus the mass-weighted mean of the ranks' quantised
deltas. The quantisation and the error feedback ``e`` are :mod:`flodl_mpi.protocol.delta_quant`.

Values every rank holds alike and that did not move since the reference come back
unchanged, bit for bit (their delta is 0, and 0 quantises to 0): issue 26 item 5 for
the unmoved ones. Values that moved alike on every rank come back within the
quantisation step, the remainder held in each rank's error feedback and sent next round.

The first round has no reference: it runs the exact float64 Allreduce
(:func:`~flodl_mpi.transport.reduce.sumcount_reduce`'s path) and takes its consensus as ``c``
(so does the first round after a resume from a checkpoint that holds no wire state:
:meth:`DeltaReduce.load_state` puts a saved reference and error feedback back). A rank of mass 0 (idle, quarantined) sends
zeros and keeps its error feedback.

MPI has no SUM for bfloat16 or a shared int8 grid, so the pieces are Allgathered (as
the bf16 wire's): a rank receives ``(W − 1)`` pieces of 2 (bf16) or 1 (int8) bytes per
element; the int8 wire adds one max-abs Allreduce of a float64 per tensor per round.
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from flodl_mpi.protocol.delta_quant import int8_dequantize, int8_quantize, int8_scale, quantize_bf16
from flodl_mpi.protocol.realized_work import is_realized
from flodl_mpi.protocol.wire import WireLayout, from_bf16

__all__ = ["DELTA_KINDS", "DeltaReduce"]

#: The quantisations of the delta wire: ``--wire bf16-delta`` and ``--wire int8-delta``.
DELTA_KINDS = ("bf16", "int8")


class DeltaReduce:
    """One plane's delta-wire round, planned once: the reference, the error feedback and the piece buffers.

    Args:
        comm: the bridge's communicator (every rank of it calls every method alike).
        layout: the frame plan, the same on every rank.
        kind: one of :data:`DELTA_KINDS`.
        exact_round: ``(staging, mass, stats) -> None``: the exact float64 round, run while
            there is no reference (the first round).

    Attributes:
        extra_bytes: bytes this rank holds for the wire (reference, error feedback, pieces).
    """

    def __init__(self, comm: MPI.Comm, layout: WireLayout, kind: str, exact_round) -> None:
        if kind not in DELTA_KINDS:
            raise ValueError(f"kind must be one of {', '.join(DELTA_KINDS)}, got {kind!r}")
        self.comm, self.layout, self.kind, self._exact = comm, layout, kind, exact_round
        n, W = layout.n, comm.size
        piece = max(min(layout.chunk_elems, layout.size), 1)
        self.reference = np.zeros(n, np.float32)
        self.error = np.zeros(n, np.float32)
        self.has_reference = False
        self._d, self._err, self._w32 = (np.empty(piece, np.float32) for _ in range(3))
        self._acc, self._tmp64 = np.empty(piece, np.float64), np.empty(piece, np.float64)
        self._post, self._diff = np.empty(piece, np.float32), np.empty(piece, np.float32)
        # one piece as sent: its quantised values, then the rank's W·m as float64 bits
        if kind == "bf16":
            self._send = np.empty(piece + 4, np.uint16)
            self._recv = np.empty(W * (piece + 4), np.uint16)
            self._mpi_type, self._mass_slots, self._elem_bytes = MPI.UINT16_T, 4, 2
        else:
            self._send = np.empty(piece + 8, np.int8)
            self._recv = np.empty(W * (piece + 8), np.int8)
            self._mpi_type, self._mass_slots, self._elem_bytes = MPI.INT8_T, 8, 1
        # the int8 grid's step of each tensor, agreed every round
        self._scales = np.zeros(len(layout.sizes), np.float64)
        self.extra_bytes = int(sum(b.nbytes for b in (self.reference, self.error, self._d, self._err, self._w32,
                                                      self._acc, self._tmp64, self._post, self._diff, self._send,
                                                      self._recv, self._scales)))

    def rebase(self, staging: np.ndarray) -> None:
        """Take ``staging`` (the same on every rank: the outer optimizer's step on the consensus) as the reference."""
        if self.has_reference:
            np.copyto(self.reference, staging)

    def load_state(self, reference: np.ndarray | None, error: np.ndarray | None) -> None:
        """Put back a saved ``reference`` (float32 ``(layout.n,)``, the same on every rank; None: none yet, the
        next round is the exact one) and this rank's ``error`` feedback (None: zeros, as a fresh rank's).

        Raises:
            ValueError: an array that is not ``layout.n`` long.
        """
        for name, arr in (("reference", reference), ("error feedback", error)):
            if arr is not None and np.shape(arr) != (self.layout.n,):
                raise ValueError(f"saved delta-wire {name} has shape {np.shape(arr)}, expected ({self.layout.n},)")
        self.has_reference = reference is not None
        np.copyto(self.reference, 0.0 if reference is None else np.asarray(reference, np.float32))
        np.copyto(self.error, 0.0 if error is None else np.asarray(error, np.float32))

    def reduce(self, staging: np.ndarray, mass: float, stats, unpack) -> None:
        """One round into ``staging`` and ``stats`` (:class:`~flodl_mpi.transport.reduce.ReduceStats`).

        ``unpack``: ``(stats, summed, staging, lo, hi, total, post, diff, t_start) -> bool``, the reducer's
        unpack of one summed float64 piece (False: not finite, every rank stops there).
        """
        if not self.has_reference:
            self._exact(staging, mass, stats)
            if stats.realized and stats.post_finite:
                np.copyto(self.reference, staging)
                self.has_reference = True  # decided from reduced values: on every rank alike
            return
        comm, layout, n, W = self.comm, self.layout, self.layout.n, self.comm.size
        scale = float(W) * float(mass)
        clock = time.perf_counter
        if self.kind == "int8":
            t0 = clock()
            self._agree_scales(staging, scale > 0.0)
            stats.bytes += self._scales.nbytes
            stats.allreduce_ms += 1e3 * (clock() - t0)
        slots = self._mass_slots
        mass_bits = np.array([scale], dtype=np.float64).view(self._send.dtype)
        total = None
        for i, (lo, hi) in enumerate(reversed(layout.chunks)):
            t0 = clock()
            t_hi = min(hi, n)
            k = max(t_hi - lo, 0)
            send = self._send
            if scale == 0.0 or k == 0:
                send[:k] = 0
            else:
                d = np.add(np.subtract(staging[lo:t_hi], self.reference[lo:t_hi], out=self._d[:k]),
                           self.error[lo:t_hi], out=self._d[:k])
                self._quantize(d, lo, t_hi, send[:k], self._err[:k])
            send[k : k + slots] = mass_bits
            t1 = clock()
            recv = self._recv[: W * (k + slots)]
            comm.Allgather([send[: k + slots], self._mpi_type], [recv, self._mpi_type])
            parts = recv.reshape(W, k + slots)
            scales = np.ascontiguousarray(parts[:, k : k + slots]).view(np.float64).ravel().tolist()
            stats.bytes += self._elem_bytes * k + 8
            if i == 0:
                total = 0.0
                for m in scales:  # float64, rank order
                    total += m
                stats.total_mass = total
                stats.realized = is_realized(total)
                if not stats.realized:
                    stats.pack_ms += 1e3 * (t1 - t0)
                    stats.allreduce_ms += 1e3 * (clock() - t1)
                    return  # nothing adopted: the error feedback stays as it was
            acc = self._acc[:k]
            np.multiply(self.reference[lo:t_hi], total, out=acc, dtype=np.float64)  # c · Σ W·m: c after the divide
            for r, s in enumerate(scales):  # float64, rank order; a rank of mass 0 sent zeros
                if s != 0.0:
                    np.add(acc, np.multiply(self._dequantize(parts[r, :k], lo, t_hi), s, out=self._tmp64[:k]),
                           out=acc)
            t2 = clock()
            stats.pack_ms += 1e3 * (t1 - t0)
            stats.allreduce_ms += 1e3 * (t2 - t1)
            if scale != 0.0 and k:
                np.copyto(self.error[lo:t_hi], self._err[:k])
            if not unpack(stats, acc, staging, lo, hi, total, self._post, self._diff, t2):
                return
            np.copyto(self.reference[lo:t_hi], staging[lo:t_hi])

    # ---- the quantisations ------------------------------------------------------------------

    def _segments(self, lo: int, hi: int):
        """``(tensor index, a, b)`` for each tensor's part ``[a, b)`` of ``[lo, hi)``."""
        offsets = self.layout.offsets
        t = int(np.searchsorted(offsets, lo, side="right")) - 1
        while lo < hi:
            b = min(hi, int(offsets[t + 1]))
            if b > lo:
                yield t, lo, b
            lo, t = b, t + 1

    def _agree_scales(self, staging: np.ndarray, sends: bool) -> None:
        """Every tensor's int8 step: the max over ranks of ``max |θ − c + e|`` (one Allreduce MAX), / 127."""
        mx = self._scales
        mx[:] = 0.0
        if sends:
            for lo, hi in self.layout.chunks:
                hi = min(hi, self.layout.n)
                for t, a, b in self._segments(lo, hi):
                    d = np.add(np.subtract(staging[a:b], self.reference[a:b], out=self._d[: b - a]),
                               self.error[a:b], out=self._d[: b - a])
                    mx[t] = max(mx[t], float(np.max(np.abs(d, out=d))))
        self.comm.Allreduce(MPI.IN_PLACE, [mx, MPI.DOUBLE], op=MPI.MAX)
        for t in range(len(mx)):
            mx[t] = int8_scale(mx[t])

    def _quantize(self, d: np.ndarray, lo: int, hi: int, q: np.ndarray, err: np.ndarray) -> None:
        if self.kind == "bf16":
            quantize_bf16(d, q, err, self._w32[: hi - lo])
            return
        for t, a, b in self._segments(lo, hi):
            int8_quantize(d[a - lo : b - lo], float(self._scales[t]), q[a - lo : b - lo], err[a - lo : b - lo],
                          self._tmp64[a - lo : b - lo])

    def _dequantize(self, q: np.ndarray, lo: int, hi: int) -> np.ndarray:
        """A rank's piece as float64 deltas (in ``self._tmp64``)."""
        out = self._tmp64[: hi - lo]
        if self.kind == "bf16":
            np.copyto(out, from_bf16(q, self._w32[: hi - lo]))
            return out
        for t, a, b in self._segments(lo, hi):
            int8_dequantize(q[a - lo : b - lo], float(self._scales[t]), out[a - lo : b - lo])
        return out
