"""The ElChe balancer: quotas, smoothing, dead zone, anchor growth and the guard's verdicts (hand-worked)."""

import math

import pytest

from flodl_mpi.protocol.divergence import Verdict
from flodl_mpi.policy.elche import REARM_STABLE_ROUNDS, ElChe


@pytest.mark.parametrize("ms, anchor, want", [
    ([10.0, 30.0], 10, [30, 10]),            # rank 1 three times slower: rank 0 runs 3x the anchor
    ([30.0, 10.0], 10, [10, 30]),
    ([10.0, 25.0], 10, [25, 10]),            # 2.5x
    ([10.0, 40.0, 20.0], 10, [40, 10, 20]),  # slowest is the anchor rank; each proportionally more
    ([20.0, 50.0], 3, [8, 3]),               # 3 * 2.5 = 7.5 rounds half up to 8
    ([1.0, 100.0], 10, [640, 10]),           # the ratio is capped at 64
    ([7.0, 7.0, 7.0], 4, [4, 4, 4]),         # equal speeds: the anchor each
])
def test_quotas_for_fixed_speed_ratios(ms, anchor, want):
    elche = ElChe(len(ms), anchor=anchor)
    assert elche.quotas() == [anchor] * len(ms)  # before any reading: the anchor each
    elche.observe(ms)
    assert elche.quotas() == want
    assert elche.anchor_rank == ms.index(max(ms))
    assert elche.phase == "balanced"


def test_speed_is_the_mean_of_the_last_five_valid_readings():
    elche = ElChe(2, anchor=10)
    for v in (10.0, 10.0, 10.0, 10.0, 10.0, 40.0):
        elche.observe([v, 100.0])
    assert elche.smoothed_ms() == [pytest.approx((4 * 10.0 + 40.0) / 5), 100.0]
    elche.observe([math.nan, 0.0])  # an idle rank's NaN and a zero are no readings
    assert elche.smoothed_ms() == [pytest.approx(16.0), 100.0]
    assert elche.readings[0] == [10.0, 10.0, 10.0, 10.0, 40.0]


def test_a_rank_without_readings_keeps_the_anchor_and_the_phase_stays_warmup():
    elche = ElChe(3, anchor=10)
    elche.observe([10.0, 20.0, math.nan])
    assert elche.quotas() == [20, 10, 10] and elche.phase == "warmup"


def test_dead_zone_keeps_quotas_until_a_ratio_moves_more_than_five_percent():
    elche = ElChe(2, anchor=10)
    elche.observe([10.0, 30.0])
    assert elche.quotas() == [30, 10]
    elche.observe([10.4, 30.0])  # rank 0: mean 10.2 -> ratio 2.941, 2.0 % from 3: inside the dead zone
    assert elche.quotas() == [30, 10]
    elche.observe([12.0, 30.0])  # mean 10.8 -> ratio 2.778, 7.4 % from 3: rebalanced to round(27.78)
    assert elche.quotas() == [28, 10]


@pytest.mark.parametrize("round_ms, window_ms, max_anchor, want", [
    (10.0, 100.0, 1000, 20),    # overhead 0.10 = 2x the target: ceil(10 * 2)
    (6.0, 100.0, 1000, 12),     # 0.06: ceil(10 * 1.2)
    (50.0, 100.0, 1000, 20),    # 0.50: the factor is capped at 2
    (5.0, 100.0, 1000, None),   # exactly the target: no growth
    (1.0, 100.0, 1000, None),
    (10.0, 100.0, 15, 15),      # capped at max_anchor
    (10.0, 100.0, 10, None),    # at max_anchor already
    (math.nan, 100.0, 1000, None),
    (10.0, 0.0, 1000, None),
])
def test_growth_proposal(round_ms, window_ms, max_anchor, want):
    elche = ElChe(2, anchor=10, max_anchor=max_anchor)
    assert elche.propose(round_ms, window_ms) == want


def test_growth_scales_the_anchor_the_reading_was_taken_under():
    elche = ElChe(2, anchor=20)
    # The window was run under anchor 10 and its overhead asks for 2x: 20, not more than now.
    assert elche.propose(10.0, 100.0, window_anchor=10) is None
    assert elche.propose(10.0, 100.0, window_anchor=20) == 40


def test_stable_commits_suppress_drops_and_latches_five_stables_rearm():
    elche = ElChe(2, anchor=10)
    elche.observe([10.0, 30.0])
    elche.settle(20, Verdict.STABLE)
    assert elche.anchor == 20 and elche.quotas() == [60, 20]  # quotas follow the anchor at once
    elche.settle(40, Verdict.SUPPRESS_GROWTH)
    assert elche.anchor == 20 and elche.latched
    for i in range(REARM_STABLE_ROUNDS - 1):
        elche.settle(40, Verdict.STABLE)
        assert elche.anchor == 20 and elche.latched and elche.stable_run == i + 1
    elche.settle(40, Verdict.STABLE)  # the fifth Stable in a row: re-armed, and its proposal commits
    assert elche.anchor == 40 and not elche.latched


def test_a_suppression_while_latched_restarts_the_count():
    elche = ElChe(2, anchor=10)
    elche.settle(None, Verdict.SUPPRESS_GROWTH)
    for _ in range(3):
        elche.settle(None, Verdict.STABLE)
    elche.settle(None, Verdict.SUPPRESS_GROWTH)
    for _ in range(REARM_STABLE_ROUNDS - 1):
        elche.settle(20, Verdict.STABLE)
    assert elche.anchor == 10 and elche.latched


def test_nudge_down_shrinks_and_latches():
    elche = ElChe(2, anchor=25)
    elche.observe([10.0, 20.0])
    elche.settle(50, Verdict.NUDGE_DOWN, 0.5)
    assert elche.anchor == 12 and elche.latched and elche.quotas() == [24, 12]
    for _ in range(10):
        elche.settle(None, Verdict.NUDGE_DOWN, 0.5)
    assert elche.anchor == 1  # never below 1


@pytest.mark.parametrize("anchor, round_ms, want", [
    (10, 60.0, 5),     # needs ceil(2 * 60 / 30) = 4 batches; at most halved: ceil(10 / 2) = 5
    (5, 60.0, 4),      # the next round: 4
    (4, 60.0, None),   # there: no shrink
    (3, 60.0, None),   # below what hides the round: async grows from the exposed wait, not here
    (10, 0.0, 5),      # a free round: halving towards 1
    (1, 0.0, None),    # never below 1
    (40, 300.0, 20),   # ceil(600 / 30) = 20 = ceil(40 / 2)
    (40, 330.0, 22),   # ceil(660 / 30) = 22
    (10, math.nan, None),
    (10, -1.0, None),
])
def test_shrink_proposal_for_async(anchor, round_ms, want):
    """The anchor rank (30 ms a batch) hides a round of ``round_ms`` twice over from ceil(2 · round_ms / 30) on."""
    elche = ElChe(2, anchor=anchor)
    elche.observe([10.0, 30.0])
    assert elche.propose_shrink(round_ms) == want


def test_shrink_lowers_the_anchor_and_the_quotas_follow():
    elche = ElChe(2, anchor=10)
    assert elche.propose_shrink(60.0) is None  # warm-up: no speed known yet
    elche.observe([10.0, 30.0])
    assert elche.quotas() == [30, 10]
    elche.settle(None, Verdict.SUPPRESS_GROWTH)  # latched: the shrink does not touch the latch
    elche.shrink(elche.propose_shrink(60.0))
    assert elche.anchor == 5 and elche.quotas() == [15, 5] and elche.latched
    assert elche.propose_shrink(60.0, headroom=1.0) == 3  # ceil(60 / 30) = 2, at most halved: 3
    with pytest.raises(ValueError, match="shrink\\(\\) lowers the anchor \\(5\\), got 6"):
        elche.shrink(6)
    with pytest.raises(ValueError, match="headroom must be a finite number >= 1, got 0.5"):
        elche.propose_shrink(60.0, headroom=0.5)


def test_state_round_trip_continues_identically():
    a = ElChe(2, anchor=10)
    for ms in ([10.0, 30.0], [11.0, 29.0], [9.0, 33.0]):
        a.observe(ms)
    a.settle(20, Verdict.SUPPRESS_GROWTH)
    b = ElChe(2, anchor=10)
    b.load_state_dict(a.state_dict())
    for ms in ([12.0, 31.0], [10.0, 30.0], [30.0, 10.0]):
        a.observe(ms)
        b.observe(ms)
        for e in (a, b):
            e.settle(e.propose(10.0, 100.0), Verdict.STABLE)
        assert a.quotas() == b.quotas() and a.anchor == b.anchor and a.state_dict() == b.state_dict()


def test_validation_names_the_argument():
    with pytest.raises(ValueError, match="anchor must be an int >= 1, got 0"):
        ElChe(2, anchor=0)
    with pytest.raises(ValueError, match=r"max_anchor must be an int >= anchor \(10\), got 5"):
        ElChe(2, anchor=10, max_anchor=5)
    with pytest.raises(ValueError, match="overhead_target must be a finite number > 0"):
        ElChe(2, overhead_target=0.0)
    with pytest.raises(ValueError, match="batch_ms has 3 ranks, the balancer 2"):
        ElChe(2).observe([1.0, 2.0, 3.0])
