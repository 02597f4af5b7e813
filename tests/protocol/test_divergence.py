import math

import numpy as np
import pytest

from flodl_mpi.protocol.divergence import TrendGuard, Verdict, divergence_triple, triple_from_sums


def test_spec_example():
    # SPEC §3: pre [3, 4], post [6, 8] -> (0.5, 10, 5), in that order.
    assert divergence_triple([np.array([3.0, 4.0])], [np.array([6.0, 8.0])]) == (0.5, 10.0, 5.0)


def test_norms_span_all_tensors_in_float64():
    rng = np.random.default_rng(0)
    pre = [rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal(5).astype(np.float32)]
    post = [rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal(5).astype(np.float32)]
    a = np.concatenate([t.ravel().astype(np.float64) for t in pre])
    b = np.concatenate([t.ravel().astype(np.float64) for t in post])
    d, post_norm, pre_norm = divergence_triple(pre, post)
    assert post_norm == pytest.approx(np.linalg.norm(b), rel=1e-14)
    assert pre_norm == pytest.approx(np.linalg.norm(a), rel=1e-14)
    assert d == pytest.approx(np.linalg.norm(a - b) / np.linalg.norm(b), rel=1e-13)


def test_agreement_gives_zero():
    t = [np.arange(6, dtype=np.float32).reshape(2, 3)]
    assert divergence_triple(t, t)[0] == 0.0


def test_zero_consensus_gives_zero_divergence():
    d, post_norm, pre_norm = divergence_triple([np.array([1.0, 1.0])], [np.zeros(2)])
    assert (d, post_norm) == (0.0, 0.0)
    assert pre_norm == pytest.approx(math.sqrt(2))


def test_empty_params():
    assert divergence_triple([], []) == (0.0, None, None)


def test_mismatch_raises():
    with pytest.raises(ValueError, match="shape"):
        divergence_triple([np.zeros(2)], [np.zeros(3)])
    with pytest.raises(ValueError, match="tensors"):
        divergence_triple([np.zeros(2)], [])


def test_triple_from_sums_matches():
    assert triple_from_sums(25.0, 100.0, 25.0) == (0.5, 10.0, 5.0)


def test_guard_suppresses_a_rising_trend_above_threshold():
    g = TrendGuard(threshold=0.05)
    verdicts = [g.observe(v) for v in (0.01, 0.02, 0.04, 0.06, 0.08, 0.07)]
    # Rising 0.02 < 0.04 < 0.06 with 0.06 > 0.05 trips it; 0.07 breaks the rise.
    assert verdicts == [Verdict.STABLE, Verdict.STABLE, Verdict.STABLE,
                        Verdict.SUPPRESS_GROWTH, Verdict.SUPPRESS_GROWTH, Verdict.STABLE]


def test_guard_needs_strictly_rising_and_above_threshold():
    g = TrendGuard(threshold=0.05)
    assert [g.observe(v) for v in (0.01, 0.02, 0.03)][-1] == Verdict.STABLE  # rising, below
    g = TrendGuard(threshold=0.05)
    assert [g.observe(v) for v in (0.1, 0.2, 0.2)][-1] == Verdict.STABLE     # not strictly


def test_guard_state_round_trip():
    g = TrendGuard()
    for v in (0.06, 0.07):
        g.observe(v)
    h = TrendGuard()
    h.load_state_dict(g.state_dict())
    assert h.observe(0.08) == Verdict.SUPPRESS_GROWTH  # a resumed guard is not blind


def test_guard_validates():
    with pytest.raises(ValueError, match="threshold"):
        TrendGuard(threshold=-1)
    with pytest.raises(ValueError, match="history"):
        TrendGuard(history=2)
