"""The leaders' combine of node means (flodl_mpi.protocol.node_means, issue 25 item 4) against hand-worked cases
and a float64 reference; values every node holds alike come back bit for bit (issue 26 item 5)."""

import numpy as np
import pytest

from flodl_mpi.protocol.node_means import combine_means, node_mean, total_mass
from flodl_mpi.protocol.wire import unpack_piece


def consensus(sums, masses):
    """The leaders' round on float64 node sums: means, combine, the one divide (as the transport runs it)."""
    k = sums[0].size
    means = [node_mean(s, m, np.empty(k, np.float32)).copy() for s, m in zip(sums, masses)]
    out, tmp = np.empty(k), np.empty(k)
    combine_means(means, masses, out, tmp)
    total = total_mass(masses)
    staging = np.zeros(k, np.float32)
    unpack_piece(out, staging, 0, k, total, np.empty(k, np.float32), np.empty(k, np.float32))
    return staging, means


def test_hand_worked_two_nodes():
    # node 0: ranks of W·m 1 and 3 holding 2 and 6 -> sum 20, mass 4, mean 5; node 1: W·m 4 holding 10 -> mean 10
    staging, means = consensus([np.array([20.0]), np.array([40.0])], [4.0, 4.0])
    assert means[0][0] == 5.0 and means[1][0] == 10.0
    assert staging[0] == 7.5  # (4·5 + 4·10) / 8 = (1·2 + 3·6 + 4·10) / 8


def test_a_node_of_mass_zero_is_skipped_even_if_its_sum_is_nan():
    staging, means = consensus([np.array([np.nan, 1.0]), np.array([3.0, 6.0])], [0.0, 3.0])
    assert np.signbit(means[0]).all() and (means[0] == 0.0).all()  # true zeros sent
    np.testing.assert_array_equal(staging, [1.0, 2.0])


def test_none_left_gives_true_zeros():
    out = np.ones(3)
    combine_means([np.ones(3, np.float32)], [0.0], out, np.empty(3))
    assert (out == 0.0).all() and np.signbit(out).all()


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="2 means but 1 masses"):
        combine_means([np.ones(1, np.float32)] * 2, [1.0], np.empty(1), np.empty(1))


@pytest.mark.parametrize("nodes", [2, 3, 5, 8])
def test_values_every_rank_holds_alike_come_back_unchanged(nodes):
    # issue 26 item 5 through the float32 means: unequal masses, nodes of several ranks
    f = np.finfo(np.float32)
    x = np.random.default_rng(nodes).standard_normal(1000).astype(np.float32)
    x[:8] = [0.0, 1 / 3, f.tiny, f.smallest_subnormal, 1e30, -1e-30, f.max, -f.max]
    rng = np.random.default_rng(1 + nodes)
    sums, masses = [], []
    for _ in range(nodes):
        ranks = rng.uniform(0.1, 9.0, size=rng.integers(1, 4)) * 4  # W·m of each rank
        s = np.zeros(x.size)
        for wm in ranks:  # rank order, float64, as the node sum
            s += x.astype(np.float64) * wm
        m = 0.0
        for wm in ranks:
            m += float(wm)
        sums.append(s)
        masses.append(m)
    staging, means = consensus(sums, masses)
    for mu in means:
        assert mu.tobytes() == x.tobytes()
    assert staging.tobytes() == x.tobytes()


def test_error_against_the_float64_reference_is_one_rounding_per_node_at_most():
    # |err_i| <= 2**-24·Σ_k w_k·|μ_k,i| + 2**-24·|ref_i|: each node mean rounded once, then the consensus
    rng = np.random.default_rng(25)
    K, n = 4, 4096
    xs = rng.standard_normal((K, n))
    masses = rng.uniform(1.0, 5.0, K)
    sums = [m * x for m, x in zip(masses, xs)]
    staging, _ = consensus(sums, masses.tolist())
    ref = sum(sums) / masses.sum()
    w = masses / masses.sum()
    bound = 2.0**-24 * (np.abs(xs).T @ w) + 2.0**-24 * np.abs(ref)
    assert (np.abs(staging - ref) <= bound * (1 + 1e-9)).all()
    assert np.abs(staging - ref).max() > 0  # the float32 means do round (the bound is not vacuous here)

