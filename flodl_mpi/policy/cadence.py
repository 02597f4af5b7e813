"""When averaging fires: per-rank window quotas and the data each rank reads (SPEC §4).

Invariant: every rank computes the same plan from the same inputs, without
communication, and the windows of an epoch hand out every global batch exactly
once — however uneven the quotas.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Window", "fixed_quotas", "fit_quotas", "plan_window"]


def fixed_quotas(world_size: int, window: int) -> list[int]:
    """Quotas of the fixed-window policy: every rank runs ``window`` batches.

    ``window == 1`` is the ``sync`` policy (a round after every batch).

    Raises:
        ValueError: ``world_size < 1`` or ``window < 1``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size!r}")
    if window < 1:
        raise ValueError(f"window must be >= 1 batch, got {window!r}")
    return [int(window)] * int(world_size)


def fit_quotas(quotas: Sequence[int], batches_left: int) -> list[int]:
    """Scale quotas down so their sum never exceeds the batches left in the epoch.

    Args:
        quotas: batches per rank, each >= 1, index = rank.
        batches_left: global batches not yet handed out this epoch, >= 0.

    Returns:
        Per-rank counts. Unchanged when ``sum(quotas) <= batches_left``.
        Otherwise proportional to the quotas by the largest-remainder method,
        summing to exactly ``batches_left``, each rank at least 1 (SPEC §4) —
        except when fewer batches than ranks are left: then the ranks with the
        largest quotas (lowest rank first on ties) get one batch each and the
        rest sit the window out with 0 (they still join the round, idle).

    Raises:
        ValueError: a quota < 1 or ``batches_left < 0``.
    """
    q = [int(v) for v in quotas]
    if not q or min(q) < 1:
        raise ValueError(f"quotas must be a non-empty list of counts >= 1, got {list(quotas)!r}")
    if batches_left < 0:
        raise ValueError(f"batches_left must be >= 0, got {batches_left!r}")
    total = sum(q)
    if total <= batches_left:
        return q
    by_size = sorted(range(len(q)), key=lambda r: (-q[r], r))
    if batches_left < len(q):
        counts = [0] * len(q)
        for r in by_size[:batches_left]:
            counts[r] = 1
        return counts
    ideal = [v * batches_left / total for v in q]
    counts = [max(1, math.floor(x)) for x in ideal]
    # The floor of 1 can overshoot; take back from the largest counts first.
    while sum(counts) > batches_left:
        r = max(range(len(q)), key=lambda i: (counts[i], -i))
        counts[r] -= 1
    # Hand the remainder to the largest fractional parts (ties: lowest rank).
    spare = batches_left - sum(counts)
    order = sorted(range(len(q)), key=lambda r: (-(ideal[r] - math.floor(ideal[r])), r))
    for r in order[:spare]:
        counts[r] += 1
    return counts


@dataclass(frozen=True)
class Window:
    """One window's data plan: rank r runs global batches ``starts[r] .. starts[r] + counts[r] - 1``."""

    starts: tuple[int, ...]
    counts: tuple[int, ...]

    @property
    def end(self) -> int:
        """The epoch's batch cursor after this window."""
        return self.starts[-1] + self.counts[-1]


def plan_window(quotas: Sequence[int], cursor: int, n_batches: int) -> Window:
    """Plan the next window of an epoch of ``n_batches`` global batches.

    Rank r reads its ``counts[r]`` batches at an offset fixed by the counts of
    the ranks before it, so the data each rank reads needs no communication
    (SPEC §4).

    Args:
        quotas: per-rank batches wanted, each >= 1.
        cursor: global batches already handed out this epoch, ``0 <= cursor < n_batches``.
        n_batches: global batches in the epoch.

    Raises:
        ValueError: cursor out of range, or a bad quota.
    """
    if not 0 <= cursor < n_batches:
        raise ValueError(f"cursor must be in [0, {n_batches}), got {cursor!r}")
    counts = fit_quotas(quotas, n_batches - cursor)
    starts, at = [], cursor
    for c in counts:
        starts.append(at)
        at += c
    return Window(tuple(starts), tuple(counts))
