"""The node-local reduce through one shared-memory window, and per-node partial sums across nodes.

Concept (issue 9): the ranks of one node share memory, so they need not send
each other anything. Each rank packs ``W·m·θ`` (and its mass ``W·m``) into its
own segment of one MPI shared window (unscaled, and the masses are gathered);
rank k sums slice k of every segment scaled by its mass, in rank order and in
float64, into the node's float64 result; every rank then unpacks the whole
result with the one divide, rounded to float32 once (float64 so that values
every rank holds alike come back unchanged, bit for bit: issue 26 item 5). Across nodes (hierarchical) the node leaders
exchange each node's mean, rounded to float32 once, and its float64 mass (an
Allgather, :mod:`flodl_mpi.transport.leaders`, 4 bytes a value on the link, not
the float64 sums' 8: issue 25 item 4), and every leader combines
``Σ_k M_k·μ_k`` in float64 in node order before anyone unpacks: weighted by the
nodes' masses, never an unweighted average of averages, so the consensus is
``Σ m_r·θ_r / Σ m_r`` up to one float32 rounding per node (the departure from
SPEC §1's "nothing but the final step divides" that buys the halved bytes; values
every rank holds alike still come back bit for bit, and every rank unpacks the
same bits: :mod:`flodl_mpi.protocol.node_means`).

Invariant: every element of the result is written by exactly one rank and read
by all only after a barrier, so every rank unpacks the same bits.
"""

from __future__ import annotations

import math
import time

import numpy as np
from mpi4py import MPI

from flodl_mpi.protocol.realized_work import is_realized
from flodl_mpi.protocol.wire import WireLayout, from_bf16, pack_piece, sum_squares, to_bf16, unpack_piece
from flodl_mpi.transport.leaders import LeaderMeans

__all__ = ["NodeMpiReduce", "ShmReduce", "slices"]

_ALIGN = 16  # elements: slice bounds on 64-byte lines, so two ranks never write one cache line
#: Elements per piece of the shared-memory loops (pack, sum, unpack): 256 KiB of
#: float32, so an unpack's four pieces (sum, staging, consensus, difference) stay in
#: a 2 MiB L2 (measured here: 65536 beat 262144 and 16384 elements). No MPI call
#: is this size: only the leaders' exchange uses the layout's pieces.
CACHE_PIECE = 1 << 16


def slices(size: int, parts: int, align: int = _ALIGN) -> list[tuple[int, int]]:
    """``parts`` half-open ranges covering ``[0, size)`` in order, bounds multiples of ``align``.

    The k-th is the slice rank k of a node sums; trailing ones may be empty.
    """
    q = -(-size // parts)
    q = -(-q // align) * align
    return [(min(k * q, size), min((k + 1) * q, size)) for k in range(parts)]


class _Clock:
    """Wall time per phase, ms."""

    def __init__(self) -> None:
        self.t = time.perf_counter()

    def lap(self) -> float:
        t, self.t = self.t, time.perf_counter()
        return 1e3 * (self.t - t)


class ShmReduce:
    """Sum-and-count reduce among the ranks of a node through one shared window (``--node-reduce shm``).

    Args:
        comm: the bridge's communicator (the world of the round, W ranks).
        layout: the frame plan, the same on every rank.
        node: the ranks sharing memory with this one, a sub-communicator of
            ``comm`` (``comm.Split_type(COMM_TYPE_SHARED)``, or a split of it to
            simulate nodes in tests). The reduce frees it.
        leaders: when the world spans more than one node, the communicator of
            the node leaders (``node.rank == 0``), ``MPI.COMM_NULL`` on the other
            ranks; None for one node. The reduce frees it.
        bf16: the frame travels as bfloat16 (SPEC §7): the segments hold bf16
            bits, the sums and the divide are float64, the masses float64.

    Memory (per node): one segment per rank (float32 or bf16 tensors,
    unscaled) and the node's float64 sum at the leader (8 bytes per element;
    the leaders exchange its float32 mean), i.e. about 1x the model's float32 bytes per
    rank plus 2x once per node, and three pieces of scratch per rank.

    Collective contract: construction, :meth:`prepare`, :meth:`reduce_prepared`,
    :meth:`reduce` and :meth:`free` are collective over ``comm`` (``node`` and
    ``leaders`` are parts of it): every rank calls, in the same order. Node
    barriers: before a rank writes its segment (no rank still reads the last
    result), after the sum (every slice is summed before anyone unpacks), and,
    for :meth:`reduce` only, after the pack (:meth:`reduce_prepared` relies on
    the control gather between it and :meth:`prepare`); plus the leaders'
    exchange when hierarchical (:class:`~flodl_mpi.transport.leaders.LeaderMeans`).
    If one rank fails inside, the others wait in a
    barrier: the watchdog ends the job (as for any collective). :meth:`reduce`
    gathers the node's masses after the segments are written (that gather is
    the barrier after the pack).
    """

    def __init__(self, comm: MPI.Comm, layout: WireLayout, node: MPI.Comm, leaders: MPI.Comm | None = None,
                 *, bf16: bool = False) -> None:
        self.comm, self.layout, self.node, self.leaders, self.bf16 = comm, layout, node, leaders, bf16
        self.world_size = comm.size
        L, size, n = node.size, layout.size, layout.n
        self.slice = slices(size, L)[node.rank]
        frame_bytes = -(-(2 if bf16 else 4) * n // 64) * 64  # the float64 sum after it stays 8-byte aligned
        mine = max(64, frame_bytes + (8 * size if node.rank == 0 else 0))
        self.win = MPI.Win.Allocate_shared(mine, 1, comm=node)
        self.extra_bytes = mine  # this rank's share of the window
        self.win.Lock_all(MPI.MODE_NOCHECK)
        segs = [np.frombuffer(self.win.Shared_query(k)[0], dtype=np.uint8) for k in range(L)]
        if bf16:
            self.frames16 = [s[: 2 * n].view(np.uint16) for s in segs]
            self.own = None
        else:
            self.frames = [s[: 4 * n].view(np.float32) for s in segs]
            self.own = self.frames[node.rank]
        #: the node's float64 sum (``size`` elements, the mass slot last), at the leader's segment
        self.result = segs[0][frame_bytes : frame_bytes + 8 * size].view(np.float64)
        #: the world ranks of this node, in node order (their masses scale the segments)
        self.members = node.allgather(comm.rank)
        self._prepared = False
        piece = min(layout.chunk_elems, CACHE_PIECE, size)
        self.step = piece
        self.pieces = [(lo, min(lo + piece, size)) for lo in range(0, size, piece)]
        self._post = np.empty(piece, dtype=np.float32)
        self._diff = np.empty(piece, dtype=np.float32)
        self._tmp = np.empty(piece, dtype=np.float64)
        self.extra_bytes += 2 * 4 * piece + 8 * piece
        self._leader_means = None
        if leaders is not None and leaders != MPI.COMM_NULL:
            self._leader_means = LeaderMeans(leaders, min(layout.chunk_elems, max(n, 1)), bf16=bf16)
            self.extra_bytes += self._leader_means.extra_bytes

    def _sync(self) -> None:
        # The shared-memory model's pattern: make this rank's stores visible, wait
        # for every rank of the node, then see theirs (MPI-4 §12.7, Win.Sync).
        self.win.Sync()
        self.node.Barrier()
        self.win.Sync()

    def free(self) -> None:
        """Release the window and the communicators (collective over ``comm``)."""
        self.win.Unlock_all()
        self.win.Free()
        self.node.Free()
        if self.leaders is not None and self.leaders != MPI.COMM_NULL:
            self.leaders.Free()

    # ---- the round -----------------------------------------------------------

    def prepare(self, staging: np.ndarray) -> float:
        """Copy ``staging`` into this rank's segment unscaled; return its sum of squares (float64).

        The snapshot and the pre-round norm in one pass (issue 9, "cut the
        passes"): each piece is copied (or rounded to bf16) and its squares
        summed while it is in cache. The masses, known only after the control
        gather, scale the segments in :meth:`reduce_prepared`'s sum. Collective
        over the node (one barrier: nobody still reads last round's result).
        """
        if self.layout.n == 0:  # nothing travels (a model without float buffers): decided by structure
            return 0.0
        self._sync()
        pre_sq = self._copy_in(staging, squares=True)
        self.win.Sync()  # our stores are out; the collective that brings the masses orders them
        self._prepared = True
        return pre_sq

    def _copy_in(self, staging: np.ndarray, squares: bool) -> float:
        """``staging`` into this rank's segment, unscaled (float32, or rounded to bf16); its sum of squares
        when asked (else 0.0), piece by piece from cache."""
        n, me = self.layout.n, self.node.rank
        pre_sq = 0.0
        for lo, hi in self.pieces:
            hi = min(hi, n)
            if hi <= lo:
                continue
            if self.bf16:
                to_bf16(staging[lo:hi], self.frames16[me][lo:hi])
            else:
                np.copyto(self.own[lo:hi], staging[lo:hi])
            if squares:
                pre_sq += sum_squares(staging[lo:hi])
        return pre_sq

    def reduce_prepared(self, staging: np.ndarray, masses, stats) -> None:
        """The reduce after :meth:`prepare`: ``masses`` holds every world rank's mass (the gathered ones).

        A rank of mass 0 (idle, quarantined) is skipped in the sum: true zeros,
        whatever its segment holds (SPEC §1).

        Ordering: the masses must come from a collective over ``comm`` that
        every rank entered after its :meth:`prepare` (the control gather): a
        rank leaves it only once every rank of the node has written its
        segment, so no barrier is spent here (``Win.Sync`` on both sides makes
        the stores visible, MPI-4 §12.7).
        """
        if not self._prepared:
            raise RuntimeError("reduce_prepared() without prepare() this round")
        self._prepared = False
        clock = _Clock()
        self.win.Sync()  # see the segments the node wrote before the gather
        self._sum_slice([float(self.world_size) * float(masses[r]) for r in self.members])
        self._finish(staging, stats, clock)

    def reduce(self, staging: np.ndarray, mass: float, stats) -> None:
        """Fill ``stats`` (a ``reduce.ReduceStats``); the consensus lands in ``staging`` when realized.

        The segment gets ``staging`` unscaled, as in :meth:`prepare`; the node's
        ``W·m`` are gathered once every segment is written (that gather is the
        barrier before the sum), and the sum scales the segments.
        """
        scale = float(self.world_size) * float(mass)
        clock = _Clock()
        self._sync()  # nobody still reads last round's result from a segment we overwrite
        wait = clock.lap()
        self._copy_in(staging, squares=False)
        self.win.Sync()
        stats.pack_ms += clock.lap()
        scales = self.node.allgather(scale)  # every rank of the node has written its segment
        self.win.Sync()
        stats.allreduce_ms += wait + clock.lap()
        self._sum_slice(scales)
        self._finish(staging, stats, clock)

    def _finish(self, staging: np.ndarray, stats, clock: _Clock) -> None:
        """Across nodes if hierarchical, then the one divide: every rank unpacks the whole result."""
        layout = self.layout
        if self.leaders is not None:
            self._sync()
            if self.leaders != MPI.COMM_NULL:
                stats.bytes += self._across_nodes()
        self._sync()
        stats.allreduce_ms += clock.lap()
        stats.bytes += (2 if self.bf16 else 4) * layout.n + 4  # the segment and its mass, as the in-place path counts
        total = float(self.result[layout.n])  # the float64 divisor, the same bits on every rank
        stats.total_mass = total
        stats.realized = is_realized(stats.total_mass)
        if not stats.realized:
            return
        for lo, hi in reversed(self.pieces):
            d, p = unpack_piece(self.result[lo:hi], staging, lo, hi, total, self._post, self._diff)
            stats.diff_sq += d
            stats.post_sq += p
            if not math.isfinite(p):  # the same result on every rank: all stop at this piece
                stats.post_finite = False
                break
        stats.unpack_ms += clock.lap()

    def _across_nodes(self) -> int:
        """The leaders' exchange (a leader only): the node's float64 sum in :attr:`result` becomes
        ``Σ_k M_k·μ_k`` of every node's float32 mean (:class:`~flodl_mpi.transport.leaders.LeaderMeans`),
        the mass slot ``Σ_k M_k``; the same bits on every leader. Returns the bytes this leader sent."""
        n, res, ex = self.layout.n, self.result, self._leader_means
        masses, total = ex.masses(float(res[n]))
        sent = 8
        if is_realized(total):  # decided from the gathered masses: every leader alike
            for lo, hi in self.layout.chunks:
                if lo < n:
                    sent += ex.exchange(res[lo:min(hi, n)], masses[self.leaders.rank])
        res[n] = total
        return sent

    def _sum_slice(self, scales) -> None:
        """This rank's slice of the node sum: every segment times its ``W·m`` (``scales``, node order),
        added in rank order in float64 into the result; the mass slot the float64 sum of ``scales``.

        A rank of scale 0 (idle, quarantined) is skipped: true zeros, whatever its segment holds.
        """
        a, b = self.slice
        n, step, res, tmp = self.layout.n, self.step, self.result, self._tmp
        for lo in range(a, min(b, n), step):
            hi = min(lo + step, b, n)
            k = hi - lo
            first = True
            for r, s in enumerate(scales):
                if s == 0.0:
                    continue  # true zeros: a NaN in an idle rank's segment must not survive
                x = from_bf16(self.frames16[r][lo:hi], self._post[:k]) if self.bf16 else self.frames[r][lo:hi]
                if first:
                    np.multiply(x, s, out=res[lo:hi], dtype=np.float64)
                    first = False
                else:
                    np.add(res[lo:hi], np.multiply(x, s, out=tmp[:k], dtype=np.float64), out=res[lo:hi])
            if first:
                res[lo:hi] = -0.0  # true zeros, the identity of IEEE sums (wire.pack_chunk)
        if a <= n < b:  # the mass slot: the float64 sum of the node's W·m, in rank order
            total = 0.0
            for s in scales:
                total += float(s)
            res[n] = total


class NodeMpiReduce:
    """Per-node partial sums with MPI calls only (``--hierarchical on --node-reduce mpi``).

    Piece by piece: pack (float64, as the flat wire: :mod:`flodl_mpi.protocol.wire`),
    ``Reduce(SUM)`` to the node leader, the leaders exchange their nodes' float32
    means and float64 masses (:class:`~flodl_mpi.transport.leaders.LeaderMeans`:
    the node sum becomes ``Σ_k M_k·μ_k``, the mass slot ``Σ_k M_k``), ``Bcast``
    within the node, unpack with the one divide (a round that realizes nothing
    ends on every rank at the first piece's total, the same gathered masses
    everywhere). Collective over ``comm`` as
    :class:`ShmReduce`; frees ``node`` and ``leaders``.
    """

    def __init__(self, comm: MPI.Comm, layout: WireLayout, node: MPI.Comm, leaders: MPI.Comm) -> None:
        self.comm, self.layout, self.node, self.leaders = comm, layout, node, leaders
        piece = min(layout.chunk_elems, layout.size)
        self._frame = np.empty(piece, dtype=np.float64)
        self._diff = np.empty(piece, dtype=np.float32)
        self.extra_bytes = 8 * piece + 4 * piece
        self._leader_means = LeaderMeans(leaders, piece) if leaders != MPI.COMM_NULL else None
        if self._leader_means is not None:
            self.extra_bytes += self._leader_means.extra_bytes

    def free(self) -> None:
        self.node.Free()
        if self.leaders != MPI.COMM_NULL:
            self.leaders.Free()

    def reduce(self, staging: np.ndarray, mass: float, stats) -> None:
        layout = self.layout
        scale = float(self.comm.size) * float(mass)
        leader, ex, n = self.node.rank == 0, self._leader_means, layout.n
        total = mine = None
        for i, (lo, hi) in enumerate(reversed(layout.chunks)):
            clock = _Clock()
            f = self._frame[: hi - lo]
            pack_piece(staging, lo, hi, f, scale)
            stats.pack_ms += clock.lap()
            self.node.Reduce(MPI.IN_PLACE if leader else [f, MPI.DOUBLE], [f, MPI.DOUBLE], op=MPI.SUM, root=0)
            stats.bytes += 8 * (hi - lo)  # the node's Reduce, in float64
            if leader:  # the node sum becomes Σ_k M_k·μ_k over the nodes' float32 means (transport.leaders)
                if i == 0:  # the piece with the mass slot comes first: the masses before any mean
                    mine = float(f[n - lo])
                    _, f[n - lo] = ex.masses(mine)
                    stats.bytes += 8
                if hi > lo and lo < n:
                    stats.bytes += ex.exchange(f[: min(hi, n) - lo], mine)
            self.node.Bcast([f, MPI.DOUBLE], root=0)
            stats.allreduce_ms += clock.lap()
            if i == 0:
                total = float(f[layout.n - lo])
                stats.total_mass = total
                stats.realized = is_realized(stats.total_mass)
                if not stats.realized:
                    return
            d, p = unpack_piece(f, staging, lo, hi, total, self._diff, f.view(np.float32))  # as reduce._unpack
            stats.diff_sq += d
            stats.post_sq += p
            stats.unpack_ms += clock.lap()
            if not math.isfinite(p):
                stats.post_finite = False
                return

