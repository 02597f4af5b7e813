import pytest

from flodl_mpi.policy.cadence import fit_quotas, fixed_quotas, plan_window


def epoch_plan(quotas, n_batches):
    cursor, windows = 0, []
    while cursor < n_batches:
        w = plan_window(quotas, cursor, n_batches)
        windows.append(w)
        cursor = w.end
    return windows


@pytest.mark.parametrize("quotas", [[1, 1], [1, 1, 1], [5, 5], [4, 4, 4], [10, 3, 1], [64, 1, 7, 2]])
@pytest.mark.parametrize("n_batches", [1, 2, 3, 7, 45, 100])
def test_every_batch_exactly_once(quotas, n_batches):
    seen = []
    for w in epoch_plan(quotas, n_batches):
        assert len(w.counts) == len(quotas)
        for start, count in zip(w.starts, w.counts):
            seen.extend(range(start, start + count))
    assert sorted(seen) == list(range(n_batches))


def test_window_offsets_follow_rank_order():
    w = plan_window([3, 2, 1], cursor=10, n_batches=100)
    assert w.starts == (10, 13, 15) and w.counts == (3, 2, 1) and w.end == 16


def test_fit_quotas_unchanged_when_they_fit():
    assert fit_quotas([5, 5], 10) == [5, 5]


def test_fit_quotas_proportional_largest_remainder():
    # 7 left for quotas 5:5 -> ideal 3.5 each; the tie goes to rank 0.
    assert fit_quotas([5, 5], 7) == [4, 3]
    # 10 left for 10:3:1 (sum 14) -> ideal 7.14, 2.14, 0.71 -> floors 7, 2, 1 (at least 1).
    assert fit_quotas([10, 3, 1], 10) == [7, 2, 1]


def test_fit_quotas_each_rank_at_least_one():
    counts = fit_quotas([64, 1, 1, 1], 5)
    assert sum(counts) == 5 and min(counts) >= 1


def test_fewer_batches_than_ranks_leaves_ranks_idle():
    assert fit_quotas([1, 1, 1], 2) == [1, 1, 0]
    assert fit_quotas([1, 4, 1], 1) == [0, 1, 0]  # the largest quota gets it


def test_sync_epoch_with_odd_batches_has_an_idle_rank_in_the_last_window():
    windows = epoch_plan(fixed_quotas(2, 1), 45)  # digits: 1437 samples / 32 = 45 batches
    assert len(windows) == 23
    assert windows[-1].counts == (1, 0)


def test_validation():
    with pytest.raises(ValueError, match="window"):
        fixed_quotas(2, 0)
    with pytest.raises(ValueError, match="quotas"):
        fit_quotas([1, 0], 3)
    with pytest.raises(ValueError, match="cursor"):
        plan_window([1, 1], 5, 5)


@pytest.mark.parametrize("batch_size", [4, 2, 359, 718, 1436, 32])
@pytest.mark.parametrize("quotas", [[1, 1], [4, 4, 4], [10, 3]])
@pytest.mark.parametrize("drop_last", [False, True])
def test_windows_over_the_batch_plan_give_every_sample_once_and_resume_at_any_window_end(batch_size, quotas,
                                                                                        drop_last):
    """The windows hand out the plan's batches (a lone sample folded in) and a resume cursor continues them."""
    import numpy as np

    from flodl_mpi.training.data import batch_indices, epoch_permutation, num_batches

    n = 1437  # the digits' training samples
    n_batches = num_batches(n, batch_size, drop_last)
    perm = epoch_permutation(n, 0, 1)
    plan = epoch_plan(quotas, n_batches)
    samples = [batch_indices(perm, batch_size, b, drop_last)
               for w in plan for start, count in zip(w.starts, w.counts) for b in range(start, start + count)]
    seen = np.sort(np.concatenate(samples))
    expected = np.arange(n) if not drop_last else np.sort(perm[: n_batches * batch_size])
    np.testing.assert_array_equal(seen, expected)
    assert min(len(s) for s in samples) >= 2
    # A checkpoint saves the cursor at a window end; the resumed plan goes on exactly as the straight one.
    step = max(1, len(plan) // 10)
    for i in [*range(0, len(plan) - 1, step), len(plan) - 2]:
        if i >= 0:
            assert epoch_plan_from(quotas, n_batches, plan[i].end) == plan[i + 1:]


def epoch_plan_from(quotas, n_batches, cursor):
    windows = []
    while cursor < n_batches:
        w = plan_window(quotas, cursor, n_batches)
        windows.append(w)
        cursor = w.end
    return windows
