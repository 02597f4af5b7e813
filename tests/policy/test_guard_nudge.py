"""The guard's NudgeDown on a sustained rise (SPEC §3), on scripted divergence sequences (issue 6).

A sustained rise: the whole ring (5 rounds) strictly rising, the latest above the threshold
and at least ``nudge_ratio`` times the ring's first; the anchor halves. Off in the policies
``make_policy`` builds: healthy runs rise like that too (the last test).
"""

import math

import pytest

from flodl_mpi.config import TrainConfig
from flodl_mpi.protocol.divergence import TrendGuard, Verdict
from flodl_mpi.policy.elche import ElChe
from flodl_mpi.policy.policies import CadencePolicy
from flodl_mpi.policy.registry import make_policy
from tests.policy.test_policy import run

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


@pytest.mark.parametrize("blocking", [True, False])
def test_a_sustained_rise_halves_the_anchor(blocking):
    guard = TrendGuard(0.05, nudge_rising=True, nudge_ratio=2.0)
    p = CadencePolicy(2, ElChe(2, anchor=40), guard, blocking=blocking)
    # 0.03 < 0.035 < 0.045 < 0.055 < 0.061: rising over the ring, 0.061 > 0.05 and >= 2 x 0.03.
    # Cadence: round_ms 1 ms against 1200 ms windows, an overhead far under the 0.05 target, so the
    # anchor never grows. Async grows from the wait (none here) and shrinks towards what hides the
    # round twice over: 600 ms rounds need ceil(2 * 600 / 30) = 40 batches of rank 1, the anchor, so
    # it never shrinks. Every change comes from the guard.
    anchors, got = run(p, [None, 0.03, 0.035, 0.045, 0.055, 0.061, 0.01], round_ms=1.0 if blocking else 600.0)
    assert got == [None, S, S, S, G, N, S]
    # The verdict on a round comes with the next round's facts, which close a window: it acts at once.
    assert anchors == [40, 40, 40, 40, 40, 20, 20]  # floor(40 * 0.5); latched afterwards (no growth anyway)
    assert p.plan().quotas == (60, 20)  # rank 0 three times as fast: 3 x 20


#: The max divergences of a healthy async MNIST-1D run (async_adoption.py's "delta", seed 1: anchor 10
#: throughout, final test accuracy 0.474; benchmarks/guard_replay.py): within an epoch they climb from
#: 0.02-0.04 to 0.05-0.09, five rounds in a row at times, to 2-3x the ring's first.
HEALTHY = [0.033, 0.023, 0.039, 0.035, 0.045, 0.022, 0.038, 0.033, 0.034, 0.036, 0.043, 0.062, 0.07, 0.083, 0.082,
           0.051, 0.034, 0.054, 0.068, 0.065, 0.067, 0.04, 0.047, 0.056, 0.065, 0.067, 0.063, 0.068, 0.054, 0.0,
           0.025, 0.03, 0.037, 0.047, 0.054, 0.044, 0.04, 0.045, 0.068, 0.086, 0.087, 0.03, 0.042, 0.063, 0.076,
           0.069, 0.04, 0.032, 0.055, 0.065, 0.077, 0.062, 0.044, 0.021, 0.034, 0.046, 0.057, 0.063, 0.064, 0.007]


def test_a_healthy_run_rises_like_a_sustained_rise_so_the_policies_leave_it_off():
    for ratio in (2.0, 3.0):
        rule = verdicts(TrendGuard(0.05, nudge_rising=True, nudge_ratio=ratio), HEALTHY)
        assert N in rule  # the rule would halve a healthy run's anchor
    for policy in ("cadence", "async"):
        guard = make_policy(TrainConfig(policy=policy), 2).guard
        assert not guard.nudge_rising and guard.nudge_above is None
        got = verdicts(guard, HEALTHY)
        assert N not in got and G in got
