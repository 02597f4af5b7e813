"""The epoch's untrained batches re-split after a membership change, each still trained once (SPEC §9).

Invariant: an epoch's batch plan (`flodl_mpi.training.data.num_batches`) is a queue of
global batch ids; windows hand out its positions from a cursor (`flodl_mpi.policy.cadence.
plan_window`: rank r takes ``counts[r]`` positions at an offset fixed by the ranks before
it). When ranks leave, the batches whose steps no consensus will hold (the leavers'
since their last adopted consensus, and the survivors' too if they go back to it) go
to the front of a new queue, followed by every batch not handed out yet; the survivors
plan their windows over it with the re-planned quotas. So every batch, and every sample
(each is in exactly one batch), is trained exactly once per epoch in the consensus.
Every rank computes the same queue from the agreed failed set alone. Pure: numpy, no
MPI, no threads.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from flodl_mpi.policy.cadence import Window, plan_window

__all__ = ["BatchQueue", "lost_positions"]


@dataclass(frozen=True)
class BatchQueue:
    """The global batches of an epoch in the order windows hand them out.

    Attributes:
        batches: int64 ``(k,)``, distinct global batch ids of the epoch's plan
            (``0 <= id < num_batches``); position ``p`` is handed out ``p``-th.

    Raises:
        ValueError: ``batches`` not 1-D, negative ids, or an id twice.
    """

    batches: np.ndarray

    def __post_init__(self) -> None:
        b = np.asarray(self.batches)
        if b.ndim != 1 or (b.size and b.dtype.kind not in "iu"):
            raise ValueError(f"batches must be a 1-D array of batch ids, got {b.dtype} {b.shape}")
        b = b.astype(np.int64)
        if b.size and b.min() < 0:
            raise ValueError(f"batch ids must be >= 0, got {int(b.min())}")
        if len(np.unique(b)) != len(b):
            raise ValueError("batch ids must be distinct: a batch twice would be trained twice")
        b.setflags(write=False)
        object.__setattr__(self, "batches", b)

    @classmethod
    def whole(cls, n_batches: int) -> BatchQueue:
        """The epoch's plan as launched: batches ``0 .. n_batches - 1`` in order."""
        if n_batches < 0:
            raise ValueError(f"n_batches must be >= 0, got {n_batches!r}")
        return cls(np.arange(n_batches, dtype=np.int64))

    def __len__(self) -> int:
        return int(self.batches.shape[0])

    @property
    def is_whole(self) -> bool:
        """Whether this is the launch plan's queue (``0 .. len - 1`` in order): no change re-split it."""
        return bool(np.array_equal(self.batches, np.arange(len(self))))

    def state_dict(self) -> dict:
        """JSON-able: ``{"batches": [...]}``. A checkpoint mid-epoch after a change keeps it, since
        its cursor is then a position in this queue, not a global batch number."""
        return {"batches": self.batches.tolist()}

    @classmethod
    def from_state_dict(cls, state: dict, n_batches: int) -> BatchQueue:
        """The queue of :meth:`state_dict`, checked against this run's ``n_batches`` an epoch.

        Raises:
            ValueError: an id at or above ``n_batches`` (a queue of another data or batch
                size), or as the constructor.
        """
        queue = cls(np.asarray(state["batches"], dtype=np.int64))
        if len(queue) and int(queue.batches.max()) >= n_batches:
            raise ValueError(
                f"the epoch's queue holds batch {int(queue.batches.max())}, this run's epoch has "
                f"{n_batches} batches: it was saved for another data size or --batch-size"
            )
        return queue

    def window(self, quotas: Sequence[int], cursor: int) -> tuple[Window, tuple[np.ndarray, ...]]:
        """The next window from position ``cursor``: its positions (`plan_window`) and each rank's batch ids.

        Rank r trains ``ids[r]`` (int64, ``counts[r]`` of them) in order; the cursor moves to
        ``window.end``.

        Raises:
            ValueError: as `plan_window` (cursor out of range, a bad quota).
        """
        window = plan_window(quotas, cursor, len(self))
        return window, tuple(self.batches[s : s + c] for s, c in zip(window.starts, window.counts))

    def after_change(self, cursor: int, lost: Iterable[int]) -> BatchQueue:
        """The queue the new world goes on with: the ``lost`` positions' batches, then those not handed out.

        Args:
            cursor: positions handed out so far (``0 <= cursor <= len``): every position
                before it was trained by some rank.
            lost: positions before ``cursor`` whose steps no consensus holds (their ranks
                left, or the survivors went back to a consensus before them);
                `lost_positions` computes them from the windows since that consensus.

        Returns:
            A queue of ``len(lost) + len - cursor`` batches: the lost ones in the order they
            were handed out, then ``batches[cursor:]``. The new world's cursor is 0.

        Raises:
            ValueError: a lost position at or after ``cursor`` (not handed out, nothing to
                lose), negative, or named twice; ``cursor`` out of range.
        """
        if not 0 <= cursor <= len(self):
            raise ValueError(f"cursor must be in [0, {len(self)}], got {cursor!r}")
        pos = sorted(int(p) for p in lost)
        if len(set(pos)) != len(pos):
            raise ValueError(f"lost positions named twice: {sorted({p for p in pos if pos.count(p) > 1})}")
        if pos and not (0 <= pos[0] and pos[-1] < cursor):
            raise ValueError(
                f"lost positions must be handed out already (0 <= position < cursor {cursor}), got "
                f"{[p for p in pos if not 0 <= p < cursor]}"
            )
        return BatchQueue(np.concatenate([self.batches[pos], self.batches[cursor:]]).astype(np.int64))


def lost_positions(windows: Sequence[Window], lost_ranks: Iterable[int]) -> list[int]:
    """The queue positions that ``lost_ranks`` trained in ``windows``, ascending.

    Args:
        windows: the windows since the last consensus every survivor holds (the one it
            goes back to, or the abandoned round's snapshot): one under a blocking
            policy, two under ``async`` (the round in flight covers the one before).
        lost_ranks: the ranks (before the shrink) whose steps in those windows no
            consensus will hold: the failed ones, and every survivor too when the
            survivors go back to the last consensus.

    Raises:
        ValueError: a rank not in a window's world.
    """
    ranks = sorted(set(int(r) for r in lost_ranks))
    out: list[int] = []
    for w in windows:
        bad = [r for r in ranks if not 0 <= r < len(w.counts)]
        if bad:
            raise ValueError(f"ranks {bad} are not in the window's world of {len(w.counts)} ranks")
        for r in ranks:
            out.extend(range(w.starts[r], w.starts[r] + w.counts[r]))
    return sorted(out)
