"""The collectives of a round: control gather and the chunked sum-and-count reduce.

Collective contract for every function here: all ranks of ``comm`` call it, in
the same order, with buffers of the same length and dtype; a rank that does not
deadlocks the others (the watchdog in :mod:`flodl_mpi.runtime.world` then ends the job).
Only the bridge thread calls these during training.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from flodl_mpi.config import HIERARCHICAL, NODE_REDUCES, delta_refusal
from flodl_mpi.protocol.realized_work import is_realized
from flodl_mpi.protocol.wire import WireLayout, from_bf16, pack_piece, sum_squares_pieces, to_bf16, unpack_piece
from flodl_mpi.transport.delta_reduce import DELTA_KINDS, DeltaReduce

__all__ = [
    "HIERARCHICAL",
    "MAX_COUNT",
    "NODE_REDUCES",
    "ReduceStats",
    "Reducer",
    "WireOptions",
    "control_gather",
    "delta_refusal",
    "sumcount_reduce",
]


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
        total_mass: the summed mass slot (float64); it includes the factor W
            of the wire-scale trick.
        realized: ``is_realized(total_mass)``; when False the staging is untouched.
        pre_sq, diff_sq, post_sq: float64 sums of squares of the pre-round
            tensors (filled by the caller, see ``wire.sum_squares_pieces``), of
            ``pre - post`` and of the consensus (0 when not realized).
        post_finite: every consensus piece was finite (``post_sq`` is finite);
            the same on every rank, since it reads the reduced values. When
            False the staging holds whatever was unpacked before the first
            non-finite piece: the caller must stop the job.
        pre_sums: float64 ``(W,)``, every rank's pre-round ``sum(T_r ** 2)``
            (world rank order, the same on every rank; not finite exactly where
            rank r's tensors held a NaN or an infinity), summed by the in-place
            pass as it read the segments, when asked (``Reducer.reduce``'s
            ``pre_sums``); None on every other path, when not asked and when
            not realized. After a non-finite consensus (``post_finite`` False) only
            the blocks up to the first non-finite one are counted, that one
            included.
        pack_ms, allreduce_ms, unpack_ms: wall time of each phase, milliseconds.
        bytes: bytes this rank put into Allreduce calls.
    """

    total_mass: float = 0.0
    realized: bool = False
    pre_sq: float = 0.0
    diff_sq: float = 0.0
    post_sq: float = 0.0
    post_finite: bool = True
    pre_sums: np.ndarray | None = None
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

    Pack (``W·m·T``, mass slot ``W·m``, float64), Allreduce(SUM) and unpack (one
    divide by the summed mass, rounded to float32 once) run piece by piece while
    the piece is still in cache. The frame is float64 so that a value every rank
    holds alike comes back unchanged, bit for bit, at any W and any masses
    (issue 26 item 5; :mod:`flodl_mpi.protocol.wire` says why not float32 deltas). The
    pieces go last to first so the piece holding the mass slot is reduced first:
    the divisor is known before any piece is unpacked. With MPI's SUM the factor
    W cancels in the divide; it is kept so the frame is also right over a
    transport that averages (SPEC §1, the wire-scale trick).

    Args:
        comm: the bridge's communicator.
        layout: the frame plan (same on every rank).
        staging: float32 ``(layout.n,)``: this rank's tensors; the consensus on
            return when realized, untouched otherwise.
        frame: float64 persistent wire buffer (scratch) of at least one piece;
            a whole frame (``layout.new_frame()``) works too.
        mass: this rank's mass ``m_r`` (>= 0; 0 for an idle rank, which then
            sends true zeros but still joins every call).
        scratch: float32 scratch of one piece (``layout.new_scratch()``).

    Returns:
        :class:`ReduceStats` (``pre_sq`` left 0: the caller measures it before
        the round). When the summed mass is not realized (every contribution
        idle), or a reduced piece is not finite, the remaining pieces are
        skipped on every rank alike: the decision reads the reduced values,
        the same everywhere.

    Raises:
        TypeError: ``frame`` is not float64.
    """
    if frame.dtype != np.float64:
        raise TypeError(f"the wire frame must be float64 (layout.new_frame()), got {frame.dtype}")
    # NaN/Inf may arrive (a rank's overflow, inf - inf): they are detected from the
    # sums, so numpy's warnings about them are noise here.
    with np.errstate(invalid="ignore", over="ignore"):
        return _reduce(comm, layout, staging, frame, mass, scratch)


def _reduce(comm, layout, staging, frame, mass, scratch, stats=None) -> ReduceStats:
    # ``frame`` may be a whole frame or one piece: piece i is packed into its first
    # hi - lo elements, reduced and unpacked before the next one is packed.
    stats = ReduceStats() if stats is None else stats
    scale = float(comm.size) * float(mass)
    clock = time.perf_counter
    for i, (lo, hi) in enumerate(reversed(layout.chunks)):
        t0 = clock()
        f = frame[: hi - lo]
        pack_piece(staging, lo, hi, f, scale)
        t1 = clock()
        comm.Allreduce(MPI.IN_PLACE, [f, MPI.DOUBLE], op=MPI.SUM)
        t2 = clock()
        stats.bytes += 8 * (hi - lo)
        stats.pack_ms += 1e3 * (t1 - t0)
        stats.allreduce_ms += 1e3 * (t2 - t1)
        if i == 0:
            total = f[layout.n - lo]  # np.float64: the divisor, exactly as summed
            stats.total_mass = float(total)
            stats.realized = is_realized(stats.total_mass)
            if not stats.realized:
                return stats  # no rank reduces further pieces
        # the consensus into the float32 scratch, the difference into the reduced piece's own bytes
        if not _unpack(stats, f, staging, lo, hi, total, scratch, f.view(np.float32), t2):
            return stats
    return stats


def _unpack(stats, summed, staging, lo, hi, total, post, diff, t_start: float) -> bool:
    """Divide one reduced piece into ``staging`` and add its sums and time to ``stats``.

    ``post`` and ``diff``: float32 scratch of the piece's length (``diff`` may be the
    reduced piece's own memory: it is written after the divide has read it). The
    consensus is rounded to float32 before the difference is taken, so a rank whose
    values equal the consensus has a difference of exactly 0.

    Returns False when the piece is not finite. A reduced piece is the same on
    every rank, so every rank stops there: no rank enters a further collective,
    and nothing non-finite was unpacked (``stats.post_finite`` is False).
    """
    d, p = unpack_piece(summed, staging, lo, hi, total, post, diff)
    stats.diff_sq += d
    stats.post_sq += p
    stats.unpack_ms += 1e3 * (time.perf_counter() - t_start)
    if not math.isfinite(p):
        stats.post_finite = False
        return False
    return True


def _reduce_bf16_allgather(comm, layout, staging, mass, bufs, stats) -> None:
    """The flat bf16 wire (SPEC §7): pieces travel as bfloat16 and are summed in float64.

    MPI has no bfloat16 SUM, and a user-defined op would add in bfloat16 (or
    re-round each partial sum), so every rank Allgathers the pieces' bf16 bits
    and sums the W contributions itself, in rank order and in float64: the
    same bits on every rank. Each piece carries the rank's ``W·m`` as float64
    bits in four extra uint16 slots (the mass exact), and the values travel
    unscaled, ``bf16(θ)``: each rank scales the pieces it receives, as the
    shared-memory bf16 sum does, so values every rank holds alike and that
    bfloat16 holds exactly (every adopted value after the first round, SPEC §7)
    come back unchanged, bit for bit (issue 26 item 5; ``bf16(W·m·θ)`` would
    round again). An idle rank sends true zeros. A rank receives ``(W - 1)``
    quarter-size pieces (bf16 against the float64 wire): fewer bytes than the
    float64 ring Allreduce's ``2(W - 1)/W`` frames below W = 8, more beyond.
    """
    send, recv, acc, tmp, diff, tmp64 = bufs
    W, n = comm.size, layout.n
    scale = float(W) * float(mass)
    mass_bits = np.array([scale], dtype=np.float64).view(np.uint16)
    clock = time.perf_counter
    total = None
    for i, (lo, hi) in enumerate(reversed(layout.chunks)):
        t0 = clock()
        t_hi = min(hi, n)
        k = max(t_hi - lo, 0)  # tensor elements in this piece
        if scale == 0.0:
            send[:k] = 0
        elif k:
            to_bf16(staging[lo:t_hi], send[:k])
        send[k : k + 4] = mass_bits
        t1 = clock()
        comm.Allgather([send[: k + 4], MPI.UINT16_T], [recv[: W * (k + 4)], MPI.UINT16_T])
        parts = recv[: W * (k + 4)].reshape(W, k + 4)
        scales = np.ascontiguousarray(parts[:, k : k + 4]).view(np.float64).ravel().tolist()
        first = True
        for r, s in enumerate(scales):  # float64, rank order; a rank of mass 0 is skipped (true zeros)
            if s == 0.0:
                continue
            x = from_bf16(parts[r, :k], tmp[:k])
            if first:
                np.multiply(x, s, out=acc[:k], dtype=np.float64)
                first = False
            else:
                np.add(acc[:k], np.multiply(x, s, out=tmp64[:k], dtype=np.float64), out=acc[:k])
        if first:
            acc[:k] = 0.0
        t2 = clock()
        stats.bytes += 2 * (k + 4)
        stats.pack_ms += 1e3 * (t1 - t0)
        stats.allreduce_ms += 1e3 * (t2 - t1)
        if i == 0:
            total = 0.0
            for m in scales:  # float64, rank order, as the tensors
                total += m
            stats.total_mass = total
            stats.realized = is_realized(stats.total_mass)
            if not stats.realized:
                return
        if not _unpack(stats, acc, staging, lo, hi, total, tmp, diff, t2):
            return


@dataclass(frozen=True)
class WireOptions:
    """How a round's frames travel (``--node-reduce``, ``--hierarchical``, ``--bf16-wire``).

    Attributes:
        node_reduce: ``"shm"``: the ranks of a node sum through one shared-memory
            window (:class:`~flodl_mpi.transport.node_reduce.ShmReduce`); ``"mpi"``: MPI
            calls only; ``"auto"``: ``shm`` when every node's ``/dev/shm`` has
            room for the window (and the world is on one node, or hierarchical
            is not ``off``), else ``mpi``. Measured faster than the chunked
            Allreduce on one node (``benchmarks/README.md``).
        hierarchical: ``"on"``: node sums first, then the node leaders exchange
            the nodes' float32 means and float64 masses
            (:mod:`flodl_mpi.transport.leaders`); ``"off"``: one flat reduce over
            the world (``shm`` then needs the whole world on one node); ``"auto"``: on when the world spans
            more than one node and ``node_reduce`` is ``shm``.
        bf16: params and float buffers travel as bfloat16; sums and the divide
            in float64, the consensus rounded to float32 once; the mass exact
            (SPEC §7).
        delta: ``"off"``, or one of :data:`~flodl_mpi.transport.delta_reduce.DELTA_KINDS`:
            the delta wire (``--wire bf16-delta`` / ``int8-delta``,
            :mod:`flodl_mpi.transport.delta_reduce`): quantised ``θ − c`` with error
            feedback, over an MPI Allgather of the world. It runs flat over MPI only:
            ``node_reduce 'shm'`` and ``hierarchical 'on'`` are refused with it
            (``auto`` resolves to ``mpi`` and flat).

    Raises:
        ValueError: an unknown choice, or a combination not implemented.
    """

    node_reduce: str = "auto"
    hierarchical: str = "auto"
    bf16: bool = False
    delta: str = "off"

    def __post_init__(self) -> None:
        if self.node_reduce not in NODE_REDUCES:
            raise ValueError(f"node_reduce must be one of {', '.join(NODE_REDUCES)}, got {self.node_reduce!r}")
        if self.hierarchical not in HIERARCHICAL:
            raise ValueError(f"hierarchical must be one of {', '.join(HIERARCHICAL)}, got {self.hierarchical!r}")
        if not isinstance(self.bf16, bool):
            raise TypeError(f"bf16 must be True or False, got {self.bf16!r}")
        if self.bf16 and self.node_reduce == "mpi" and self.hierarchical == "on":
            raise ValueError(f"bf16 with node_reduce {self.node_reduce!r} and hierarchical 'on' is not implemented; "
                             "use node_reduce 'shm' (or hierarchical 'off')")
        if self.delta not in ("off", *DELTA_KINDS):
            raise ValueError(f"delta must be 'off' or one of {', '.join(DELTA_KINDS)}, got {self.delta!r}")
        if self.delta != "off" and (self.bf16 or self.node_reduce == "shm" or self.hierarchical == "on"):
            raise ValueError(delta_refusal(self.delta, self.node_reduce, self.hierarchical, self.bf16))



def _window_bytes(layout: WireLayout, ranks: int, bf16: bool) -> int:
    """Bytes of one node's shared window (:class:`~flodl_mpi.transport.node_reduce.ShmReduce`), about: a segment per
    rank and the leader's float64 node sum."""
    return ranks * (2 if bf16 else 4) * layout.size + 8 * layout.size


def _shm_free() -> int | None:
    """Free bytes of ``/dev/shm`` (where MPICH and Open MPI back shared windows), None if unknown.

    A window larger than that would fail at its first touch (SIGBUS), not at
    allocation, so the room is checked first.
    """
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class Reducer:
    """One plane's sum-and-count reduce (params or float buffers), planned once (STYLE 21).

    Picks the path from :class:`WireOptions` and the world's shape, allocates
    its buffers once, and runs the same mass algebra on every path (SPEC §1):
    pack ``W·m·θ`` with the mass slot ``W·m``, sum, one divide by the summed
    mass; the consensus lands in the caller's staging.

    Paths (``path`` attribute): ``"allreduce"`` (chunked float64 Allreduce,
    :func:`sumcount_reduce` with a one-piece frame), ``"allgather-bf16"``
    (:func:`_reduce_bf16_allgather`), ``"shm"`` / ``"shm+leaders"`` (one
    node's shared window, then the node leaders across nodes),
    ``"shm-in-place"`` (one node, float32, the staging in the shared memory: ``in_place``),
    ``"node-mpi+leaders"`` (MPI Reduce within the node, the leaders' exchange of float32 node means, Bcast),
    ``"allgather-bf16-delta"`` / ``"allgather-int8-delta"`` (the delta wire,
    :class:`~flodl_mpi.transport.delta_reduce.DeltaReduce`: its first round the exact Allreduce).

    Args:
        comm: the bridge's communicator; the reducer splits its own node and
            leader communicators from it and frees them in :meth:`free`.
        layout: the frame plan, the same on every rank.
        options: :class:`WireOptions`.
        node_comm: the ranks that share memory with this one; None (the
            default) takes ``comm.Split_type(COMM_TYPE_SHARED)``. Tests pass a
            split of it to simulate several nodes on one machine. It must be a
            subset of one shared-memory node; the reducer frees it.
        in_place: on the float32 shared-memory path of one node, let the
            reducer own the staging (:attr:`staging`: this rank's segment of
            the node's shared file, :class:`~flodl_mpi.transport.shm_in_place.InPlaceShmReduce`):
            no pack, one read and one write of the model per rank. The caller
            then puts its tensors there (bound parameters live there) and
            passes :attr:`staging` to :meth:`reduce`. Taken only when every
            rank asks for it; elsewhere (bf16, several nodes, ``mpi``, an empty
            layout, a rank that did not ask) :attr:`staging` is None on every
            rank and the caller keeps its own.

    Raises:
        ValueError: identically on every rank (the node count is reduced
            first): ``node_reduce 'shm'`` with ``hierarchical 'off'`` on a world
            of more than one node, or with too little free ``/dev/shm`` on a node.

    Collective contract: construction, :meth:`reduce` and :meth:`free` are
    collective over ``comm``: all ranks, the same order, the same options.
    """

    def __init__(self, comm: MPI.Comm, layout: WireLayout, options: WireOptions | None = None,
                 node_comm: MPI.Comm | None = None, *, in_place: bool = False) -> None:
        from flodl_mpi.transport.node_reduce import NodeMpiReduce, ShmReduce  # one concept per module
        from flodl_mpi.transport.shm_in_place import SHM_DIR, InPlaceShmReduce

        options = options or WireOptions()
        self.comm, self.layout, self.options = comm, layout, options
        node = node_comm if node_comm is not None else comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
        nodes = comm.allreduce(int(node.rank == 0), op=MPI.SUM)
        self.nodes = nodes
        kind = options.node_reduce
        if options.delta != "off":  # flat over MPI (WireOptions refused shm and hierarchical on)
            kind = "mpi"
        if kind != "mpi":
            need = _window_bytes(layout, node.size, options.bf16)
            free = _shm_free()
            room = comm.allreduce(free is None or free >= need + (64 << 20), op=MPI.LAND)  # every node alike
            if not room and kind == "shm":
                node.Free()
                raise ValueError(f"node_reduce 'shm' needs about {need / 2**20:.0f} MiB of shared memory (/dev/shm) "
                                 f"per node and some node has less free; use node_reduce 'mpi' (or 'auto')")
            if kind == "auto":
                kind = "shm" if room and (nodes == 1 or options.hierarchical != "off") else "mpi"
        #: the node reduce in use: ``"shm"`` or ``"mpi"`` (``"auto"`` resolved, the same on every rank)
        self.node_reduce = kind
        hier = options.hierarchical == "on" or (options.hierarchical == "auto" and nodes > 1 and kind == "shm")
        hier = hier and options.delta == "off"
        if options.bf16 and hier and kind == "mpi":
            node.Free()
            raise ValueError("bf16 with a hierarchical MPI node reduce is not implemented; use node_reduce 'shm' "
                             "(with room in /dev/shm) or hierarchical 'off'")
        if kind == "shm" and not hier and nodes > 1:
            node.Free()
            raise ValueError(f"node_reduce 'shm' with hierarchical 'off' needs the world on one node, it spans "
                             f"{nodes}; use hierarchical 'auto' or 'on', or node_reduce 'mpi'")
        self._impl = None
        #: the staging the reduce works in (:class:`~flodl_mpi.transport.shm_in_place.InPlaceShmReduce`), or None:
        #: the caller brings its own
        self.staging = None
        piece = min(layout.chunk_elems, layout.size)
        # Every rank alike, whatever each asked: a rank with pinned (GPU) staging in a mixed
        # cohort keeps the packing window, so every rank does; the file needs SHM_DIR everywhere.
        in_place = comm.allreduce(bool(in_place and kind == "shm" and nodes == 1 and not options.bf16
                                       and layout.n > 0 and os.path.isdir(SHM_DIR)
                                       and os.access(SHM_DIR, os.W_OK)), op=MPI.LAND)
        if in_place:
            try:
                self._impl = InPlaceShmReduce(comm, layout, node)
            except OSError:  # raised on every rank alike
                node.Free()
                raise
            self.staging = self._impl.staging
            self.path = "shm-in-place"
            self.extra_bytes = self._impl.extra_bytes
        elif kind == "shm":
            leaders = comm.Split(0 if node.rank == 0 else MPI.UNDEFINED, key=comm.rank) if nodes > 1 else None
            self._impl = ShmReduce(comm, layout, node, leaders, bf16=options.bf16)
            self.path = "shm+leaders" if nodes > 1 else "shm"
            self.extra_bytes = self._impl.extra_bytes
        elif hier:
            leaders = comm.Split(0 if node.rank == 0 else MPI.UNDEFINED, key=comm.rank)
            self._impl = NodeMpiReduce(comm, layout, node, leaders)
            self.path = "node-mpi+leaders"
            self.extra_bytes = self._impl.extra_bytes
        else:
            node.Free()
            if options.delta != "off":
                self._frame, self._scratch = np.empty(piece, np.float64), np.empty(piece, np.float32)
                self._delta = DeltaReduce(comm, layout, options.delta, self._exact_round)
                self.path = f"allgather-{options.delta}-delta"
                self.extra_bytes = self._frame.nbytes + self._scratch.nbytes + self._delta.extra_bytes
            elif options.bf16:
                W = comm.size
                self._bufs = (np.empty(piece + 4, np.uint16), np.empty(W * (piece + 4), np.uint16),
                              np.empty(piece, np.float64), np.empty(piece, np.float32), np.empty(piece, np.float32),
                              np.empty(piece, np.float64))
                self.path = "allgather-bf16"
                self.extra_bytes = sum(b.nbytes for b in self._bufs)
            else:
                self._frame, self._scratch = np.empty(piece, np.float64), np.empty(piece, np.float32)
                self.path = "allreduce"
                self.extra_bytes = self._frame.nbytes + self._scratch.nbytes

    @property
    def link(self) -> tuple[int, int]:
        """``(S, W)``: the bytes one rank contributes to the round's exchange, and the ranks of that exchange.

        What the bus bandwidth of the round is figured from (:func:`~flodl_mpi.protocol.round_profile.bus_bandwidth`,
        issue 25 item 4), planned from the path, the layout and the world, the same on every rank:
        ``allreduce`` ``8·size`` (the float64 frame) over the world; ``allgather-bf16`` and the delta wires their
        quantised values and mass slots over the world; ``shm`` / ``shm-in-place`` the float32 (bf16) segment
        over the node (a memory bandwidth); ``shm+leaders`` / ``node-mpi+leaders`` the node's mean, float32
        (bf16) plus its float64 mass, over the node leaders (``nodes``): the link between hosts.
        """
        n, W, chunks = self.layout.n, self.comm.size, len(self.layout.chunks)
        value = 2 if self.options.bf16 else 4
        if self.path == "allreduce":
            return 8 * self.layout.size, W
        if self.path == "allgather-bf16":
            return 2 * (n + 4 * chunks), W
        if self.path.endswith("-delta"):
            return {"bf16": 2, "int8": 1}[self.options.delta] * n + 8 * chunks, W
        if self.path.endswith("+leaders"):
            return value * n + 8, self.nodes
        return value * n + 4, W  # one node's shared memory

    def _exact_round(self, staging: np.ndarray, mass: float, stats: ReduceStats) -> None:
        """The exact float64 Allreduce round (the delta wire's first, before it holds a reference)."""
        _reduce(self.comm, self.layout, staging, self._frame, mass, self._scratch, stats)

    def rebase(self, staging: np.ndarray) -> None:
        """The delta wire's reference becomes ``staging`` (after the outer step, the same on every rank); no-op on
        the other paths."""
        if self.path.endswith("-delta"):
            self._delta.rebase(staging)

    @property
    def delta(self) -> DeltaReduce | None:
        """The delta wire's round (its reference and error feedback: :meth:`DeltaReduce.state`), or None on the
        other paths (the same on every rank)."""
        return self._delta if self.path.endswith("-delta") else None

    @property
    def node_gather(self):
        """The node's shared-memory Allgather of small float64 rows on the in-place path
        (:class:`~flodl_mpi.transport.shm_gather.ShmGather`, collective over ``comm``: the same ranks), else None
        (the same on every rank)."""
        return getattr(self._impl, "gather", None) if self.staging is not None else None

    @property
    def checks_in_pass(self) -> bool:
        """The reduce's pass reads every rank's tensors and reports their sums of squares
        (:attr:`ReduceStats.pre_sums`): the in-place path. The same on every rank."""
        return self.staging is not None

    def prepare(self, staging: np.ndarray) -> float:
        """The pre-round pass: ``sum(staging ** 2)`` in float64 (not finite iff a NaN/Inf is there).

        Call it before the control gather (its finiteness rides the gather).
        On the shared-memory path the same pass also copies the staging into
        this rank's segment (the snapshot), so :meth:`reduce` given ``masses``
        skips its pack; elsewhere (the in-place path too) it is a read-only pass
        (:func:`~flodl_mpi.protocol.wire.sum_squares_pieces`). Collective over the node
        on the packing shared-memory path: every rank calls it before each reduce.
        """
        with np.errstate(invalid="ignore", over="ignore"):
            if self._impl is not None and hasattr(self._impl, "prepare"):
                return self._impl.prepare(staging)
            return sum_squares_pieces(staging, self.layout)

    def reduce(self, staging: np.ndarray, mass: float, masses=None, *, pre_sums: bool = False) -> ReduceStats:
        """``Σ m_r·T_r / Σ m_r`` into ``staging`` (float32 ``(layout.n,)``); see :func:`sumcount_reduce`.

        Args:
            staging: this rank's tensors; the consensus on return when realized,
                untouched when not (every contribution idle).
            mass: this rank's mass ``m_r`` (>= 0; 0 sends true zeros).
            masses: every rank's mass (index = rank; ``masses[rank] == mass``),
                after :meth:`prepare` this round, gathered by a collective over
                ``comm`` that every rank entered after its :meth:`prepare` (the
                control gather; it orders the segments' writes before the sum):
                the shared-memory path then scales the segments :meth:`prepare`
                filled instead of packing again. None: pack from ``staging`` now.
            pre_sums: fill :attr:`ReduceStats.pre_sums` (only where
                :attr:`checks_in_pass`; ignored elsewhere).

        Returns:
            :class:`ReduceStats`; on every path a non-finite reduced piece stops
            the unpack on every rank alike (``post_finite`` False).
        """
        stats = ReduceStats()
        with np.errstate(invalid="ignore", over="ignore"):
            if self.staging is not None:
                self._impl.reduce(staging, mass, stats, masses, pre_sums)
            elif masses is not None and getattr(self._impl, "_prepared", False):
                self._impl.reduce_prepared(staging, masses, stats)
            elif self._impl is not None:
                self._impl.reduce(staging, mass, stats)
            elif self.path == "allgather-bf16":
                _reduce_bf16_allgather(self.comm, self.layout, staging, mass, self._bufs, stats)
            elif self.path.endswith("-delta"):
                self._delta.reduce(staging, mass, stats, _unpack)
            else:
                _reduce(self.comm, self.layout, staging, self._frame, mass, self._scratch, stats)
        return stats

    def free(self) -> None:
        """Free the reducer's window and communicators (collective)."""
        if self._impl is not None:
            self._impl.free()
            self._impl = None
