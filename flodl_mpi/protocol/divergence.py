"""Weight-space divergence of a round and the trend guard that watches it (SPEC §3).

Invariant: ``divergence = ||pre - post|| / ||post||`` with every sum of squares
taken in float64, and ``0.0`` when ``||post|| <= 1e-10``; when every rank already
agrees the divergence is exactly 0.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Sequence

import numpy as np

__all__ = [
    "POST_NORM_FLOOR",
    "divergence_triple",
    "triple_from_sums",
    "Verdict",
    "TrendGuard",
]

#: Below this consensus norm the relative divergence is meaningless: report 0.
POST_NORM_FLOOR = 1e-10


def triple_from_sums(
    diff_sq: float, post_sq: float, pre_sq: float
) -> tuple[float, float, float]:
    """Finish the divergence triple from float64 sums of squares.

    Args:
        diff_sq: ``sum((pre - post) ** 2)`` over all parameter elements.
        post_sq: ``sum(post ** 2)``.
        pre_sq: ``sum(pre ** 2)``.

    Returns:
        ``(divergence, post_norm, pre_norm)`` — mind the order (SPEC §3).
    """
    post_norm = math.sqrt(post_sq)
    pre_norm = math.sqrt(pre_sq)
    divergence = math.sqrt(diff_sq) / post_norm if post_norm > POST_NORM_FLOOR else 0.0
    return divergence, post_norm, pre_norm


def divergence_triple(
    pre: Sequence[np.ndarray], post: Sequence[np.ndarray]
) -> tuple[float, float | None, float | None]:
    """Divergence of a rank's pre-round parameters from the adopted consensus.

    Args:
        pre: the rank's parameter tensors before the round, any float dtype.
        post: the consensus, same count and shapes as ``pre``.

    Returns:
        ``(divergence, post_norm, pre_norm)``; ``(0.0, None, None)`` for no
        parameters. Per-tensor sums of squares are taken in float64 and summed
        in float64 (SPEC §3). Example: pre ``[3, 4]``, post ``[6, 8]`` gives
        ``(0.5, 10.0, 5.0)``.

    Raises:
        ValueError: the two lists differ in length or a pair differs in shape.
    """
    if len(pre) != len(post):
        raise ValueError(f"pre has {len(pre)} tensors but post has {len(post)}")
    if not pre:
        return 0.0, None, None
    diff_sq = post_sq = pre_sq = 0.0
    for i, (a, b) in enumerate(zip(pre, post)):
        a = np.asarray(a, dtype=np.float64)
        b = np.asarray(b, dtype=np.float64)
        if a.shape != b.shape:
            raise ValueError(f"tensor {i}: pre shape {a.shape} != post shape {b.shape}")
        d = a - b
        diff_sq += float(np.vdot(d, d))
        post_sq += float(np.vdot(b, b))
        pre_sq += float(np.vdot(a, a))
    return triple_from_sums(diff_sq, post_sq, pre_sq)


class Verdict(enum.IntEnum):
    """The guard's answer; the values are the codes written to ``metrics.h5``."""

    STABLE = 0
    SUPPRESS_GROWTH = 1
    NUDGE_DOWN = 2


class TrendGuard:
    """Watches the cohort's max divergence per round (SPEC §3).

    Keeps the last ``history`` values; answers ``SUPPRESS_GROWTH`` when the last
    three are strictly rising and the latest exceeds ``threshold``, otherwise
    ``STABLE``. Two rate-based ``NUDGE_DOWN`` rules (shrink the anchor by
    ``nudge_factor``) may be added: ``nudge_above``, a latest value above a
    level; and ``nudge_rising``, a sustained rise: the whole ring (``history``
    rounds) strictly rising, the latest above ``threshold`` and at least
    ``nudge_ratio`` times the ring's first. A sustained rise outlives the three
    rounds ``SUPPRESS_GROWTH`` reads, so it keeps rising at an anchor that no
    longer grows: the window itself is too long. After a ``NUDGE_DOWN`` the ring
    restarts, so a further one needs a new sustained rise (the rounds already
    in flight ran under the old anchor). It is deterministic in the gathered
    divergences, so every rank that feeds it the same values reaches the same
    verdict.

    Args:
        threshold: divergence above which a rising trend suppresses anchor
            growth; default 0.05 (0.3 is the SPEC's value when EASGD blends).
        history: ring length, default 5 (must be >= 3).
        nudge_above: divergence above which the guard answers ``NUDGE_DOWN``,
            > ``threshold``; None (default): never.
        nudge_factor: the anchor's shrink factor of a ``NUDGE_DOWN``, in (0, 1).
        nudge_rising: answer ``NUDGE_DOWN`` on a sustained rise (above); default off.
        nudge_ratio: the sustained rise's least growth over the ring, latest / first, >= 1.

    Raises:
        ValueError: ``threshold`` is negative or not finite, ``history < 3``,
            ``nudge_above <= threshold``, ``nudge_factor`` outside (0, 1) or
            ``nudge_ratio`` below 1 or not finite.
    """

    def __init__(self, threshold: float = 0.05, history: int = 5, nudge_above: float | None = None,
                 nudge_factor: float = 0.5, nudge_rising: bool = False, nudge_ratio: float = 1.0) -> None:
        if not (math.isfinite(threshold) and threshold >= 0):
            raise ValueError(f"threshold must be a finite number >= 0, got {threshold!r}")
        if history < 3:
            raise ValueError(f"history must be >= 3 (the trend needs three points), got {history!r}")
        if nudge_above is not None and not (math.isfinite(nudge_above) and nudge_above > threshold):
            raise ValueError(f"nudge_above must be a finite number > threshold ({threshold}), got {nudge_above!r}")
        if not 0 < nudge_factor < 1:
            raise ValueError(f"nudge_factor must be in (0, 1), got {nudge_factor!r}")
        if not (math.isfinite(nudge_ratio) and nudge_ratio >= 1):
            raise ValueError(f"nudge_ratio must be a finite number >= 1, got {nudge_ratio!r}")
        self.threshold = float(threshold)
        self.nudge_above = None if nudge_above is None else float(nudge_above)
        self.nudge_factor = float(nudge_factor)
        self.nudge_rising = bool(nudge_rising)
        self.nudge_ratio = float(nudge_ratio)
        self._ring: deque[float] = deque(maxlen=int(history))

    def observe(self, max_divergence: float) -> Verdict:
        """Record one round's max divergence over ranks and return the verdict."""
        self._ring.append(float(max_divergence))
        if self.nudge_above is not None and self._ring[-1] > self.nudge_above:
            return Verdict.NUDGE_DOWN
        ring = list(self._ring)
        if (self.nudge_rising and len(ring) == self._ring.maxlen and ring[-1] > self.threshold
                and all(a < b for a, b in zip(ring, ring[1:])) and ring[-1] >= self.nudge_ratio * ring[0]):
            self._ring.clear()
            return Verdict.NUDGE_DOWN
        if len(ring) >= 3:
            a, b, c = ring[-3:]
            if a < b < c and c > self.threshold:
                return Verdict.SUPPRESS_GROWTH
        return Verdict.STABLE

    def state_dict(self) -> dict:
        """JSON-able state, saved in checkpoints so a resumed run is not blind."""
        return {"threshold": self.threshold, "history": list(self._ring), "maxlen": self._ring.maxlen}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.threshold = float(state["threshold"])
        self._ring = deque((float(v) for v in state["history"]), maxlen=int(state["maxlen"]))
