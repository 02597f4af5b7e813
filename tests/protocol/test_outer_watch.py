"""A run with an outer optimizer that is going wrong says so; healthy ones do not (issue 26 item 11)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flodl_mpi.outputs.metrics import read_table
from flodl_mpi.protocol.outer_watch import EPOCHS, UNDONE, OuterWatch
from tests.conftest import fork_flodl

# Measured (python benchmarks/outer.py --datasets mnist1d-adam ...: 2 ranks, the paper's CNN, Adam, 40
# epochs): each epoch's cohort training loss (epochs/avg_loss), rounded to 4 places.
#: SlowMo at Adam 4e-3, window 50 (--lr 4e-3): test accuracy 0.70 at epoch 10, 0.38 at epoch 40.
SLOWMO_4E3_W50 = [1.9872, 1.556, 1.5064, 1.1037, 0.9111, 0.7859, 0.7232, 0.7191, 0.765, 0.7796, 0.8015, 0.808,
                  0.8806, 0.9358, 0.922, 0.8121, 0.897, 1.116, 1.0247, 1.1254, 1.1277, 1.1987, 1.1438, 1.5637,
                  1.2317, 1.2507, 1.1816, 1.4523, 1.3598, 1.38, 1.3039, 1.4301, 1.4115, 1.3672, 1.3846, 1.5077,
                  1.4219, 1.5753, 1.6616, 1.7638]
#: Healthy: nesterov at window 10 (Adam 1e-3): 0.922 at the end, above --outer avg's 0.868; its loss rises
#: from 0.075 to 0.196 over epochs 31-34 (3 rises in a row) and falls again.
NESTEROV_W10 = [2.1382, 1.6526, 1.3018, 1.0531, 0.8465, 0.6763, 0.5338, 0.3898, 0.319, 0.2479, 0.1908, 0.1529,
                0.135, 0.13, 0.1047, 0.0812, 0.0954, 0.1052, 0.0971, 0.0971, 0.083, 0.0735, 0.0734, 0.0946, 0.1057,
                0.1057, 0.1179, 0.1068, 0.0839, 0.0791, 0.0753, 0.1575, 0.1888, 0.1958, 0.185, 0.1608, 0.0966,
                0.0564, 0.0478, 0.059]
#: Healthy: slowmo at window 50 (Adam 1e-3): 0.898 at the end (plain averaging 0.912); epoch 3 rises early.
SLOWMO_W50 = [2.2353, 1.8233, 1.8655, 1.5103, 1.3386, 1.2241, 1.11, 1.0172, 0.8863, 0.7719, 0.6652, 0.5929,
              0.5002, 0.4549, 0.3915, 0.3317, 0.3063, 0.2748, 0.2329, 0.2069, 0.2012, 0.1972, 0.1664, 0.1636,
              0.1453, 0.1193, 0.134, 0.1225, 0.1239, 0.1072, 0.1018, 0.1243, 0.1206, 0.1008, 0.1135, 0.0951,
              0.1335, 0.1103, 0.133, 0.1397]


def _first_warning(losses, kind="slowmo", lr=1.0, momentum=0.9, api=False):
    watch = OuterWatch(kind, lr, momentum, api=api)
    for epoch, loss in enumerate(losses):
        line = watch.observe(epoch, loss)
        if line is not None:
            return epoch + 1, line
    return None, None


def _reference_epoch(losses):
    """float64 numpy reference of the rule: undone = (loss - lowest before) / (first - lowest before)."""
    x = np.asarray(losses, dtype=np.float64)
    lowest = np.minimum.accumulate(x)
    before = np.concatenate([[x[0]], lowest[:-1]])
    progress = x[0] - before
    undone = np.where(progress > 0, (x - before) / np.where(progress > 0, progress, 1.0), 0.0)
    run = 0
    for e, u in enumerate(undone):
        run = run + 1 if u >= UNDONE else 0
        if run >= EPOCHS:
            return e + 1
    return None


def test_a_hand_worked_climb_warns_at_the_third_epoch_that_undid_a_tenth_of_the_progress():
    """issue 26 item 11: first 2.0, lowest 1.0: 1.2, 1.15, 1.11 undo 20 %, 15 %, 11 %: the warning at epoch 5."""
    epoch, line = _first_warning([2.0, 1.0, 1.2, 1.15, 1.11, 3.0])
    assert epoch == 5 == _reference_epoch([2.0, 1.0, 1.2, 1.15, 1.11, 3.0])
    assert line == ("warning: epoch 5: the training loss (1.1100) has undone 11% of the run's progress (epoch 1 "
                    "2.0000, lowest 1.0000 at epoch 2) and 10% or more in each of the last 3 epochs, with --outer "
                    "slowmo (lr 1, momentum 0.9): the run is going wrong; the outer step is likely too large for "
                    "this inner learning rate: lower --outer-lr or --lr, or use --outer avg")
    # once per run; a dip under a tenth restarts the count; avg and non-finite epochs never count
    assert _first_warning([2.0, 1.0, 1.2, 1.05, 1.2, 1.2])[0] is None
    assert _first_warning([2.0, 1.0, 1.2, 1.15, 1.11], kind="avg")[0] is None
    assert _first_warning([2.0, 1.0, 1.2, math.nan, 1.15, 1.11])[0] == 6
    epoch, line = _first_warning([2.0, 1.0, 1.2, 1.15, 1.11], kind="nesterov", lr=0.7, api=True)
    assert epoch == 5 and "with outer='nesterov' (lr 0.7, momentum 0.9)" in line
    assert line.endswith("lower outer_lr= or lr=, or use outer='avg'") and "--" not in line


def test_the_measured_failing_run_warns_and_the_healthy_ones_do_not():
    """issue 26 item 11: SlowMo at Adam 4e-3, window 50 (0.70 -> 0.38 test accuracy) warns at epoch 15, 5 points
    below its best test accuracy so far; nesterov at window 10 and slowmo at 50 (0.92, 0.90 at the end) never."""
    epoch, line = _first_warning(SLOWMO_4E3_W50)
    assert epoch == 15 == _reference_epoch(SLOWMO_4E3_W50)
    assert "has undone 16% of the run's progress (epoch 1 1.9872, lowest 0.7191 at epoch 8)" in line
    for healthy in (NESTEROV_W10, SLOWMO_W50):
        assert _first_warning(healthy, kind="nesterov", lr=0.7)[0] is None
        assert _reference_epoch(healthy) is None


@pytest.mark.slow
def test_a_run_going_wrong_says_so_once_in_train_log_and_on_stdout(tmp_path):
    """issue 26 item 11: digits, slowmo at window 10 (benchmarks/outer.py, 2 ranks: 0.92 at epoch 3, 0.82 at 10):
    the run goes wrong within 7 epochs and says so once, also under -q (a warning); the epoch's losses in
    metrics.h5 give the same epoch by the rule's float64 reference.

    A world of 1 in a fork (was a 2-rank launch, where the warning came at epoch 6): the watch reads the
    cohort's epoch losses, which a world of 1 has too; the epoch is not pasted from a run but computed
    from the run's own losses by `_reference_epoch`. That the other ranks' copies of a warning never reach
    the console (was "rank 0 only" here): tests/cli/test_cli.py::test_a_warning_is_printed_once (2 ranks)."""
    run_dir = tmp_path / "r"
    # lr 1.0, momentum 0.9: the setting measured to go wrong (the defaults since issue 24 item 4 are 0.7 and 0.5)
    proc = fork_flodl("train", "--epochs", "7", "--window", "10", "--outer", "slowmo", "--outer-lr", "1.0",
                      "--outer-momentum", "0.9", "-q", "--run-dir", str(run_dir), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = read_table(run_dir / "metrics.h5", "epochs")["avg_loss"].tolist()
    epoch, line = _first_warning(losses)
    # the earliest: epoch 2 falls below epoch 1 (progress), then EPOCHS (3) epochs in a row undo a tenth of it
    assert epoch is not None and epoch == _reference_epoch(losses) and 2 + EPOCHS <= epoch <= 7
    assert line.startswith(f"warning: epoch {epoch}: the training loss")
    assert (proc.stdout + proc.stderr).count(line) == 1
    assert (run_dir / "train.log").read_text().count("the run is going wrong") == 1
    assert line in (run_dir / "train.log").read_text()
