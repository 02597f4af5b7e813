"""The collectives of a round: control gather and the chunked sum-and-count reduce.

Collective contract for every function here: all ranks of ``comm`` call it, in
the same order, with buffers of the same length and dtype; a rank that does not
deadlocks the others (the watchdog in :mod:`flodl_mpi.world` then ends the job).
Only the bridge thread calls these during training.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from flodl_mpi.realized_work import is_realized
from flodl_mpi.wire import WireLayout, pack_chunk, unpack_chunk

__all__ = ["MAX_COUNT", "control_gather", "ReduceStats", "sumcount_reduce"]

#: Largest element count one MPI call takes (a C ``int``).
MAX_COUNT = 2**31 - 1


def control_gather(comm: MPI.Comm, row: np.ndarray) -> np.ndarray:
    """Allgather one float64 row per rank; every rank gets the same ``(W, k)`` matrix.

    Args:
        comm: the communicator.
        row: float64 array of shape ``(k,)``; ``k`` equal on every rank.

    Returns:
        float64 array of shape ``(comm.size, k)``; row r is rank r's.
    """
    row = np.ascontiguousarray(row, dtype=np.float64)
    out = np.empty((comm.size, row.size), dtype=np.float64)
    comm.Allgather([row, MPI.DOUBLE], [out, MPI.DOUBLE])
    return out


@dataclass
class ReduceStats:
    """What one sum-and-count reduce did, on this rank.

    Attributes:
        total_mass: the summed mass slot (float32 value as a float); it includes
            the factor W of the wire-scale trick.
        realized: ``is_realized(total_mass)``; when False the staging is untouched.
        pre_sq, diff_sq, post_sq: float64 sums of squares of the pre-round
            tensors (filled by the caller, see ``wire.sum_squares_pieces``), of
            ``pre - post`` and of the consensus (0 when not realized).
        post_finite: every consensus piece was finite (``post_sq`` is finite);
            the same on every rank, since it reads the reduced values. When
            False the staging holds whatever was unpacked before the first
            non-finite piece: the caller must stop the job.
        pack_ms, allreduce_ms, unpack_ms: wall time of each phase, milliseconds.
        bytes: bytes this rank put into Allreduce calls.
    """

    total_mass: float = 0.0
    realized: bool = False
    pre_sq: float = 0.0
    diff_sq: float = 0.0
    post_sq: float = 0.0
    post_finite: bool = True
    pack_ms: float = 0.0
    allreduce_ms: float = 0.0
    unpack_ms: float = 0.0
    bytes: int = 0


def sumcount_reduce(
    comm: MPI.Comm,
    layout: WireLayout,
    staging: np.ndarray,
    frame: np.ndarray,
    mass: float,
    scratch: np.ndarray,
) -> ReduceStats:
    """Realized-work weighted consensus ``Σ m_r·T_r / Σ m_r``, in place in ``staging``.

    Pack (``W·m·T``, mass slot ``W·m``), Allreduce(SUM) and unpack (one divide by
    the summed mass) run piece by piece while the piece is still in cache. The
    pieces go last to first so the piece holding the mass slot is reduced first:
    the divisor is known before any piece is unpacked. With MPI's SUM the factor
    W cancels in the divide; it is kept so the frame is also right over a
    transport that averages (SPEC §1, the wire-scale trick).

    Args:
        comm: the bridge's communicator.
        layout: the frame plan (same on every rank).
        staging: float32 ``(layout.n,)``: this rank's tensors; the consensus on
            return when realized, untouched otherwise.
        frame: float32 ``(layout.size,)`` persistent wire buffer (scratch).
        mass: this rank's mass ``m_r`` (>= 0; 0 for an idle rank, which then
            sends true zeros but still joins every call).
        scratch: float32 scratch of one piece (``layout.new_scratch()``).

    Returns:
        :class:`ReduceStats` (``pre_sq`` left 0: the caller measures it before
        the round). When the summed mass is not realized (every contribution
        idle), or a reduced piece is not finite, the remaining pieces are
        skipped on every rank alike: the decision reads the reduced values,
        the same everywhere.
    """
    # NaN/Inf may arrive (a rank's overflow, inf - inf): they are detected from the
    # sums, so numpy's warnings about them are noise here.
    with np.errstate(invalid="ignore", over="ignore"):
        return _reduce(comm, layout, staging, frame, mass, scratch)


def _reduce(comm, layout, staging, frame, mass, scratch) -> ReduceStats:
    stats = ReduceStats()
    scale = float(comm.size) * float(mass)
    clock = time.perf_counter
    for i, (lo, hi) in enumerate(reversed(layout.chunks)):
        t0 = clock()
        pack_chunk(staging, frame, lo, hi, scale)
        t1 = clock()
        comm.Allreduce(MPI.IN_PLACE, [frame[lo:hi], MPI.FLOAT], op=MPI.SUM)
        t2 = clock()
        stats.bytes += 4 * (hi - lo)
        stats.pack_ms += 1e3 * (t1 - t0)
        stats.allreduce_ms += 1e3 * (t2 - t1)
        if i == 0:
            total = frame[layout.n]  # np.float32: the divisor, exactly as summed
            stats.total_mass = float(total)
            stats.realized = is_realized(stats.total_mass)
            if not stats.realized:
                return stats  # no rank reduces further pieces
        d, p = unpack_chunk(frame, staging, lo, hi, total, scratch)
        stats.diff_sq += d
        stats.post_sq += p
        stats.unpack_ms += 1e3 * (clock() - t2)
        if not math.isfinite(p):
            # A reduced piece is the same on every rank, so every rank stops here:
            # no rank enters a further Allreduce. Nothing non-finite was unpacked.
            stats.post_finite = False
            return stats
    return stats
