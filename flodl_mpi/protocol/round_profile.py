"""Where a run's averaging time went, per rank: the end-of-run profile (issue 9).

Invariant: the profile is a sum of the per-round figures of ``metrics.h5``'s
``rounds`` table (one per rank and round, carried by the acks), so the line a
run logs at its end and the one :func:`RunProfile.from_rounds` rebuilds from
the file are the same numbers. Pure arithmetic: no MPI, no threads.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

__all__ = ["PHASES", "RunProfile", "bus_bandwidth"]


def bus_bandwidth(nbytes: float, ms: float, ranks: int) -> float:
    """The bus bandwidth of one reduce, GB/s (1e9 bytes per second): ``algbw · 2(W − 1)/W``, ``algbw = S / t``.

    The definition of nccl-tests for an Allreduce (NVIDIA/nccl-tests, doc/PERFORMANCE.md: "algbw = S / t",
    "busbw = algbw * 2*(n-1)/n"): ``S`` the bytes one rank contributes (``nbytes``), ``t`` the reduce's
    wall time (``ms``), ``n`` the ranks of the exchange (``ranks``). It is the rate a link must carry for
    a bandwidth-optimal Allreduce of ``S`` to take ``t``, so ``busbw / link rate`` is the bound
    ``2(W − 1)/W · S / rate`` over the time taken: 1.0 at the bound, whatever the algorithm.

    Returns:
        NaN where nothing moved or no time was measured (``nbytes <= 0``, ``ranks < 2``, ``ms`` not
        positive and finite).
    """
    if not (nbytes > 0 and ranks >= 2 and ms > 0 and np.isfinite(ms)):
        return float("nan")
    return float(nbytes) / (float(ms) / 1e3) / 1e9 * (2.0 * (ranks - 1) / ranks)

#: The phases of a round, in order, as ``rounds`` columns (``<phase>_ms``). ``other``
#: is the rest of the bridge's round (``bridge_ms`` less the named phases: the
#: divergence, the version, the record); ``handoff`` is the training thread's wait
#: beyond the bridge's round (``wait_ms - bridge_ms``: queue hand-off, thread wake-up;
#: 0 where compute hid the round, as with ``--policy async``).
PHASES = ("control", "pack", "allreduce", "unpack", "outer", "other", "handoff")
_NAMED = tuple(p for p in PHASES if p not in ("other", "handoff"))  # the phases the acks carry


class RunProfile:
    """Per-rank totals of the rounds' phase times and bytes.

    Args:
        world_size: ranks, >= 1.

    Attributes:
        rounds: ``(W,)`` int64, rounds counted per rank.
        ms: phase -> ``(W,)`` float64 total milliseconds.
        bytes: ``(W,)`` float64 total bytes each rank put on the wire.

    Rows are held and summed in blocks of :data:`FOLD_ROWS` (and whenever an
    attribute is read): one vectorized sum per block, since ~20 numpy calls per
    round were a fifth of a world of one's round (issue 26 item 10). A run and
    :meth:`from_rounds` of its table fold the same blocks: the same sums, bit for bit.
    """

    #: Rows held before they are summed into the totals.
    FOLD_ROWS = 256

    def __init__(self, world_size: int) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        self.world_size = world_size
        self._rounds = np.zeros(world_size, dtype=np.int64)
        self._ms = {p: np.zeros(world_size) for p in PHASES}
        self._bytes = np.zeros(world_size)
        self._held: list[Mapping[str, np.ndarray]] = []

    @property
    def rounds(self) -> np.ndarray:
        self._fold()
        return self._rounds

    @property
    def ms(self) -> dict[str, np.ndarray]:
        self._fold()
        return self._ms

    @property
    def bytes(self) -> np.ndarray:
        self._fold()
        return self._bytes

    def add(self, row: Mapping[str, np.ndarray]) -> None:
        """Add one round: ``row`` maps ``<phase>_ms``, ``bridge_ms``, ``wait_ms`` and ``bytes`` to ``(W,)``
        (``bytes`` may be one value for every rank). The row is held until its block is summed: do not
        modify its arrays.

        ``other`` is ``bridge_ms`` less the named phases; ``handoff`` is
        ``max(wait_ms - bridge_ms, 0)``.

        A rank whose figures are NaN (no value: a resumed run's first round,
        an older file) is not counted for that round.
        """
        self._held.append(row)
        if len(self._held) >= self.FOLD_ROWS:
            self._fold()

    def _fold(self) -> None:
        """Sum the held rows into the totals: ``(k, W)`` arrays and plain where()."""
        if not self._held:
            return
        rows, self._held = self._held, []
        k, width = len(rows), self.world_size

        def column(name: str) -> np.ndarray:
            return np.broadcast_to(np.array([r[name] for r in rows], dtype=np.float64).reshape(k, -1), (k, width))

        named = np.stack([column(f"{p}_ms") for p in _NAMED])  # (4, k, W)
        round_ms = column("bridge_ms")
        ok = np.isfinite(round_ms)
        named = np.where(np.isnan(named), 0.0, named)
        for p, v in zip(_NAMED, named):
            self._ms[p] += np.where(ok, v, 0.0).sum(axis=0)
        self._ms["other"] += np.where(ok, np.maximum(round_ms - named.sum(axis=0), 0.0), 0.0).sum(axis=0)
        handoff = column("wait_ms") - round_ms
        self._ms["handoff"] += np.where(ok & np.isfinite(handoff), np.maximum(handoff, 0.0), 0.0).sum(axis=0)
        nbytes = column("bytes")
        self._bytes += np.where(ok & ~np.isnan(nbytes), nbytes, 0.0).sum(axis=0)
        self._rounds += ok.sum(axis=0)

    @classmethod
    def from_rounds(cls, table: Mapping[str, np.ndarray]) -> RunProfile:
        """The profile of a ``rounds`` table as :func:`flodl_mpi.outputs.metrics.read_table` returns it."""
        width = np.asarray(table["bridge_ms"]).shape[1]
        prof = cls(int(width))
        for i in range(len(table["bridge_ms"])):
            prof.add({k: np.asarray(v)[i] for k, v in table.items() if k == "bytes" or k.endswith("_ms")})
        return prof

    def lines(self) -> list[str]:
        """One line per rank: rounds, ms per round, each phase's ms and %, MB per round, effective GB/s.

        Effective bandwidth: the bytes the rank put on the wire over the whole
        time of its rounds, hand-off included (what the averaging delivered).
        """
        out = []
        for r in range(self.world_size):
            n = int(self.rounds[r])
            if n == 0:
                out.append(f"averaging profile, rank {r}: no round")
                continue
            total = sum(float(self.ms[p][r]) for p in PHASES)
            parts = ", ".join(f"{p} {self.ms[p][r] / n:.2f} ({100 * self.ms[p][r] / total if total else 0:.0f}%)"
                              for p in PHASES)
            mb = self.bytes[r] / n / 1e6
            gbs = self.bytes[r] / (total / 1e3) / 1e9 if total else float("nan")
            out.append(f"averaging profile, rank {r}: {n} round{'' if n == 1 else 's'}, {total / n:.2f} ms/round: {parts}; "
                       f"{mb:.2f} MB/round, {gbs:.2f} GB/s effective")
        return out
