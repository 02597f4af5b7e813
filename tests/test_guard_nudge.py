"""The guard's NudgeDown on a sustained rise (SPEC §3), on scripted divergence sequences (issue 6).

A sustained rise: the whole ring (5 rounds) strictly rising, the latest above the threshold
and at least ``NUDGE_RATIO`` times the ring's first. It outlives SuppressGrowth's three
rounds, so the divergence keeps rising at an anchor that no longer grows: the anchor halves.
"""

import math

import numpy as np
import pytest

from flodl_mpi.config import TrainConfig
from flodl_mpi.divergence import TrendGuard, Verdict
from flodl_mpi.policy import NUDGE_RATIO, RoundFacts, make_policy

S, G, N = Verdict.STABLE, Verdict.SUPPRESS_GROWTH, Verdict.NUDGE_DOWN


def verdicts(guard: TrendGuard, values) -> list[Verdict]:
    return [guard.observe(v) for v in values]


def test_a_sustained_rise_nudges_once_then_the_ring_restarts():
    guard = TrendGuard(0.05, nudge_rising=True, nudge_ratio=2.0)
    # 0.02 < 0.03 < 0.04 < 0.05 < 0.06: five rising, 0.06 > 0.05 and 0.06 >= 2 * 0.02.
    # Rounds 3-4 are three rising but not above 0.05 yet (Stable); round 5 nudges.
    assert verdicts(guard, [0.02, 0.03, 0.04, 0.05, 0.06]) == [S, S, S, S, N]
    # The ring restarted: the next rise needs three rounds again for SuppressGrowth, five for a nudge.
    assert verdicts(guard, [0.07, 0.08, 0.09, 0.10, 0.20]) == [S, S, G, G, N]


@pytest.mark.parametrize("values, expected, why", [
    ([0.02, 0.03, 0.04, 0.045, 0.049], [S, S, S, S, S], "rising, never above the threshold"),
    ([0.05, 0.051, 0.052, 0.053, 0.054], [S, S, G, G, G], "rising 5 above the threshold, but only x1.08"),
    ([0.02, 0.03, 0.06, 0.05, 0.07], [S, S, G, S, S], "one fall breaks the rise"),
    ([0.03, 0.04, 0.06, 0.07], [S, S, G, G], "four rounds are not the ring"),
    ([0.03, 0.03, 0.04, 0.05, 0.07], [S, S, S, S, G], "equal is not rising"),
])
def test_what_is_not_a_sustained_rise(values, expected, why):
    assert verdicts(TrendGuard(0.05, nudge_rising=True, nudge_ratio=2.0), values) == expected, why


def test_off_by_default_in_the_guard_and_its_arguments_checked():
    guard = TrendGuard(0.05)
    assert verdicts(guard, [0.02, 0.03, 0.04, 0.05, 0.06]) == [S, S, S, S, G]
    with pytest.raises(ValueError, match=r"nudge_ratio must be a finite number >= 1, got 0.5"):
        TrendGuard(0.05, nudge_rising=True, nudge_ratio=0.5)
    with pytest.raises(ValueError, match=r"nudge_ratio must be a finite number >= 1, got nan"):
        TrendGuard(0.05, nudge_rising=True, nudge_ratio=math.nan)


def _feed(policy, divergences, ms=(10.0, 30.0), round_ms=1.0):
    """One round per divergence (None: the first round, no ack); the windows run as planned.

    ``round_ms`` 1 ms against 300 ms windows: an overhead of 0.003, far under the 0.05
    target, so the anchor never grows and every change comes from the guard.
    """
    anchors, got = [], []
    plan = policy.plan()
    for div in divergences:
        facts = RoundFacts(batch_ms=np.array(ms), window=np.array(plan.quotas), anchor=plan.anchor,
                           round_ms=math.nan if div is None else round_ms, max_divergence=div)
        got.append(policy.observe(facts))
        plan = policy.plan()
        anchors.append(plan.anchor)
    return anchors, got


@pytest.mark.parametrize("policy", ["cadence", "async"])
def test_the_default_policies_halve_the_anchor_on_a_sustained_rise(policy):
    p = make_policy(TrainConfig(policy=policy, anchor=40), 2)
    assert p.guard.nudge_rising and p.guard.nudge_ratio == NUDGE_RATIO
    assert NUDGE_RATIO == 2.0
    # 0.03 < 0.035 < 0.045 < 0.055 < 0.061: rising over the ring, 0.061 > 0.05 and >= 2 x 0.03.
    anchors, got = _feed(p, [None, 0.03, 0.035, 0.045, 0.055, 0.061, 0.01])
    assert got == [None, S, S, S, G, N, S]
    # The verdict on a round comes with the next round's facts, which close a window: it acts at once.
    assert anchors == [40, 40, 40, 40, 40, 20, 20]  # floor(40 * 0.5); latched afterwards (no growth anyway)
    assert p.plan().quotas == (60, 20)  # rank 0 three times as fast: 3 x 20


def test_a_healthy_sequence_never_nudges():
    """The max divergences of a healthy async MNIST-1D run (benchmarks/README.md, guard_replay.py):
    a slow creep from 0.03 to 0.1 with noise, SuppressGrowth now and then, never NudgeDown."""
    healthy = [0.032, 0.022, 0.035, 0.034, 0.04, 0.024, 0.039, 0.039, 0.043, 0.035, 0.034, 0.014, 0.047, 0.057,
               0.057, 0.052, 0.053, 0.042, 0.057, 0.061, 0.05, 0.066, 0.064, 0.064, 0.07, 0.067, 0.068, 0.078,
               0.083, 0.064, 0.073, 0.073, 0.081, 0.094, 0.097, 0.088]
    got = verdicts(make_policy(TrainConfig(policy="async"), 2).guard, healthy)
    assert N not in got and G in got
