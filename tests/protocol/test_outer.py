"""The outer step against hand-worked values (SPEC §7)."""

import numpy as np
import pytest

from flodl_mpi.protocol.outer import OUTER_DEFAULTS, OUTER_DEFAULTS_BEFORE, OuterOptimizer, settled_outer

# Three realized rounds of a two-element model, lr 0.5, momentum 0.9.
CONSENSUS = ([1.0, 2.0], [0.0, 3.0], [0.0, 2.0])

# slowmo, by hand:
#   round 1: no prev yet: a zero step; new = c1 = [1, 2]; prev = [1, 2]; v = 0
#   round 2: g = prev - c2 = [1, -1];  v = 0.9*0 + g = [1, -1]
#            new = prev - 0.5 v = [0.5, 2.5]
#   round 3: g = [0.5, 2.5] - [0, 2] = [0.5, 0.5];  v = 0.9*[1, -1] + g = [1.4, -0.4]
#            new = [0.5, 2.5] - 0.5*[1.4, -0.4] = [-0.2, 2.7]
SLOWMO = ([1.0, 2.0], [0.5, 2.5], [-0.2, 2.7])
# nesterov, by hand (same g and v, new = prev - lr (mu v + g)):
#   round 1: zero step, new = [1, 2]
#   round 2: g = [1, -1]; v = [1, -1]; mu v + g = [1.9, -1.9]; new = [1, 2] - 0.5*[1.9, -1.9] = [0.05, 2.95]
#   round 3: g = [0.05, 2.95] - [0, 2] = [0.05, 0.95]; v = 0.9*[1, -1] + g = [0.95, 0.05]
#            mu v + g = [0.855 + 0.05, 0.045 + 0.95] = [0.905, 0.995]
#            new = [0.05 - 0.4525, 2.95 - 0.4975] = [-0.4025, 2.4525]
NESTEROV = ([1.0, 2.0], [0.05, 2.95], [-0.4025, 2.4525])


@pytest.mark.parametrize("kind, expected", [("avg", CONSENSUS), ("slowmo", SLOWMO), ("nesterov", NESTEROV)])
def test_three_rounds_by_hand(kind, expected):
    outer = OuterOptimizer(kind, 2, lr=0.5, momentum=0.9)
    for c, want in zip(CONSENSUS, expected):
        x = np.array(c, dtype=np.float32)
        outer.step(x)
        np.testing.assert_allclose(x, want, rtol=0, atol=1e-6)
    assert outer.steps == 3


def test_many_pieces_match_a_float64_reference():
    # Long enough for several pass pieces; random consensus sequence; float64 reference.
    rng = np.random.default_rng(0)
    n, lr, mu = 200_003, 0.7, 0.9
    outer = OuterOptimizer("nesterov", n, lr=lr, momentum=mu)
    prev = v = None
    for _ in range(4):
        c = rng.standard_normal(n).astype(np.float32)
        ref_c = c.astype(np.float64)
        if prev is None:
            new, v = ref_c, np.zeros(n)
        else:
            g = prev - ref_c
            v = mu * v + g
            new = prev - lr * (mu * v + g)
        prev = new
        outer.step(c)
        np.testing.assert_allclose(c, new, rtol=1e-5, atol=1e-5)


def test_state_round_trip_continues_exactly():
    a = OuterOptimizer("slowmo", 5, lr=0.5, momentum=0.9)
    rng = np.random.default_rng(1)
    seq = [rng.standard_normal(5).astype(np.float32) for _ in range(4)]
    for c in seq[:2]:
        a.step(c.copy())
    arrays, attrs = a.state_dict()
    b = OuterOptimizer("slowmo", 5, lr=0.5, momentum=0.9)
    b.load_state_dict(arrays, attrs)
    for c in seq[2:]:
        x, y = c.copy(), c.copy()
        a.step(x)
        b.step(y)
        assert np.array_equal(x, y)
    assert a.steps == b.steps == 4


def test_state_of_another_kind_or_size_is_refused():
    arrays, attrs = OuterOptimizer("slowmo", 5).state_dict()
    with pytest.raises(ValueError, match="'slowmo' over 5 params, not 'nesterov' over 5"):
        OuterOptimizer("nesterov", 5).load_state_dict(arrays, attrs)
    with pytest.raises(ValueError, match="not 'slowmo' over 6"):
        OuterOptimizer("slowmo", 6).load_state_dict(arrays, attrs)


def test_defaults_and_memory():
    assert (OuterOptimizer("nesterov", 3).lr, OuterOptimizer("nesterov", 3).momentum) == OUTER_DEFAULTS["nesterov"]
    # issue 24 item 4: momentum 0.5 by default for both (benchmarks/outer_sweep.py on MNIST-1D at window 50)
    assert OUTER_DEFAULTS == {"avg": (1.0, 0.0), "slowmo": (0.7, 0.5), "nesterov": (0.7, 0.5)}
    assert (OuterOptimizer("slowmo", 3).lr, OuterOptimizer("slowmo", 3).momentum) == (0.7, 0.5)
    assert OuterOptimizer("slowmo", 1000).extra_bytes == 2 * 4 * 1000
    assert OuterOptimizer("avg", 1000).extra_bytes == 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(kind="adam", n=3), "kind must be one of avg, slowmo, nesterov"),
    (dict(kind="slowmo", n=-1), "n must be >= 0"),
    (dict(kind="slowmo", n=3, lr=0.0), "lr must be a finite number > 0"),
    (dict(kind="slowmo", n=3, lr=float("nan")), "lr must be a finite number > 0"),
    (dict(kind="slowmo", n=3, momentum=1.0), r"momentum must be in \[0, 1\)"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OuterOptimizer(**kwargs)


def test_wrong_consensus_is_refused():
    with pytest.raises(ValueError, match=r"float32 of shape \(3,\)"):
        OuterOptimizer("slowmo", 3).step(np.zeros(3, dtype=np.float64))


def test_the_defaults_three_rounds_by_hand():
    """issue 24 item 4: the defaults on CONSENSUS, by hand: nesterov (lr 0.7, momentum 0.5):
    round 1: a zero step, new = [1, 2]
    round 2: g = [1, -1]; v = g = [1, -1]; mu v + g = [1.5, -1.5]; new = [1, 2] - 0.7*[1.5, -1.5] = [-0.05, 3.05]
    round 3: g = [-0.05, 3.05] - [0, 2] = [-0.05, 1.05]; v = 0.5*[1, -1] + g = [0.45, 0.55]
             mu v + g = [0.225 - 0.05, 0.275 + 1.05] = [0.175, 1.325]; new = [-0.05 - 0.1225, 3.05 - 0.9275]
    and slowmo (lr 0.7, momentum 0.5): round 2: v = g = [1, -1], new = [1, 2] - 0.7*[1, -1] = [0.3, 2.7];
    round 3: g = [0.3, 2.7] - [0, 2] = [0.3, 0.7]; v = 0.5*[1, -1] + g = [0.8, 0.2];
             new = [0.3 - 0.56, 2.7 - 0.14] = [-0.26, 2.56]."""
    for kind, want in (("nesterov", ([1.0, 2.0], [-0.05, 3.05], [-0.1725, 2.1225])),
                       ("slowmo", ([1.0, 2.0], [0.3, 2.7], [-0.26, 2.56]))):
        outer = OuterOptimizer(kind, 2)
        for c, w in zip(CONSENSUS, want):
            x = np.array(c, dtype=np.float32)
            outer.step(x)
            np.testing.assert_allclose(x, w, rtol=0, atol=1e-6)


def test_a_run_trains_at_its_own_outer_settings_across_a_change_of_the_defaults():
    """Given values win; a new run takes today's defaults; a resume its checkpoint's (a number as recorded, an
    unset one, from before they were recorded, the defaults it ran at then: lr 1.0 / 0.7, momentum 0.9)."""
    assert OUTER_DEFAULTS_BEFORE == {"avg": (1.0, 0.0), "slowmo": (1.0, 0.9), "nesterov": (0.7, 0.9)}
    assert settled_outer("nesterov", None, None) == (0.7, 0.5)
    assert settled_outer("slowmo", 0.3, None) == (0.3, 0.5)
    old = {"outer": "slowmo", "outer_lr": None, "outer_momentum": None}
    assert settled_outer("slowmo", None, None, old) == (1.0, 0.9)
    assert settled_outer("slowmo", None, 0.2, old) == (1.0, 0.2)
    recorded = {"outer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.5}
    assert settled_outer("nesterov", None, None, recorded) == (0.7, 0.5)
    assert settled_outer("nesterov", None, None, {"outer_lr": 0.5}) == (0.5, 0.9)  # one recorded, one not
    with pytest.raises(ValueError, match="kind must be one of"):
        settled_outer("adam", None, None)

