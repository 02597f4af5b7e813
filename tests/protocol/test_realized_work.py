import math

import pytest

from flodl_mpi.protocol.realized_work import gamma_mass, is_realized, mover_mass, relative_masses, round_masses


@pytest.mark.parametrize(
    "n, gamma, expected",
    [
        (4, 1.0, 4.0),          # plain work weighting: exactly n
        (4, 0.5, 2.0),          # sqrt damps a fast rank
        (9, 0.5, 3.0),
        (4, 0.0, 1.0),          # unweighted mean over movers
        (7, 0.0, 1.0),
        (4, -1.0, 0.25),        # each step weighted equally
        (3, 2.0, 9.0),
    ],
)
def test_gamma_mass_moving_rank(n, gamma, expected):
    assert gamma_mass(n, gamma) == expected


@pytest.mark.parametrize("gamma", [1.0, 0.5, 0.0, -1.0, -2.5])
@pytest.mark.parametrize("n", [0, -3, float("nan")])
def test_gamma_mass_idle_rank_has_no_vote(n, gamma):
    # 0 ** 0 == 1 and 0 ** -1 == inf are the traps: an idle rank must weigh exactly 0.
    assert gamma_mass(n, gamma) == 0.0


def test_gamma_one_is_exact_for_large_counts():
    n = 2**53 - 1
    assert gamma_mass(n, 1.0) == float(n)


def test_mover_mass():
    assert [mover_mass(n) for n in (0, 1, 17, -1)] == [0.0, 1.0, 1.0, 0.0]


def test_is_realized():
    assert is_realized(1e-30)
    assert not is_realized(0.0)
    assert not is_realized(-1.0)
    assert not is_realized(math.nan)


def test_relative_masses_are_masses_over_the_largest():
    steps = [3, 1, 0, 4]
    for gamma in (1.0, 0.5, 0.0, -1.0):
        masses = [gamma_mass(n, gamma) for n in steps]
        expected = [m / max(masses) for m in masses]
        assert relative_masses(steps, gamma) == pytest.approx(expected, rel=1e-12)
        assert relative_masses(steps, gamma)[2] == 0.0


def test_relative_masses_never_overflow():
    # 5 ** 1000 overflows a float64; the ratios do not.
    rel = relative_masses([5, 4, 0], 1000.0)
    assert rel[0] == 1.0 and 0.0 <= rel[1] < 1e-90 and rel[2] == 0.0
    assert gamma_mass(5, 1000.0) == math.inf
    assert relative_masses([0, 0], 0.5) == [0.0, 0.0]


def test_round_masses_quarantine_renormalizes_over_finite_ranks():
    m = round_masses([4, 2, 8], [True, True, False], gamma=1.0)
    assert m.quarantined == [2]
    assert m.mass == [4.0, 2.0, 0.0]
    assert m.wire == [1.0, 0.5, 0.0]  # divided by the largest *finite* mass
    assert m.buffers == [1.0, 1.0, 0.0]
    plain = round_masses([4, 2, 8], [True] * 3, gamma=0.5)
    assert plain.quarantined == [] and plain.wire == relative_masses([4, 2, 8], 0.5)


def test_round_masses_quarantine_with_only_idle_finite_ranks_takes_their_mean():
    m = round_masses([0, 3, 0], [True, False, True], gamma=1.0)
    assert m.wire == [1.0, 0.0, 1.0] and m.buffers == [1.0, 0.0, 1.0] and m.quarantined == [1]
    none = round_masses([1, 3], [False, False], gamma=1.0)
    assert none.wire == [0.0, 0.0] and none.quarantined == [0, 1]
