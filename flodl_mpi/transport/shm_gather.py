"""A node's small Allgather through shared memory: the in-place round's two synchronization points (issue 9).

Concept: the in-place node reduce (:mod:`flodl_mpi.transport.shm_in_place`) needs two
synchronizations per round, each with a few float64 per rank: the control
gather (every rank's tensors final, its masses and flags known to all) and the
partial sums' gather (every write done, the divergence sums known to all).
Both are Allgathers of a small row among the ranks of one node, which already
share a file. Here each rank writes its row into its slot of a shared area,
then publishes a sequence number; the exchange is complete on a rank when it
sees every rank's number. A rank that waits yields its core between looks
(``sched_yield``): with more ranks than cores (measured: 4 ranks on 2) the
ranks still working get the cores at once, where MPI's collectives poll
(MPICH: 1000 polls between yields); after :data:`SPIN_S` it naps between
looks instead (:data:`NAP_S`), so a long wait (a slow peer's window) burns no
core and leaves the GIL to a training thread that runs beside the bridge.
Nothing else changes: the rows are the same bytes, every rank reads the same
matrix.

Invariants:
  * every rank calls :meth:`ShmGather.allgather` the same number of times, in
    the same order as its other collectives (a collective, like MPI's);
  * exchange ``e`` writes the payload half ``e % 2``: a rank writes half
    ``e % 2`` again only at exchange ``e + 2``, which it enters after
    exchange ``e + 1`` completed, i.e. after every rank left exchange ``e``
    (each copies the matrix out before it returns), so no row is overwritten
    while someone still reads it;
  * rows of different lengths (ranks at different points of their program)
    raise the same error on every rank: the lengths are part of what is gathered.

Memory ordering: a rank's row, and its tensors, are stored before its
sequence number; a reader loads the sequence numbers before the rows. x86-64
keeps stores in order and loads in order (TSO), so that is enough there; other
architectures (weaker ordering) use MPI's collectives instead
(:data:`STORES_ORDERED`). Pure shared memory and the OS's yield: no MPI here.
"""

from __future__ import annotations

import os
import platform
import time

import numpy as np

__all__ = ["STORES_ORDERED", "ShmGather"]

#: The processor keeps stores, and loads, in program order (TSO): the gather's
#: publish-then-read protocol needs no fence there. Elsewhere it is not used.
STORES_ORDERED = platform.machine().lower() in ("x86_64", "amd64")

_LINE = 128  # bytes per rank's sequence slot: two cache lines (the adjacent-line prefetcher)
#: A waiting rank yields its core between looks for this long, then naps between looks (the
#: GIL free: a training thread that runs beside the bridge, ``--policy async``, is not slowed by a
#: long wait for a slow peer, and an idle rank burns no core).
SPIN_S = 2e-3
NAP_S = 50e-6


def _wait(seq: np.ndarray, e: int, spin_s: float) -> None:
    """Until every rank published exchange ``e`` (``seq.min() >= e``): yields for ``spin_s`` seconds, then naps."""
    if seq.min() >= e:
        return
    clock = time.perf_counter
    spin_until = clock() + spin_s
    while seq.min() < e:
        if clock() < spin_until:
            os.sched_yield()  # the ranks still working get this core
        else:
            time.sleep(NAP_S)


class ShmGather:
    """Allgather of one float64 row of at most ``capacity`` values per rank, among ``size`` ranks.

    Args:
        area: a writable uint8 buffer of at least :meth:`nbytes` bytes, zeroed
            before first use, the same memory on every rank (a shared mapping).
        size: ranks sharing the area (W).
        rank: this rank, ``0 <= rank < size``.
        capacity: most float64 values in one row.

    Collective contract: every rank calls :meth:`allgather` the same number of
    times; a rank that does not leaves the others waiting (the watchdog of
    :mod:`flodl_mpi.runtime.world` then ends the job, as for an MPI collective).
    """

    def __init__(self, area, size: int, rank: int, capacity: int) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} not in [0, {size})")
        self.size, self.rank, self.capacity = int(size), int(rank), int(capacity)
        buf = np.frombuffer(area, dtype=np.uint8, count=self.nbytes(size, capacity))
        head = size * _LINE
        slots = buf[:head].view(np.int64).reshape(size, _LINE // 8)
        #: per rank: [0] the last exchange it published (the rest of its two lines unused)
        self._seq = slots[:, 0]
        self._slot = slots[rank]
        #: the two payload halves, (2, W, 1 + capacity) float64: per rank its row's length, then the row
        self._rows = buf[head:].view(np.float64).reshape(2, size, 1 + capacity)
        self._count = int(self._slot[0])  # exchanges done so far (0 in a new area)
        #: seconds a wait yields between looks before it naps (:data:`SPIN_S`)
        self.spin_s = SPIN_S

    @staticmethod
    def nbytes(size: int, capacity: int) -> int:
        """Bytes of the shared area for ``size`` ranks and rows of ``capacity`` float64."""
        return size * _LINE + 2 * size * (1 + capacity) * 8

    def allgather(self, row: np.ndarray) -> np.ndarray:
        """Every rank's ``row``: float64 ``(W, k)``, row r rank r's; the same matrix on every rank.

        Args:
            row: float64-convertible ``(k,)``, ``k <= capacity``; ``k`` the
                same on every rank.

        Raises:
            ValueError: ``k > capacity`` (on this rank, before publishing), or
                the ranks sent rows of different lengths (on every rank alike,
                after the exchange).
        """
        row = np.asarray(row, dtype=np.float64).ravel()
        k = row.size
        if k > self.capacity:
            raise ValueError(f"a row of {k} values does not fit the shared gather's {self.capacity}")
        e = self._count + 1
        half = self._rows[e % 2]
        half[self.rank, 0] = k
        half[self.rank, 1 : 1 + k] = row
        self._slot[0] = e  # publish: the row's stores (and the tensors') are before this one
        _wait(self._seq, e, self.spin_s)
        self._count = e
        lengths = half[:, 0].copy()
        out = half[:, 1 : 1 + k].copy()  # before anyone can reuse this half (exchange e + 2)
        if (lengths != k).any():
            raise ValueError("the ranks' rows in a shared gather differ in length (" +
                             ", ".join(f"rank {r}: {int(n)}" for r, n in enumerate(lengths)) +
                             "): the ranks are at different points of the program")
        return out
