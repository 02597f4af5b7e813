"""flodl_mpi.shard (issue 22 item 6): a rank's batches of an epoch under the CLI's plan, serial and pure.

A hand-worked plan, exact once-per-epoch coverage over a grid of sizes, the equal-count modes, and the
argument checks. That it is the plan ``flodl-mpi train`` trains by (the samples each rank read, recorded
from a 2-rank CLI run): tests/training/test_cadence_run.py::test_shard_gives_each_rank_what_the_cli_trained_on_it.
"""

import itertools

import numpy as np
import pytest
import torch

import flodl_mpi
from flodl_mpi.training.shard import plan_batches


def test_a_hand_worked_plan():
    # 10 samples in batches of 3: 3 batches (the lone 10th sample folded into the last: 3, 3, 4);
    # 2 ranks, a round per batch: window one hands out batches 0 and 1; the one left goes to rank 0
    perm = np.random.default_rng([5, 2]).permutation(10)
    r0 = flodl_mpi.shard(10, 2, 5, batch_size=3, rank=0, world_size=2)
    r1 = flodl_mpi.shard(10, 2, 5, batch_size=3, rank=1, world_size=2)
    assert r0.batches == (0, 2) and r1.batches == (1,)
    for got, want in zip([*r0, *r1], [perm[0:3], perm[6:10], perm[3:6]]):
        np.testing.assert_array_equal(got, want)
        assert got.dtype == np.int64
    assert (r0.samples, r1.samples) == (7, 3) and r0.padded == r0.dropped == 0
    # a window of 2 at 3 ranks over 7 batches: 6 in the first window, the 7th to rank 0
    plan = plan_batches(7, 3, window=2)
    assert plan == [[0, 1, 6], [2, 3], [4, 5]]
    # fewer batches left than the window's: split by largest remainder (fit_quotas), [3, 2] of 5
    assert plan_batches(13, 2, window=4) == [[0, 1, 2, 3, 8, 9, 10], [4, 5, 6, 7, 11, 12]]


@pytest.mark.parametrize("drop_last", [False, True])
def test_every_sample_of_the_epoch_once_over_the_ranks(drop_last):
    for n, bs, world, window in itertools.product((0, 1, 7, 100, 1437), (1, 4, 32), (1, 2, 3, 5), (1, 3)):
        shards = [
            flodl_mpi.shard(n, 3, 1, batch_size=bs, rank=r, world_size=world, window=window, drop_last=drop_last)
            for r in range(world)
        ]
        got = np.concatenate([np.zeros(0, np.int64), *(i for s in shards for i in s)])
        perm = np.random.default_rng([1, 3]).permutation(n)
        trained = n - n % bs if drop_last else n  # drop_last: the epoch's left-over samples are not trained
        np.testing.assert_array_equal(np.sort(got), np.sort(perm[:trained]), err_msg=f"{n} {bs} {world} {window}")
        counts = [len(s) for s in shards]
        assert max(counts) - min(counts) <= window
        for mode, want in (("drop", min(counts)), ("pad", max(counts) if trained else 0)):
            even = [
                flodl_mpi.shard(
                    n, 3, 1, batch_size=bs, rank=r, world_size=world, window=window, drop_last=drop_last, uneven=mode
                )
                for r in range(world)
            ]
            assert [len(s) for s in even] == [want] * world
            for s, plain in zip(even, shards):  # a prefix of the plan, then repeats (pad) or nothing (drop)
                k = min(len(s), len(plain))
                assert s.batches[:k] == plain.batches[:k]
                assert s.padded == len(s) - k and s.dropped == len(plain) - k
            if mode == "pad" and trained:  # the cohort's repeats are the epoch's first batches, in rank order
                repeats = [b for s in even for b in s.batches[len(s) - s.padded :]]
                assert repeats == [k % sum(counts) for k in range(len(repeats))]


def test_it_feeds_a_dataloader_as_its_batch_sampler():
    data = torch.utils.data.TensorDataset(torch.arange(50.0), torch.arange(50))
    s = flodl_mpi.shard(50, 0, batch_size=8, rank=0, world_size=1)
    loader = torch.utils.data.DataLoader(data, batch_sampler=s)
    ys = [y for _, y in loader]
    assert len(ys) == len(s) == 7  # 50 in 8s: six batches of 8, the last of 2
    np.testing.assert_array_equal(torch.cat(ys).numpy(), np.random.default_rng([0, 0]).permutation(50))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"rank": 2, "world_size": 2}, ValueError, r"^rank must be in \[0, 2\), got 2$"),
        ({"uneven": "wrap"}, ValueError, "^uneven must be one of join, drop, pad, got 'wrap'$"),
        ({"batch_size": 0}, ValueError, "^batch_size must be >= 1, got 0$"),
        ({"window": 1.5}, TypeError, "^window must be an int, got float 1.5$"),
        ({"drop_last": 1}, TypeError, "^drop_last must be True or False, got int 1$"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, error, match):
    args = {"batch_size": 4, "rank": 0, "world_size": 1, **kwargs}
    with pytest.raises(error, match=match):
        flodl_mpi.shard(20, 0, **args)
