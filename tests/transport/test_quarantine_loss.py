"""The epoch's loss over the batches that were trained, a non-finite batch loss left out and counted.

Before: one NaN batch loss (the rank quarantined with mass 0 for that round) made the
whole epoch's ``avg_loss`` NaN in ``metrics.h5`` and ``train.log``.
"""

import math

import numpy as np
import pytest

from flodl_mpi.outputs.metrics import read_table
from flodl_mpi.protocol.epoch_report import EPOCH_FIELDS, EpochReport, aggregate_epoch, excluded_words
from tests.transport._quarantine_runs import two_fault_run


def _row(losses: list[float]) -> np.ndarray:
    """A rank's epoch report as it sums its batches' losses (flodl_mpi.training.worker.Trainer._train_batch)."""
    finite = [v for v in losses if math.isfinite(v)]
    return EpochReport(loss_sum=sum(finite), batches=len(losses), nonfinite_batches=len(losses) - len(finite),
                       samples=32 * len(losses), compute_ms=1.0).to_row()


def test_a_non_finite_batch_is_left_out_of_the_epoch_loss_and_counted():
    # rank 0: 0.5, 0.25, 0.75; rank 1: 1.0, NaN, 0.5, inf.
    # avg = (0.5 + 0.25 + 0.75 + 1.0 + 0.5) / 5 = 0.6; per rank 0.5 and 0.75; 2 left out.
    s = aggregate_epoch(np.stack([_row([0.5, 0.25, 0.75]), _row([1.0, math.nan, 0.5, math.inf])]), 0, 3)
    assert s.avg_loss == pytest.approx(0.6, rel=1e-15)
    np.testing.assert_allclose(s.per_rank_loss, [0.5, 0.75], rtol=1e-15)
    assert s.nonfinite_batches == 2 and s.batches == 7
    np.testing.assert_array_equal(s.per_rank_batches, [3, 4])  # trained: the work still counts


def test_a_rank_whose_every_batch_was_non_finite_has_no_loss():
    s = aggregate_epoch(np.stack([_row([0.5]), _row([math.nan])]), 0, 1)
    assert s.avg_loss == 0.5 and math.isnan(s.per_rank_loss[1]) and s.nonfinite_batches == 1
    assert len(EPOCH_FIELDS) == len(_row([0.5]))


def test_the_log_words():
    assert excluded_words(0) == ""
    assert excluded_words(1) == " (1 non-finite batch excluded)"
    assert excluded_words(3) == " (3 non-finite batches excluded)"


def test_a_quarantined_rank_leaves_a_finite_epoch_loss_the_mean_of_the_finite_batches(tmp_path_factory):
    """2 ranks, rank 1's loss NaN in round 9's window: the epoch's avg_loss is the mean of the
    batches table's finite losses (computed here from it), the count of the rest is in the row
    and in the log line. The run is the one test_non_finite's 2-rank cases read
    (`tests.transport._quarantine_runs`: ``nanloss@1:9`` and ``nan@1:5``, whose NaN parameters are
    adopted away before any loss; was a run of this test's own with ``nanloss@1:5``, the same command
    as one of test_non_finite's)."""
    run_dir, proc = two_fault_run(tmp_path_factory)
    assert proc.returncode == 0, proc.stderr
    batches = read_table(run_dir / "metrics.h5", "batches")
    epochs = read_table(run_dir / "metrics.h5", "epochs")
    loss = batches["loss"]
    bad = int((~np.isfinite(loss)).sum())
    assert bad >= 1 and len(loss) == int(epochs["batches"][0])
    assert epochs["nonfinite_batches"][0] == bad
    assert epochs["avg_loss"][0] == pytest.approx(float(np.mean(loss[np.isfinite(loss)], dtype=np.float64)),
                                                  rel=1e-12)
    words = excluded_words(bad)
    log = (run_dir / "train.log").read_text()
    assert f"loss {epochs['avg_loss'][0]:.4f}{words}" in log, log[-2000:]
