"""Policies re-plan for a smaller or larger world (SPEC §9), against hand-worked quotas."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flodl_mpi.policy.elche import ElChe
from flodl_mpi.policy.policies import CadencePolicy, FixedPolicy, RoundFacts
from flodl_mpi.protocol.divergence import TrendGuard


def _elche(ms, anchor=10):
    e = ElChe(len(ms), anchor=anchor)
    e.observe(ms)
    return e


@pytest.mark.parametrize(
    ("ms", "gone", "quotas", "anchor_rank"),
    [
        # [10, 20, 40] ms: quotas [40, 20, 10]. The slowest (rank 2) dies: rank 1 (20 ms) is the anchor rank,
        # rank 0 runs 20/10 = 2x the anchor.
        ([10.0, 20.0, 40.0], [2], [20, 10], 1),
        # rank 0 dies: [20, 40] left, ratios [2, 1]
        ([10.0, 20.0, 40.0], [0], [20, 10], 1),
        # rank 1 dies: [10, 40], ratio 4
        ([10.0, 20.0, 40.0], [1], [40, 10], 1),
        # two die at once: the survivor alone runs the anchor
        ([10.0, 20.0, 40.0, 25.0], [1, 2], [25, 10], 1),
        ([30.0, 10.0, 15.0], [0], [15, 10], 1),  # 15/10 = 1.5 -> 15
    ],
)
def test_elche_without_ranks(ms, gone, quotas, anchor_rank):
    e = _elche(ms)
    e.without_ranks(gone)
    assert e.world_size == len(ms) - len(gone)
    assert e.quotas() == quotas and e.anchor_rank == anchor_rank and e.anchor == 10
    assert e.smoothed_ms() == [m for r, m in enumerate(ms) if r not in gone]
    assert e.phase == "balanced"


def test_elche_dead_zone_does_not_keep_the_old_worlds_ratios():
    """A survivor's ratio moved by less than the dead zone still follows the new anchor rank."""
    e = ElChe(3, anchor=10, dead_zone=0.5)
    e.observe([10.0, 20.0, 21.0])  # quotas [21, 11, 10]
    e.without_ranks([2])
    assert e.quotas() == [20, 10]  # 20/10, not the old 21/10


def test_elche_newcomers_run_the_anchor_until_timed():
    e = _elche([10.0, 20.0])  # [20, 10]
    e.with_new_ranks(2)
    assert e.world_size == 4 and e.quotas() == [20, 10, 10, 10] and e.phase == "warmup"
    e.observe([10.0, 20.0, 5.0, 40.0])  # the newcomers timed: 40 ms is the slowest now
    assert e.quotas() == [40, 20, 80, 10] and e.anchor_rank == 3


def test_a_newcomer_loads_the_same_plan():
    survivors = CadencePolicy(2, _elche([10.0, 20.0]), TrendGuard())
    survivors.with_new_ranks(1)
    newcomer = CadencePolicy(3, ElChe(3, anchor=10), TrendGuard())
    newcomer.load_state_dict(survivors.state_dict())
    assert newcomer.plan() == survivors.plan() and newcomer.plan().quotas == (20, 10, 10)


def test_cadence_policy_forgets_the_old_worlds_window_time():
    p = CadencePolicy(3, ElChe(3, anchor=10), TrendGuard())
    p.observe(RoundFacts(batch_ms=np.array([10.0, 20.0, 40.0]), window=np.array([40, 20, 10]), anchor=10))
    assert p.state_dict()["window_ms"] == 400.0  # the anchor rank's window: 10 batches of 40 ms
    p.without_ranks([2])
    assert p.world_size == 2 and p.plan().quotas == (20, 10) and p.plan().anchor == 10
    assert math.isnan(p.state_dict()["window_ms"])
    # The next round's overhead (whatever its size) proposes no growth from the old world's timing.
    p.observe(
        RoundFacts(
            batch_ms=np.array([10.0, 20.0]), window=np.array([20, 10]), round_ms=1e6, max_divergence=0.0, anchor=10
        )
    )
    p.observe(RoundFacts(batch_ms=np.array([10.0, 20.0]), window=np.array([20, 10]), anchor=10))
    assert p.plan().anchor == 10


def test_fixed_policies_replan():
    p = FixedPolicy(4, window=3)
    p.without_ranks([0, 3])
    assert p.world_size == 2 and p.plan().quotas == (3, 3) and p.plan().anchor == 3
    p.with_new_ranks(1)
    assert p.plan().quotas == (3, 3, 3)


@pytest.mark.parametrize(
    ("gone", "message"), [([3], r"without_ranks\(\[3\]\)"), ([1, 1], "each rank once"), ([0, 1, 2], "not every rank")]
)
def test_bad_failed_sets_are_refused(gone, message):
    with pytest.raises(ValueError, match=message):
        FixedPolicy(3).without_ranks(gone)
    with pytest.raises(ValueError, match="count must be an int >= 1, got 0"):
        FixedPolicy(3).with_new_ranks(0)
