"""record_scalar's book, the batch-weighted aggregate (SPEC §5) and the learning-rate factor: pure, serial."""

import math

import numpy as np
import pytest

from flodl_mpi.training import scalars
from flodl_mpi.training.task import learning_rate_factor


def test_batch_weighted_hand_worked_two_ranks():
    # rank 0: 2 batches, recorded 1.0 twice (mean 1); rank 1: 1 batch, recorded 11.0 twice (mean 11).
    # batch-weighted mean of the means: (2*1 + 1*11) / 3 = 13/3; the pooled mean would be
    # (1+1+11+11)/4 = 6 and the plain mean of means (1+11)/2 = 6: both differ.
    got = scalars.batch_weighted([(2, {"s": (2.0, 2)}), (1, {"s": (22.0, 2)})])
    assert got == {"s": (pytest.approx(13 / 3), 4)}


def test_batch_weighted_skips_ranks_that_did_not_record_and_falls_back_to_pooled():
    got = scalars.batch_weighted([(5, {}), (2, {"a": (3.0, 1)}), (0, {"b": (4.0, 2)}), (0, {"b": (2.0, 1)})])
    assert got["a"] == (3.0, 1)                     # only rank 1 recorded it
    assert got["b"] == (pytest.approx(2.0), 3)      # recorded outside training: pooled 6/3


def test_book_drains_per_epoch_and_checks_its_input():
    book = scalars.ScalarBook()
    book.record("x", 1.5)
    book.record("x", np.float32(2.5))
    book.request("checkpoint")
    assert book.drain() == ({"x": (4.0, 2)}, ("checkpoint",))
    assert book.drain() == ({}, ())
    with pytest.raises(ValueError, match="name must be 1 to 64 UTF-8 bytes"):
        book.record("", 1.0)
    with pytest.raises(TypeError, match="value must be a real number"):
        book.record("x", "1.0x")
    with pytest.raises(ValueError, match="intent must be one of eval, checkpoint, got 'save'"):
        book.request("save")


def test_record_scalar_outside_a_run_says_what_it_needs():
    scalars.activate(None)
    with pytest.raises(RuntimeError, match="record_scalar needs an active flodl_mpi.fit"):
        scalars.record_scalar("x", 1.0)


def test_scalar_rows_one_per_name():
    rows = scalars.scalar_rows(3, {"b": 2.0, "a": 1.0}, {"a": 4, "b": 2},
                               {"a": (np.array([1.0, np.nan]), np.array([4, 0]))}, 2)
    assert rows["name"].tolist() == [b"a", b"b"]
    np.testing.assert_array_equal(rows["epoch"], [3, 3])
    np.testing.assert_array_equal(rows["count"], [4, 2])
    assert rows["per_rank_mean"].shape == (2, 2) and math.isnan(rows["per_rank_mean"][1, 0])


def test_learning_rate_factor_linear_scaling_with_warmup():
    # Goyal et al.: from 1x to Wx linearly over the warm-up, then Wx; times the schedule
    assert learning_rate_factor(0, 4, True, 10, None) == pytest.approx(1 + 3 * 0.1)
    assert learning_rate_factor(9, 4, True, 10, None) == pytest.approx(4.0)
    assert learning_rate_factor(500, 4, True, 10, lambda s: 0.5) == pytest.approx(2.0)
    assert learning_rate_factor(3, 1, True, 10, None) == 1.0        # a world of 1: nothing to scale
    assert learning_rate_factor(3, 4, False, 0, lambda s: s / 10) == pytest.approx(0.3)
    with pytest.raises(ValueError, match=r"lr_schedule\(2\) returned nan"):
        learning_rate_factor(2, 2, False, 0, lambda s: math.nan)
