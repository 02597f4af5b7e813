"""Membership: which ranks the run has now, by stable id, and one change of it (SPEC §9).

Invariant: "rank" is a position in the current communicator; a *stable id* labels a rank
for the whole run: its launch rank, then a join counter (a newcomer gets the next unused
id, never a dead rank's). Ids are held in rank order and increase with the rank, as
ULFM's ``Shrink`` keeps the survivors' order and ``Merge`` puts newcomers above them, so
every rank derives the same membership from the same agreed failed set alone. Rank 0's
duties (metrics.h5, checkpoints, train.log) pass to the lowest surviving rank. Pure: no
MPI, no threads, no clocks; the MPI side agrees the failed set and feeds it here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Membership", "MembershipChange", "MembershipError", "after_failure", "check_failed", "lowest_survivor"]


class MembershipError(ValueError):
    """A failed set or a membership that cannot be: one line naming the value and what is allowed."""


def _int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def check_failed(failed: Iterable[int], world_size: int) -> tuple[int, ...]:
    """The failed ranks as a sorted tuple, checked against a world of ``world_size`` ranks.

    Args:
        failed: ranks (positions in the current communicator) agreed to have failed;
            any order, each once.
        world_size: ranks in the current communicator, >= 1.

    Returns:
        The ranks, ascending.

    Raises:
        TypeError: a rank that is not an int.
        MembershipError: an empty set (nothing failed), a rank outside ``[0, world_size)``,
            a rank named twice, or every rank (no survivor to go on with).
    """
    world_size = _int(world_size, "world_size")
    if world_size < 1:
        raise MembershipError(f"world_size must be >= 1, got {world_size}")
    ranks = [_int(r, "a failed rank") for r in failed]
    if not ranks:
        raise MembershipError("the failed set is empty: no rank failed, nothing to shrink")
    outside = sorted(r for r in ranks if not 0 <= r < world_size)
    if outside:
        raise MembershipError(
            f"failed rank(s) {outside} are not in the world of {world_size} ranks (0..{world_size - 1})"
        )
    if len(set(ranks)) != len(ranks):
        twice = sorted({r for r in ranks if ranks.count(r) > 1})
        raise MembershipError(f"failed rank(s) {twice} named more than once")
    if len(ranks) == world_size:
        raise MembershipError(f"every rank of the {world_size} failed: no survivor to go on with")
    return tuple(sorted(ranks))


def lowest_survivor(failed: Iterable[int], world_size: int) -> int:
    """The lowest rank (before the shrink) not in ``failed``: it takes over rank 0's duties.

    It is rank 0 of the shrunk communicator. Raises as :func:`check_failed`.
    """
    gone = set(check_failed(failed, world_size))
    return next(r for r in range(world_size) if r not in gone)


def after_failure(world_size: int, failed: Iterable[int]) -> tuple[int, ...]:
    """The survivors' ranks before the shrink, ascending; survivor ``k`` is rank ``k`` after it.

    ``W' = W - |failed|`` (SPEC §9). Raises as :func:`check_failed`.
    """
    gone = set(check_failed(failed, world_size))
    return tuple(r for r in range(world_size) if r not in gone)


@dataclass(frozen=True)
class Membership:
    """The current ranks' stable ids: ``ids[r]`` is rank ``r``'s; ``next_id`` is the next newcomer's.

    Attributes:
        ids: strictly increasing stable ids, one per rank (length = world size >= 1).
        next_id: the id the next newcomer gets, > every id ever given (the per-rank
            columns of metrics.h5 are this wide: one slot per id ever given).

    Example (every rank alike, after the survivors agreed the failed set)::

        members = Membership.launch(world_size)        # ids 0..W-1
        change_ids = members.ids_of(failed)            # the stable ids that left
        members = members.without(failed)              # the shrunk world, same order
        members, joined = members.with_newcomers(1)    # a respawn: fresh id W

    Raises:
        MembershipError: ids empty, negative, not strictly increasing, or ``next_id`` not
            above them.
    """

    ids: tuple[int, ...]
    next_id: int

    def __post_init__(self) -> None:
        ids = tuple(_int(i, "a stable id") for i in self.ids)
        object.__setattr__(self, "ids", ids)
        object.__setattr__(self, "next_id", _int(self.next_id, "next_id"))
        if not ids:
            raise MembershipError("a membership needs at least one rank, got no ids")
        if ids[0] < 0 or any(b <= a for a, b in zip(ids, ids[1:])):
            raise MembershipError(f"stable ids must be >= 0 and strictly increasing with the rank, got {list(ids)}")
        if self.next_id <= ids[-1]:
            raise MembershipError(f"next_id must be above every id ({ids[-1]}), got {self.next_id}")

    @classmethod
    def launch(cls, world_size: int) -> Membership:
        """The launch membership: rank r has stable id r, the next newcomer ``world_size``."""
        world_size = _int(world_size, "world_size")
        if world_size < 1:
            raise MembershipError(f"world_size must be >= 1, got {world_size}")
        return cls(tuple(range(world_size)), world_size)

    @property
    def world_size(self) -> int:
        """Ranks now."""
        return len(self.ids)

    @property
    def width(self) -> int:
        """Stable ids ever given (``next_id``): the width of metrics.h5's per-rank columns."""
        return self.next_id

    @property
    def changed(self) -> bool:
        """Whether any rank left or joined since the launch (ids are no longer ``0..W-1``)."""
        return self.ids != tuple(range(self.next_id))

    def id_of(self, rank: int) -> int:
        """Rank ``rank``'s stable id. Raises MembershipError: no such rank."""
        rank = _int(rank, "rank")
        if not 0 <= rank < self.world_size:
            raise MembershipError(f"rank {rank} is not in the world of {self.world_size} ranks")
        return self.ids[rank]

    def rank_of(self, stable_id: int) -> int:
        """The rank that stable id ``stable_id`` has now. Raises MembershipError: not a current member."""
        stable_id = _int(stable_id, "stable_id")
        try:
            return self.ids.index(stable_id)
        except ValueError:
            raise MembershipError(f"stable id {stable_id} is not a current rank (ids {list(self.ids)})") from None

    def ids_of(self, ranks: Iterable[int]) -> tuple[int, ...]:
        """The stable ids of ``ranks``, ascending."""
        return tuple(sorted(self.id_of(r) for r in ranks))

    def without(self, failed: Iterable[int]) -> Membership:
        """The membership after the ranks ``failed`` left (:func:`after_failure`); ``next_id`` kept.

        Raises as :func:`check_failed`.
        """
        return Membership(tuple(self.ids[r] for r in after_failure(self.world_size, failed)), self.next_id)

    def with_newcomers(self, count: int) -> tuple[Membership, tuple[int, ...]]:
        """The membership after ``count`` >= 1 newcomers joined above the current ranks, and their ids.

        Raises:
            MembershipError: ``count`` < 1.
        """
        count = _int(count, "count")
        if count < 1:
            raise MembershipError(f"count of newcomers must be >= 1, got {count}")
        joined = tuple(range(self.next_id, self.next_id + count))
        return Membership(self.ids + joined, self.next_id + count), joined

    def scatter(self, values: Sequence | np.ndarray, fill: float | int | bool) -> np.ndarray:
        """A per-rank row ``(W, ...)`` (index = rank) as a per-id row ``(width, ...)`` (index = stable id).

        The slots of ids that are not current ranks hold ``fill`` (metrics.h5's padding:
        NaN for floats, -1 for integers, False for booleans).

        Raises:
            ValueError: ``values`` does not hold one entry per rank.
        """
        arr = np.asarray(values)
        if arr.ndim < 1 or arr.shape[0] != self.world_size:
            raise ValueError(f"values must hold one entry per rank ({self.world_size}), got shape {arr.shape}")
        out = np.full((self.width, *arr.shape[1:]), fill, dtype=arr.dtype)
        out[list(self.ids)] = arr
        return out

    def state_dict(self) -> dict:
        """JSON-able: ``{"ids": [...], "next_id": n}`` (checkpoints, a newcomer's welcome)."""
        return {"ids": list(self.ids), "next_id": self.next_id}

    @classmethod
    def from_state_dict(cls, state: dict) -> Membership:
        """The membership of :meth:`state_dict`'s values. Raises MembershipError as the constructor."""
        return cls(tuple(state["ids"]), int(state["next_id"]))


@dataclass(frozen=True)
class MembershipChange:
    """One change of membership: a row of metrics.h5's ``membership`` table (SPEC §9, the ledger).

    Attributes:
        round: the round the change happened at (the abandoned one: no consensus of it
            was adopted; the next round is the first of the new world).
        time_s: seconds since the run started, when the change was in place.
        left: stable ids that left, ascending.
        joined: stable ids that joined, ascending.
        steps_lost: per id of ``left`` (in the order given; stored in ``left``'s ascending
            order), the optimizer steps it had taken since the last consensus it adopted
            (never averaged: lost work), each >= 0.
        world_size: ranks after the change, >= 1.
        detection_ms: from the failed collective's start to the failure being known to
            every survivor (agreed), ms >= 0; 0 for a join.
        recovery_ms: from then to the new world's first round being ready (communicators
            rebuilt, policy re-planned, data re-split, newcomers welcomed), ms >= 0.

    Raises:
        MembershipError: nothing left nor joined, an id in both, ``steps_lost`` not one
            count >= 0 per left id, ``world_size`` < 1, or a time not a finite number >= 0.
    """

    round: int
    time_s: float
    left: tuple[int, ...]
    joined: tuple[int, ...]
    steps_lost: tuple[int, ...]
    world_size: int
    detection_ms: float
    recovery_ms: float

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        left = [_int(i, "a left id") for i in self.left]
        steps = [_int(s, "steps_lost") for s in self.steps_lost]
        if len(steps) != len(left) or any(s < 0 for s in steps):
            raise MembershipError(f"steps_lost must be one count >= 0 per left id ({len(left)}), got {steps}")
        pairs = sorted(zip(left, steps))  # ascending ids, each keeping its own count
        set_(self, "left", tuple(i for i, _ in pairs))
        set_(self, "steps_lost", tuple(s for _, s in pairs))
        set_(self, "joined", tuple(sorted(_int(i, "a joined id") for i in self.joined)))
        set_(self, "round", _int(self.round, "round"))
        set_(self, "world_size", _int(self.world_size, "world_size"))
        if not self.left and not self.joined:
            raise MembershipError("a membership change needs a rank that left or joined, got neither")
        if set(self.left) & set(self.joined):
            raise MembershipError(f"ids {sorted(set(self.left) & set(self.joined))} both left and joined")
        if min((*self.left, *self.joined)) < 0:
            raise MembershipError(f"stable ids must be >= 0, got left {list(self.left)} joined {list(self.joined)}")
        if self.round < 0 or self.world_size < 1:
            raise MembershipError(f"round must be >= 0 and world_size >= 1, got {self.round}, {self.world_size}")
        for name in ("time_s", "detection_ms", "recovery_ms"):
            value = float(getattr(self, name))
            if not (np.isfinite(value) and value >= 0):
                raise MembershipError(f"{name} must be a finite number >= 0, got {getattr(self, name)!r}")
            set_(self, name, value)

    def steps_lost_of(self, stable_id: int) -> int:
        """The steps lost with id ``stable_id`` (0 for an id that did not leave)."""
        return dict(zip(self.left, self.steps_lost)).get(stable_id, 0)

    @property
    def total_steps_lost(self) -> int:
        """Steps lost over every rank that left."""
        return sum(self.steps_lost)
