"""The node reduce in place: each rank's staging is its segment of one shared mapping (issue 9, the memory floor).

Concept: on one node, with float32 frames, the ranks need not copy their
tensors anywhere. The staging (where bound parameters live, see
``replica.Replica.bind``) *is* this rank's segment of a file in ``/dev/shm``
that every rank of the node maps. A round is then one pass per rank over its
slice ``k`` of the frame (:func:`flodl_mpi.transport.node_reduce.slices`), block by
cache-sized block (the several operations per block run from cache, not from
memory; :mod:`flodl_mpi.transport.slice_kernel`: one compiled numba call per slice of a
large model, else the numpy pass):

1. ``c = (Σ_r W·m_r·θ_r) / Σ_r W·m_r``: the segments scaled by their masses
   and added in rank order in float64, then the one divide, rounded to float32
   once (SPEC §2 step 4; the same operations, in the same order, as the packing
   shared-memory reduce, :class:`flodl_mpi.transport.node_reduce.ShmReduce`; float64 so
   that values every rank holds alike come back unchanged, issue 26 item 5). A rank of mass 0 (idle,
   quarantined) is skipped: true zeros, whatever its segment holds (SPEC §1);
2. each rank's ``‖θ_r − c‖²`` and ``‖c‖²`` of the block (float64 sums of the
   cached block: SPEC §3's sums);
3. ``c`` written into every rank's segment: the unpack of all ranks at once.

Then one small Allgather of the slices' partial sums (``2W + 2`` float64 per
rank, through the shared file), added in rank order on every rank: the same bits everywhere. Per rank
that is one read and one write of the model's bytes (W slices of 1/W each),
instead of the pack's, the sum's and the unpack's three of each. Before the
control gather, :meth:`InPlaceShmReduce.prepare` reads the rank's own segment
once more (the NaN/Inf check and the pre-round norm), so that quarantine is
decided from gathered values before any segment is overwritten; under
``--on-non-finite stop`` (no quarantine) that read is skipped and the pass
also sums every rank's pre-round block (``pre_sums``), whose gathered sums
name a non-finite rank (:class:`flodl_mpi.transport.bridge.Bridge`). (Measured and
not kept: the consensus into a private scratch of ``P/W`` floats first, the
check riding the partial sums, then a copy into every segment: no pre-pass,
but a write and a read of the scratch, about 1.7x the CPU time of pre-pass
plus pass at 16M params, W = 2; ``benchmarks/README.md``.)

Phases in :class:`~flodl_mpi.transport.reduce.ReduceStats`: ``unpack_ms`` is the pass
(sum, divide, divergence sums, writes), ``allreduce_ms`` the masses and the
partial sums' ``Allgather`` (waiting for the slowest rank's pass included).

Invariants:
  * every element of the consensus is computed by exactly one rank and copied
    to all, so every rank holds the same bits;
  * a rank touches another rank's segment only between the collective that
    brought the masses (the control gather, entered by every rank after its
    tensors were final) and the partial sums' ``Allgather`` (entered by every
    rank after its last write): nobody else's training thread runs on a
    segment while it is read or written (bound parameters are only sound with
    a blocking policy, see ``Replica.bind``);
  * a block whose consensus is not finite is never written: the slice stops
    there, and the gathered flag tells every rank alike (``post_finite``).

Why not ``MPI.Win.Allocate_shared``: the bound parameters live in this memory
and the model must stay usable after the bridge closes, but ``Win.Free``
unmaps it. A mapping of an unlinked file lives as long as any array views it.
The file is unlinked as soon as every rank of the node mapped it, so a killed
job leaves nothing behind in ``/dev/shm``.

The two synchronizations (the bridge's control gather and the partial sums'
gather) go through a small area after the segments in the same file
(:class:`~flodl_mpi.transport.shm_gather.ShmGather`: each rank writes its row and
publishes a sequence number; a waiting rank yields its core, then naps), not
through MPI: with more ranks than cores the ranks still working get the cores.

Memory ordering: the segments are plain shared memory. On x86-64 a rank's
stores (its tensors, its row) are seen by the others in program order before
its published sequence number, and their loads after it (TSO); elsewhere the
exchanges are MPI collectives, whose own atomics are full fences, as the
shared-memory transport of MPI itself relies on.
"""

from __future__ import annotations

import mmap
import os
import secrets
import time

import numpy as np
from mpi4py import MPI

from flodl_mpi.transport.node_reduce import slices
from flodl_mpi.protocol.realized_work import is_realized
from flodl_mpi.transport.shm_gather import STORES_ORDERED, ShmGather
from flodl_mpi.transport.slice_kernel import KERNELS, STEPS, compiled_available, consensus_slice, default_kernel, warm_up
from flodl_mpi.protocol.wire import WireLayout, sum_squares_pieces

__all__ = ["GATHER_CAPACITY", "SHM_DIR", "InPlaceShmReduce"]

#: Where the shared file lives (tmpfs: the mapping is memory, never disk).
SHM_DIR = "/dev/shm"
_PAGE = mmap.ALLOCATIONGRANULARITY
#: float64 values per rank in one exchange of :attr:`InPlaceShmReduce.gather` (at least ``2W + 2``: the
#: partial sums): room for the bridge's control rows.
GATHER_CAPACITY = 256


class InPlaceShmReduce:
    """Sum-and-count reduce in place among the ranks of one node (``--node-reduce shm``, float32, one node).

    Args:
        comm: the bridge's communicator (W ranks, all on this node).
        layout: the frame plan, the same on every rank.
        node: ``comm``'s ranks sharing memory, the same ranks as ``comm`` (one
            node). The reduce frees it.

    Attributes:
        staging: float32 ``(layout.n,)``, this rank's segment: the caller's
            tensors live here and the consensus lands here.
        extra_bytes: memory beyond the staging (two float64 blocks of scratch
            and the segment's padding to a page).
        kernel: the slice pass in use (:meth:`use_kernel`): ``"numba"`` for a
            slice of at least :data:`~flodl_mpi.transport.slice_kernel.COMPILED_MIN_ELEMENTS`
            where numba is installed, else ``"numpy"`` (the same bits).

    Raises:
        OSError: identically on every rank of ``node``: the shared file could
            not be made or mapped on some rank (``/dev/shm`` full, no
            ``/dev/shm``); the message names the ranks and the cause.

    Collective contract: construction, :meth:`reduce` and :meth:`free` are
    collective over ``comm``: every rank calls, in the same order.
    :meth:`prepare` is local (a read of this rank's own segment).
    """

    def __init__(self, comm: MPI.Comm, layout: WireLayout, node: MPI.Comm) -> None:
        if node.size != comm.size:
            raise ValueError(f"the in-place reduce needs the whole world on one node ({node.size} of {comm.size})")
        self.comm, self.layout, self.node = comm, layout, node
        self.world_size = comm.size
        n, W, me = layout.n, node.size, node.rank
        seg = max(_PAGE, -(-4 * n // _PAGE) * _PAGE)
        capacity = max(GATHER_CAPACITY, 2 * W + 2)
        area = -(-ShmGather.nbytes(W, capacity) // _PAGE) * _PAGE
        self._all, own = _map_shared(node, seg, area)
        #: every rank's segment, row r = node rank r, C-contiguous rows of ``seg / 4`` elements
        self.rows = np.frombuffer(self._all, dtype=np.float32, count=W * seg // 4).reshape(W, seg // 4)
        self.staging = np.frombuffer(own, dtype=np.float32, count=n)
        #: the world ranks of this node, in node order (their masses scale the segments)
        self.members = node.allgather(comm.rank)
        self.me = me
        self.slice = slices(n, W)[me]
        self._seg_pad = seg - 4 * n
        self.use_kernel(default_kernel(self.slice[1] - self.slice[0]))
        self._partial = np.zeros(2 * W + 2, dtype=np.float64)
        self._gathered = np.zeros((W, 2 * W + 2), dtype=np.float64)
        #: the node's Allgather through the shared file (:class:`~flodl_mpi.transport.shm_gather.ShmGather`; the
        #: bridge's control gather uses it too), or None: MPI's (a processor without ordered stores).
        #: The same on every rank; set it to None on every rank alike (between rounds) for MPI's.
        self.gather = ShmGather(memoryview(self._all)[W * seg :], W, me, capacity) if STORES_ORDERED else None
        if self.members != list(range(W)):  # node rank = comm rank: the gathered rows are the comm's
            raise ValueError(f"the in-place reduce needs node ranks in comm order, got {self.members}")

    def use_kernel(self, kernel: str) -> None:
        """Run the slice pass with ``kernel`` (:data:`~flodl_mpi.transport.slice_kernel.KERNELS`; local, any time
        between rounds; the default: :func:`~flodl_mpi.transport.slice_kernel.default_kernel` for this slice). The consensus
        bits are the same for each."""
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
        if kernel == "numba":
            if not compiled_available():
                raise ValueError("kernel 'numba' needs numba installed (pip install numba)")
            warm_up()  # compiled (or loaded from numba's cache) here, not in the first round
        #: the slice pass in use, ``"numba"`` or ``"numpy"``
        self.kernel = kernel
        # Blocks of the kernel's size, smaller for a small slice (at least four blocks per
        # slice, so the scratch stays well under the model's size: 0.25x at 100k params).
        a, b = self.slice
        n = self.layout.n
        self.step = max(1, min(self.layout.chunk_elems, STEPS[kernel], n, max(1024, -(-(b - a) // 4))))
        self._scratch = np.empty(2 * self.step, dtype=np.float64)  # a block's float64 sum, then its consensus
        self.extra_bytes = self._scratch.nbytes + self._seg_pad

    def free(self) -> None:
        """Unmap the other ranks' segments and free the node communicator (collective over ``comm``).

        This rank's own segment stays mapped as long as :attr:`staging` (or a
        view of it: bound parameters) is referenced.
        """
        self.rows = self.gather = None
        try:
            self._all.close()
        except BufferError:  # a view of it is still referenced somewhere: unmapped when that goes
            pass
        self._all = None
        self.node.Free()

    def prepare(self, staging: np.ndarray) -> float:
        """``sum(staging ** 2)`` in float64, read only: not finite iff a NaN or infinity is there.

        The pre-round check (:func:`~flodl_mpi.protocol.wire.sum_squares_pieces`): its
        finiteness rides the control gather, so a non-finite rank gets mass 0
        before any rank's segment is overwritten.
        """
        self._check(staging)
        return sum_squares_pieces(staging, self.layout)

    def reduce(self, staging: np.ndarray, mass: float, stats, masses=None, pre_sums: bool = False) -> None:
        """Fill ``stats`` (a ``reduce.ReduceStats``); the consensus lands in :attr:`staging` when realized.

        Args:
            staging: :attr:`staging` itself (any other array is refused).
            mass: this rank's mass ``m_r``.
            masses: every world rank's mass, from a collective over ``comm``
                that every rank entered with its tensors final (the control
                gather); None gathers them here (one small ``allgather``).
            pre_sums: also sum every rank's pre-round values in the pass and
                fill ``stats.pre_sums`` (the check of ``--on-non-finite stop``).
        """
        self._check(staging)
        clock = time.perf_counter
        t0 = clock()
        if masses is None:
            masses = (self.comm.allgather(float(mass)) if self.gather is None
                      else self.gather.allgather([float(mass)])[:, 0].tolist())
        W = self.world_size
        scales = np.array([float(W) * float(masses[r]) for r in self.members], dtype=np.float64)
        total = 0.0
        for s in scales.tolist():  # float64, rank order: the mass slot of the packing reduce
            total += s
        stats.total_mass = total
        stats.realized = is_realized(stats.total_mass)
        stats.bytes += 4 * self.layout.n + 4
        if not stats.realized:  # decided from the gathered masses: every rank returns here
            stats.allreduce_ms += 1e3 * (clock() - t0)
            return
        partial = self._partial
        partial[:] = 0.0
        a, b = self.slice
        t_pass = clock()
        consensus_slice(self.rows, scales, total, a, b, self.step, self._scratch,
                        partial, self.kernel, pre_sums)
        t1 = clock()
        if self.gather is None:
            self.node.Allgather([partial, MPI.DOUBLE], [self._gathered, MPI.DOUBLE])
        else:
            self._gathered[:] = self.gather.allgather(partial)
        sums = np.zeros(2 * W + 2, dtype=np.float64)
        for row in self._gathered:  # rank order on every rank: the same bits everywhere
            sums += row
        stats.diff_sq += float(sums[self.me])
        stats.post_sq += float(sums[W])
        stats.post_finite = bool(sums[W + 1] == 0.0)
        if pre_sums:
            stats.pre_sums = sums[W + 2 :].copy()
        t2 = clock()
        stats.allreduce_ms += 1e3 * (t_pass - t0 + t2 - t1)
        stats.unpack_ms += 1e3 * (t1 - t_pass)

    def _check(self, staging: np.ndarray) -> None:
        if staging is not self.staging and (staging.size != self.layout.n or not np.shares_memory(staging,
                                                                                                   self.staging)):
            raise ValueError("the in-place reduce works on its own staging (InPlaceShmReduce.staging), not a copy")


def _map_shared(node: MPI.Comm, seg: int, area: int = 0) -> tuple[mmap.mmap, mmap.mmap]:
    """Map one new file of ``node.size * seg + area`` bytes in :data:`SHM_DIR` on every rank of ``node``.

    Node rank 0 makes the file (zeros), and reserves the ``area`` after the
    segments (the shared gather's); every rank reserves its own segment's pages
    (``posix_fallocate``: a full ``/dev/shm`` fails here with ENOSPC, not
    later with SIGBUS at a first touch, and the pages are placed near the rank
    that uses them), maps the whole file and, a second time, its own segment;
    then rank 0 unlinks the file. Collective over ``node``; any rank's failure
    raises on every rank.

    Returns:
        ``(whole, own)``: the whole file, and this rank's segment.
    """
    total = node.size * seg + area
    path, err = None, None
    if node.rank == 0:
        path = os.path.join(SHM_DIR, f"flodl_mpi_{os.getpid()}_{secrets.token_hex(8)}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, total)
            finally:
                os.close(fd)
        except OSError as exc:
            err = f"{type(exc).__name__}: {exc}"
    path, err = node.bcast((path, err), root=0)
    whole = own = None
    if err is None:
        try:
            fd = os.open(path, os.O_RDWR)
            try:
                os.posix_fallocate(fd, node.rank * seg, seg)
                if node.rank == 0 and area:
                    os.posix_fallocate(fd, node.size * seg, area)
                whole = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                own = mmap.mmap(fd, seg, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=node.rank * seg)
            finally:
                os.close(fd)
        except OSError as exc:
            err = f"{type(exc).__name__}: {exc}"
    errors = node.allgather(err)
    if node.rank == 0 and path is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    bad = [(r, e) for r, e in enumerate(errors) if e is not None]
    if bad:
        for m in (whole, own):
            if m is not None:
                m.close()
        raise OSError(f"shared memory for the in-place node reduce ({total / 2**20:.0f} MiB in {SHM_DIR}) failed on "
                      "node rank(s) " + "; ".join(f"{r}: {e}" for r, e in bad))
    return whole, own
