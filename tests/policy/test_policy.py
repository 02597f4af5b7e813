"""The policies on scripted round facts: the anchor grows, the guard's verdicts gate it, plans are deterministic."""

import math

import numpy as np
import pytest

from flodl_mpi.config import ConfigError, TrainConfig
from flodl_mpi.protocol.divergence import TrendGuard, Verdict
from flodl_mpi.policy.elche import ElChe
from flodl_mpi.policy.policies import CadencePolicy, FixedPolicy, RoundFacts, guard_threshold
from flodl_mpi.policy.registry import make_policy


def cadence(guard=None, act=True, **elche):
    return CadencePolicy(2, ElChe(2, **{"anchor": 10, **elche}), guard or TrendGuard(0.05), act_on_guard=act)


def run(policy, divergences, ms=(10.0, 30.0), round_ms=60.0):
    """Feed one round per divergence (None: the first round, no ack yet); the windows run as planned.

    Returns the anchors after each round and the verdicts.
    """
    anchors, verdicts = [], []
    plan = policy.plan()
    for div in divergences:
        facts = RoundFacts(batch_ms=np.array(ms), window=np.array(plan.quotas), anchor=plan.anchor,
                           round_ms=math.nan if div is None else round_ms, max_divergence=div)
        verdicts.append(policy.observe(facts))
        plan = policy.plan()
        anchors.append(plan.anchor)
    return anchors, verdicts


def test_anchor_grows_from_the_measured_overhead_until_the_target():
    # Rank 1 takes 30 ms a batch, a round 60 ms. Window 0 ran (10, 10): rank 1's window 300 ms.
    # r1: overhead 60/300 = 0.2 > 0.05 -> ceil(10 * 2) = 20. r2: its reading is window 1's (anchor 10,
    # 300 ms) again -> 20, no more. r3: window 2 ran anchor 20 (600 ms): 0.1 -> 40. r4: window 3 was
    # still anchor 20 -> 40, no more. r5: window 4 ran anchor 40 (1200 ms): 0.05, not above -> stays.
    policy = cadence()
    anchors, verdicts = run(policy, [None, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01])
    assert anchors == [10, 20, 20, 40, 40, 40, 40]
    assert verdicts == [None] + [Verdict.STABLE] * 6
    assert policy.plan().quotas == (120, 40)


def test_suppress_growth_drops_the_proposal_latches_and_five_stables_rearm():
    # r3's divergences rise three times in a row past 0.05 (0.01 < 0.06 < 0.07): SuppressGrowth drops its
    # proposal (40). Flat 0.07 afterwards reads Stable; the fifth Stable in a row (r8) re-arms and commits.
    policy = cadence()
    anchors, verdicts = run(policy, [None, 0.01, 0.06, 0.07, 0.07, 0.07, 0.07, 0.07, 0.07])
    assert verdicts[3] == Verdict.SUPPRESS_GROWTH
    assert anchors == [10, 20, 20, 20, 20, 20, 20, 20, 40]


def test_without_the_guard_acting_the_same_sequence_grows():
    policy = cadence(act=False)
    anchors, verdicts = run(policy, [None, 0.01, 0.06, 0.07, 0.07])
    assert verdicts[3] == Verdict.SUPPRESS_GROWTH  # still computed, and recorded
    assert anchors == [10, 20, 20, 40, 40]


def test_nudge_down_from_the_guard_shrinks_the_anchor():
    policy = cadence(guard=TrendGuard(0.05, nudge_above=0.5, nudge_factor=0.5))
    anchors, verdicts = run(policy, [None, 0.01, 0.01, 0.01, 0.9, 0.01])
    assert verdicts[4] == Verdict.NUDGE_DOWN
    assert anchors == [10, 20, 20, 40, 20, 20]  # nudged to floor(40 * 0.5); latched: r5's proposal dropped


def test_two_ranks_fed_the_same_facts_hold_the_same_plans_and_a_restored_one_continues():
    a, b = cadence(), cadence()
    seq = [None, 0.01, 0.02, 0.06, 0.07, 0.01]
    assert run(a, seq) == run(b, seq)
    c = cadence()
    c.load_state_dict(a.state_dict())
    more = [0.01, 0.01, 0.3, 0.01]
    assert run(a, more, ms=(12.0, 31.0), round_ms=200.0) == run(c, more, ms=(12.0, 31.0), round_ms=200.0)
    assert a.state_dict() == c.state_dict()


def test_fixed_policies_keep_their_window():
    p = FixedPolicy(3, 4)
    p.observe(RoundFacts(batch_ms=np.array([1.0, 2.0, 9.0]), window=np.array([4, 4, 4]), round_ms=50.0,
                         max_divergence=0.5))
    assert p.plan().quotas == (4, 4, 4) and p.plan().anchor == 4 and p.name == "window"
    assert FixedPolicy(2, 1).name == "sync"


def test_make_policy_and_the_guard_threshold():
    assert guard_threshold(None) == 0.05 and guard_threshold(1.0) == 0.05 and guard_threshold(0.5) == 0.3
    p = make_policy(TrainConfig(policy="async", async_adopt="easgd"), 2)
    assert not p.blocking and p.guard.threshold == 0.3 and p.plan().quotas == (10, 10)
    p = make_policy(TrainConfig(policy="async", easgd_alpha=0.5), 2)  # the alpha alone implies easgd
    assert p.guard.threshold == 0.3
    p = make_policy(TrainConfig(policy="async", easgd_alpha=1.0), 2)
    assert p.guard.threshold == 0.05
    p = make_policy(TrainConfig(policy="async"), 2)  # delta: every rank sits at the consensus + its own window
    assert TrainConfig(policy="async").async_adopt_value == "delta" and p.guard.threshold == 0.05
    p = make_policy(TrainConfig(policy="cadence", anchor=4, max_anchor=8, overhead_target=0.1), 3)
    assert p.blocking and p.plan().quotas == (4, 4, 4) and p.elche.max_anchor == 8
    assert make_policy(TrainConfig(policy="window", window=3), 2).plan().quotas == (3, 3)


@pytest.mark.parametrize("kwargs, match", [
    ({"anchor": 4}, "--anchor take.s. effect with --policy cadence or async"),
    ({"policy": "window", "window": 2, "divergence_guard": False}, "--no-divergence-guard take"),
    ({"policy": "cadence", "window": 3}, "--window 3 contradicts --policy cadence"),
    ({"policy": "cadence", "easgd_alpha": 0.5}, "--easgd-alpha takes effect with --policy async"),
    ({"policy": "async", "easgd_alpha": 0.0}, r"--easgd-alpha 0.0: must be a number in \(0, 1\]"),
    ({"policy": "cadence", "anchor": 20, "max_anchor": 10}, r"--max-anchor 10: must be an integer >= the anchor"),
    ({"policy": "cadence", "overhead_target": -1.0}, "--overhead-target -1.0: must be a finite number > 0"),
    ({"policy": "async", "outer": "slowmo"}, "--outer slowmo needs a blocking policy"),
    ({"policy": "cadence", "async_adopt": "delta"}, "--async-adopt takes effect with --policy async"),
    ({"policy": "async", "async_adopt": "mean"}, "--async-adopt 'mean': must be one of delta, easgd"),
    ({"policy": "async", "async_adopt": "delta", "easgd_alpha": 0.5},
     "--easgd-alpha takes effect with --async-adopt easgd"),
])
def test_config_refuses_balancer_options_out_of_place(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        TrainConfig(**kwargs)


def test_an_epoch_exchange_or_a_resume_between_two_rounds_changes_no_plan():
    """A stop mid-epoch adds an exchange (it takes the last round's acks) and a checkpoint: plans stay as if not."""
    def facts(plan, div, window_closed=True):
        return RoundFacts(batch_ms=np.array([10.0, 30.0]) if window_closed else np.full(2, np.nan),
                          window=np.array(plan.quotas) if window_closed else np.zeros(2, np.int64),
                          anchor=plan.anchor if window_closed else 0, round_ms=math.nan if div is None else 40.0,
                          max_divergence=div, closes_window=window_closed)

    divs = [None, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01]
    straight = cadence(anchor=4)
    plans = []
    for d in divs:
        straight.observe(facts(straight.plan(), d))
        plans.append(straight.plan())
    for cut in range(1, len(divs) - 1):
        p = cadence(anchor=4)
        for d in divs[:cut]:
            p.observe(facts(p.plan(), d))
        p.observe(facts(p.plan(), divs[cut], window_closed=False))  # the exchange takes round cut-1's acks
        resumed = cadence(anchor=4)
        resumed.load_state_dict(p.state_dict())
        got = []
        for i, d in enumerate(divs[cut:]):
            resumed.observe(facts(resumed.plan(), None if i == 0 else d))  # no acks right after a resume
            got.append(resumed.plan())
        # the first plan after the cut is for the window after the one in flight at the cut
        assert got == plans[cut:], cut
    assert len({p.anchor for p in plans}) > 2


def test_async_grows_the_anchor_from_the_exposed_wait_and_shrinks_it_to_what_hides_the_round():
    """Under async the round runs behind compute: what the user pays is the training thread's wait.

    Rank 1: 30 ms a batch, window 0 ran (10, 10): 300 ms. Every round takes 60 ms (overhead 0.2, cadence
    would grow the anchor to 20 at r1). A wait of 30 ms (0.1 of the window) proposes ceil(10 * 2) = 20,
    and cadence on the same facts ignores the wait. With no growth proposed, the anchor shrinks towards
    the shortest window that hides the round twice over, ceil(2 * 60 / 30) = 4 batches of rank 1, at
    most halving per round: a fully hidden round gives 10 -> 5 -> 4, and stays there.
    """
    def feed(policy, waits, round_ms=60.0):
        plan, anchors = policy.plan(), []
        for i, wait in enumerate(waits):
            policy.observe(RoundFacts(batch_ms=np.array([10.0, 30.0]), window=np.array(plan.quotas),
                                      anchor=plan.anchor, round_ms=math.nan if i == 0 else round_ms,
                                      wait_ms=math.nan if i == 0 else wait, max_divergence=None if i == 0 else 0.01))
            plan = policy.plan()
            anchors.append(plan.anchor)
        return anchors

    def async_policy():
        return CadencePolicy(2, ElChe(2, anchor=10), TrendGuard(0.05), blocking=False)

    p = async_policy()
    assert feed(p, [None, 0.0, 0.0, 0.0, 0.0]) == [10, 5, 4, 4, 4]
    assert p.plan().quotas == (12, 4)
    assert feed(async_policy(), [None, 30.0, 0.0, 0.0]) == [10, 20, 10, 5]  # grown, then halved twice
    # 15 ms over window 0's 300 ms is 0.05, not above the target: no growth, so the shrink.
    assert feed(async_policy(), [None, 15.0, 15.0]) == [10, 5, 4]
    assert feed(async_policy(), [None, 0.0, 0.0], round_ms=300.0) == [10, 10, 10]  # 20 batches needed: stays
    assert feed(cadence(), [None, 0.0, 0.0]) == [10, 20, 20]  # cadence: the round time, whatever the wait
    assert feed(cadence(), [None, 0.0, 0.0], round_ms=0.0) == [10, 10, 10]  # and it never shrinks


def test_an_async_policy_restored_mid_run_continues_and_reads_an_older_pending_cost():
    facts = [RoundFacts(batch_ms=np.array([10.0, 30.0]), window=np.array([30, 10]), anchor=10, round_ms=60.0,
                        wait_ms=0.0, max_divergence=0.01, closes_window=False)]
    a = CadencePolicy(2, ElChe(2, anchor=10), TrendGuard(0.05), blocking=False)
    a.observe(RoundFacts(batch_ms=np.array([10.0, 30.0]), window=np.array([10, 10]), anchor=10))
    a.observe(facts[0])  # an epoch exchange: the verdict and the round's times wait for the next close
    state = a.state_dict()
    assert state["pending"] == [int(Verdict.STABLE), 0.0, 60.0]
    old = {**state, "pending": state["pending"][:2]}  # a checkpoint written before the round's time was kept
    b = CadencePolicy(2, ElChe(2, anchor=10), TrendGuard(0.05), blocking=False)
    b.load_state_dict(state)
    c = CadencePolicy(2, ElChe(2, anchor=10), TrendGuard(0.05), blocking=False)
    c.load_state_dict(old)
    # The next window's close: the exchange already took the last ack, so this round brings none.
    close = RoundFacts(batch_ms=np.array([10.0, 30.0]), window=np.array([30, 10]), anchor=10)
    for p in (a, b, c):
        p.observe(close)
    assert a.plan() == b.plan() and a.plan().anchor == 5 and a.state_dict() == b.state_dict()
    assert c.plan().anchor == 10  # no round time known: no shrink on that round
