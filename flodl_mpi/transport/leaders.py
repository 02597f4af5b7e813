"""The node leaders' exchange of a hierarchical round: an Allgather of float32 node means and float64 masses.

Concept (issue 25 item 4): each leader sends its node's mean, rounded to
float32 once (bfloat16 with ``--bf16-wire``), not its float64 sum, and the
node's float64 mass; every leader then combines them in float64 in node order
(:mod:`flodl_mpi.protocol.node_means`). Half the bytes of the float64 sums
(quarter with bf16), and still: values every rank holds alike come back bit
for bit (issue 26 item 5), and every leader holds the same bits.

Bytes per leader and piece of ``k`` values, ``K`` nodes: it sends ``4k`` and
receives ``(K − 1)·4k``. At ``K = 2`` that is the Allreduce bandwidth bound
``2(K − 1)/K · 4k`` exactly; beyond, the Allgather receives ``K/2`` times the
bound (a ring reduce-scatter plus allgather keeping the node-order float64
accumulation per chunk would stay at the bound; not built: the clusters this
targets have few nodes per job, and the Allgather keeps the combine in one
place, the same order on every leader).
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from flodl_mpi.protocol.node_means import combine_means, node_mean, total_mass
from flodl_mpi.protocol.wire import from_bf16, to_bf16

__all__ = ["LeaderMeans"]


class LeaderMeans:
    """The leaders' exchange of one plane, planned once (buffers of one piece).

    Args:
        leaders: the node leaders' communicator (rank order = node order, the
            same on every leader); not freed here.
        piece: most tensor elements in one :meth:`exchange`, >= 1.
        bf16: the means travel as bfloat16 (SPEC §7: rounded from the float32
            mean; the combine and the divide stay float64).

    Collective contract: :meth:`masses` and :meth:`exchange` are collective over
    ``leaders``: every leader calls them, the same number of times, with pieces
    of the same length (the layout's, planned from the model's structure). If a
    leader fails inside, the others wait in the Allgather: the watchdog ends
    the job, as for any collective.
    """

    def __init__(self, leaders: MPI.Comm, piece: int, *, bf16: bool = False) -> None:
        if int(piece) < 1:
            raise ValueError(f"piece must be >= 1, got {piece!r}")
        self.leaders, self.bf16 = leaders, bf16
        K, piece = leaders.size, int(piece)
        self.K = K
        self._mean = np.empty(piece, dtype=np.float32)
        if bf16:
            self._send16 = np.empty(piece, dtype=np.uint16)
            self._recv16 = np.empty(K * piece, dtype=np.uint16)
            self._wide = np.empty((K, piece), dtype=np.float32)
        else:
            self._recv = np.empty(K * piece, dtype=np.float32)
        self._tmp = np.empty(piece, dtype=np.float64)
        self._masses: list[float] = []
        #: bytes per value on the link: 4 (float32), 2 (bf16)
        self.value_bytes = 2 if bf16 else 4

    @property
    def extra_bytes(self) -> int:
        """Memory of the buffers, bytes."""
        bufs = [self._mean, self._tmp] + ([self._send16, self._recv16, self._wide] if self.bf16 else [self._recv])
        return sum(b.nbytes for b in bufs)

    def masses(self, mass: float) -> tuple[list[float], float]:
        """Allgather the node masses; return them in node order and their float64 sum (the round's divisor).

        Args:
            mass: this node's float64 mass ``M_k`` (its sum's mass slot).

        Returns:
            ``(masses, total)``, the same on every leader; kept for :meth:`exchange`.
        """
        got = np.empty(self.K, dtype=np.float64)
        self.leaders.Allgather([np.array([float(mass)], dtype=np.float64), MPI.DOUBLE], [got, MPI.DOUBLE])
        self._masses = got.tolist()
        return self._masses, total_mass(self._masses)

    def exchange(self, summed: np.ndarray, mass: float) -> int:
        """``summed`` (this node's float64 partial sums of one piece, ``(k,)``) becomes ``Σ_k M_k·μ_k``.

        The node's mean is rounded to float32 (then bf16) from ``summed``, the
        means are Allgathered, and the piece is overwritten with their
        float64 combine in node order (the caller divides by the total of
        :meth:`masses`, which must have been called this round).

        Returns:
            bytes this leader sent (``value_bytes · k``).
        """
        k, K = summed.shape[0], self.K
        mean = node_mean(summed, mass, self._mean)
        if self.bf16:
            send = to_bf16(mean, self._send16[:k])
            recv = self._recv16[: K * k]
            self.leaders.Allgather([send, MPI.UINT16_T], [recv, MPI.UINT16_T])
            parts = [from_bf16(recv[j * k : (j + 1) * k], self._wide[j, :k]) for j in range(K)]
        else:
            recv = self._recv[: K * k]
            self.leaders.Allgather([mean, MPI.FLOAT], [recv, MPI.FLOAT])
            parts = [recv[j * k : (j + 1) * k] for j in range(K)]
        combine_means(parts, self._masses, summed, self._tmp)
        return self.value_bytes * k
