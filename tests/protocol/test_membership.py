"""Membership (SPEC §9): stable ids across shrinks and joins, failed sets, the lowest survivor."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from flodl_mpi.protocol.membership import (
    Membership,
    MembershipChange,
    MembershipError,
    after_failure,
    check_failed,
    lowest_survivor,
)


def test_launch_ids_are_the_launch_ranks():
    m = Membership.launch(3)
    assert m.ids == (0, 1, 2) and m.next_id == 3 and m.world_size == 3 and m.width == 3
    assert not m.changed
    assert [m.rank_of(i) for i in range(3)] == [0, 1, 2] and [m.id_of(r) for r in range(3)] == [0, 1, 2]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_every_failed_set_of_small_worlds(world_size):
    """Every non-empty, non-total failed set of W <= 5: survivors keep their order, rank 0 goes to the lowest."""
    m = Membership.launch(world_size)
    for k in range(1, world_size):
        for failed in itertools.combinations(range(world_size), k):
            survivors = [r for r in range(world_size) if r not in failed]  # independent: by hand
            assert after_failure(world_size, reversed(failed)) == tuple(survivors)
            assert lowest_survivor(failed, world_size) == survivors[0]
            shrunk = m.without(failed)
            assert shrunk.ids == tuple(survivors) and shrunk.world_size == world_size - k
            assert shrunk.next_id == world_size and shrunk.changed
            assert m.ids_of(failed) == failed
            for new_rank, old_rank in enumerate(survivors):
                assert shrunk.rank_of(old_rank) == new_rank


def test_newcomers_get_fresh_ids_never_a_dead_ranks():
    m = Membership.launch(3).without([1])  # ids (0, 2)
    grown, joined = m.with_newcomers(2)
    assert joined == (3, 4) and grown.ids == (0, 2, 3, 4) and grown.width == 5
    again = grown.without([0])  # rank 0 (id 0) dies: id 2 is rank 0 now
    assert again.ids == (2, 3, 4) and again.id_of(0) == 2 and again.rank_of(4) == 2
    assert Membership.from_state_dict(again.state_dict()) == again


def test_scatter_keys_rows_by_stable_id():
    m = Membership((0, 2, 3), 5)
    row = m.scatter(np.array([1.5, 2.5, 3.5]), np.nan)
    assert row.shape == (5,) and row[0] == 1.5 and row[2] == 2.5 and row[3] == 3.5
    assert math.isnan(row[1]) and math.isnan(row[4])
    ints = m.scatter(np.array([7, 8, 9], dtype=np.int64), -1)
    assert ints.tolist() == [7, -1, 8, 9, -1] and ints.dtype == np.int64
    with pytest.raises(ValueError, match=r"one entry per rank \(3\), got shape \(2,\)"):
        m.scatter([1, 2], -1)


@pytest.mark.parametrize(
    ("failed", "world_size", "message"),
    [
        ([], 3, "the failed set is empty"),
        ([3], 3, r"failed rank\(s\) \[3\] are not in the world of 3 ranks \(0..2\)"),
        ([-1], 3, r"\[-1\] are not in the world"),
        ([1, 1], 3, r"failed rank\(s\) \[1\] named more than once"),
        ([0, 1, 2], 3, "every rank of the 3 failed: no survivor"),
        ([0], 0, "world_size must be >= 1"),
    ],
)
def test_bad_failed_sets_are_refused(failed, world_size, message):
    with pytest.raises(MembershipError, match=message):
        check_failed(failed, world_size)
    with pytest.raises(MembershipError, match=message):
        lowest_survivor(failed, world_size)


def test_bad_memberships_are_refused():
    with pytest.raises(MembershipError, match="strictly increasing"):
        Membership((0, 2, 1), 3)
    with pytest.raises(MembershipError, match=r"next_id must be above every id \(2\), got 2"):
        Membership((0, 2), 2)
    with pytest.raises(MembershipError, match="at least one rank"):
        Membership((), 1)
    with pytest.raises(TypeError, match="a failed rank must be an int, got float"):
        check_failed([1.0], 3)
    with pytest.raises(MembershipError, match=r"stable id 1 is not a current rank \(ids \[0, 2\]\)"):
        Membership((0, 2), 3).rank_of(1)
    with pytest.raises(MembershipError, match="count of newcomers must be >= 1"):
        Membership.launch(2).with_newcomers(0)


def test_membership_change_checks_and_sorts():
    c = MembershipChange(
        round=20,
        time_s=3.5,
        left=(2, 0),
        joined=(),
        steps_lost=(4, 7),
        world_size=1,
        detection_ms=120.0,
        recovery_ms=30,
    )
    assert c.left == (0, 2) and c.steps_lost == (7, 4), "each id keeps its own count when sorted"
    assert c.steps_lost_of(2) == 4 and c.steps_lost_of(1) == 0
    assert c.total_steps_lost == 11 and c.recovery_ms == 30.0
    for bad, message in [
        (dict(left=(), joined=(), steps_lost=()), "neither"),
        (dict(left=(1,), joined=(1,), steps_lost=(0,)), r"ids \[1\] both left and joined"),
        (dict(steps_lost=()), "one count >= 0 per left id"),
        (dict(steps_lost=(-1,)), "one count >= 0 per left id"),
        (dict(detection_ms=math.nan), "detection_ms must be a finite number >= 0"),
        (dict(world_size=0), "world_size >= 1"),
    ]:
        args = dict(
            round=1, time_s=1.0, left=(1,), joined=(), steps_lost=(3,), world_size=2, detection_ms=1.0, recovery_ms=1.0
        )
        with pytest.raises(MembershipError, match=message):
            MembershipChange(**{**args, **bad})
