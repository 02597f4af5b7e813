"""Realized-work mass: how much say each rank has in a consensus (SPEC §1).

Invariant: a rank that took no optimizer step since the last consensus has mass
exactly 0.0 for every gamma, so it can never vote (``0 ** 0 == 1`` and
``0 ** -1 == inf`` are the traps this guards against).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["gamma_mass", "relative_masses", "mover_mass", "is_realized", "RoundMasses", "round_masses"]


def gamma_mass(n: float, gamma: float) -> float:
    """Mass of a rank's parameters for the params reduce.

    Args:
        n: optimizer steps the rank completed since the consensus it last
            adopted (a count, >= 0; fractional values are accepted).
        gamma: exponent. 1 = plain work weighting, 0 < gamma < 1 damps a fast
            rank's dominance, 0 = unweighted mean over the ranks that moved,
            -1 = each step weighted equally.

    Returns:
        ``0.0`` when ``n <= 0`` (for every gamma, negative included); ``float(n)``
        exactly when ``gamma == 1``; otherwise ``n ** gamma``. Source: SPEC §1
        mass table.
    """
    if not n > 0:  # NaN steps count as idle, too
        return 0.0
    if gamma == 1.0:
        return float(n)
    try:
        return float(n) ** gamma
    except OverflowError:  # e.g. 5 ** 1000: a mass too large for a float64
        return math.inf


def relative_masses(steps: Sequence[float], gamma: float) -> list[float]:
    """Every rank's ``gamma_mass`` divided by the largest one, in ``[0, 1]``.

    The consensus ``Σ m_r·T_r / Σ m_r`` does not change when every mass is
    divided by the same factor, and every rank computes the same factor from
    the gathered step counts. Dividing by the largest mass keeps the float32
    frame finite for any gamma (``n ** gamma`` alone overflows float32 already
    at ``1000 ** 13``). Computed in log space, so it never overflows.

    Args:
        steps: every rank's ``n_r``, index = rank.
        gamma: the mass exponent.

    Returns:
        ``m_r / max_s m_s`` per rank; idle ranks exactly 0.0; all zeros when
        no rank moved.
    """
    logs = [gamma * math.log(n) if n > 0 else None for n in steps]
    top = max((v for v in logs if v is not None), default=None)
    return [0.0 if v is None else math.exp(v - top) for v in logs]


def mover_mass(n: float) -> float:
    """Mass for the buffers reduce: ``1.0`` if the rank moved (``n > 0``) else ``0.0``.

    Buffers (BatchNorm running statistics) are equal-weighted among movers and
    never gamma-weighted (SPEC §1).
    """
    return 1.0 if n > 0 else 0.0


def is_realized(mass: float) -> bool:
    """Whether a summed mass realized any work: ``mass > 0``; NaN is not realized."""
    return not math.isnan(mass) and mass > 0.0


@dataclass(frozen=True)
class RoundMasses:
    """Every rank's masses for one round (index = rank), after quarantine.

    Attributes:
        mass: the params mass as recorded in ``metrics.h5`` (``gamma_mass``;
            0.0 for a quarantined rank).
        wire: the params mass sent on the wire (``mass`` divided by the largest,
            see :func:`relative_masses`).
        buffers: the buffers mass (:func:`mover_mass`; 0.0 when quarantined).
        quarantined: ranks whose flag said non-finite, ascending.
    """

    mass: list[float]
    wire: list[float]
    buffers: list[float]
    quarantined: list[int]


def round_masses(steps: Sequence[float], finite: Sequence[bool], gamma: float) -> RoundMasses:
    """The masses of a round in which the ranks flagged non-finite are quarantined.

    A quarantined rank sends mass 0 (true zeros, SPEC §1) for the params and
    the buffers and adopts the consensus of the finite ranks; the masses are
    renormalized over the finite ranks only. When some rank is quarantined but
    no finite rank moved, every finite rank gets mass 1.0: each holds the last
    consensus it adopted unchanged (no step since), so their mean is that
    consensus, and the quarantined rank takes it back instead of keeping its
    non-finite values.

    Args:
        steps: every rank's ``n_r``, index = rank (the gathered control column).
        finite: every rank's flag, True when its loss and tensors were finite.
        gamma: the params mass exponent.

    Returns:
        :class:`RoundMasses`. With no rank quarantined this is exactly
        ``gamma_mass`` / ``relative_masses`` / ``mover_mass`` of ``steps``.
        With no finite rank every mass is 0.0 (the caller stops the job).
    """
    if len(steps) != len(finite):
        raise ValueError(f"steps has {len(steps)} ranks but finite has {len(finite)}")
    quarantined = [r for r, ok in enumerate(finite) if not ok]
    counted = [n if ok else 0.0 for n, ok in zip(steps, finite)]
    if quarantined and not any(n > 0 for n in counted):
        ones = [1.0 if ok else 0.0 for ok in finite]
        return RoundMasses(list(ones), list(ones), list(ones), quarantined)
    return RoundMasses(
        mass=[gamma_mass(n, gamma) for n in counted],
        wire=relative_masses(counted, gamma),
        buffers=[mover_mass(n) for n in counted],
        quarantined=quarantined,
    )
