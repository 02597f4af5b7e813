"""The validation split, the best model and early stopping (issue 22 item 2): ``--val-fraction``,
``--keep-best``, ``--early-stop``, the test set at the end, the report's words, a bit-exact resume.

One rank in forked children (tests/conftest.py's ``fork_flodl``): each behaviour is the cohort's
summary's, the same on every rank; the straight run is shared by the module.
"""

import math
import shutil

import numpy as np
import pytest
import torch

from flodl_mpi.outputs.best_checkpoint import best_checkpoint
from flodl_mpi.outputs.checkpoint import load_state_dict, read_checkpoint
from flodl_mpi.outputs.metrics import read_table
from flodl_mpi.training.best_model import BestWatch
from flodl_mpi.training.data import Dataset, Split
from flodl_mpi.training.validation import VAL_STREAM, split_validation
from tests.conftest import fork_flodl

#: 8 epochs asked, Adam 0.01: on the digits at seed 0 the best val_loss is epoch 4's and epochs 5 and 6
#: are worse, so a patience of 2 ends the run after epoch 6 (computed again from the table below).
ARGS = (
    "train",
    "--epochs",
    "8",
    "--val-fraction",
    "0.2",
    "--keep-best",
    "val_loss",
    "--early-stop",
    "2",
    "--keep-checkpoints",
    "1",
    "--lr",
    "0.01",
)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("val") / "straight"
    proc = fork_flodl(*ARGS, "--run-dir", str(run_dir), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run_dir, proc.stdout


def expected_course(val_loss, patience):
    """By hand: each epoch's verdict (strictly lower is better), the best epoch and where the patience runs out."""
    best, best_epoch, bad, tested = math.inf, 0, 0, []
    for epoch, v in enumerate(val_loss, 1):
        tested.append(bad + 1 >= patience)  # an epoch that may end the run evaluates the test set
        if v < best:
            best, best_epoch, bad = v, epoch, 0
        else:
            bad += 1
        if bad >= patience:
            return best_epoch, epoch, tested
    return best_epoch, None, tested


def test_the_split_is_held_out_once_from_the_seed():
    x = np.arange(20, dtype=np.float32).reshape(10, 2)
    data = Dataset(train=Split(x=x, y=np.arange(10)), test=Split(x=x[:2], y=np.arange(2)), num_classes=10, source="t")
    held = split_validation(data, 0.3, seed=5)
    perm = np.random.default_rng([5, VAL_STREAM]).permutation(10)
    assert held.val.y.tolist() == sorted(perm[:3].tolist())
    assert held.train.y.tolist() == sorted(perm[3:].tolist())
    assert np.array_equal(held.train.x, x[held.train.y]) and held.train.x.flags["C_CONTIGUOUS"]
    assert split_validation(data, 0.3, seed=5).val.y.tolist() == held.val.y.tolist()  # the same every time
    assert split_validation(data, None, seed=5) is data


def test_the_watch_counts_epochs_without_a_better_value():
    w = BestWatch("val_accuracy", patience=2, keep=True)
    assert [w.observe(e, v) for e, v in enumerate([0.5, 0.7, 0.7, math.nan], 1)] == [True, True, False, False]
    assert (w.best, w.best_epoch, w.bad_epochs, w.early_stopped) == (0.7, 2, 2, True)
    again = BestWatch("val_accuracy", patience=3)
    assert again.restore(w.meta()) and not again.early_stopped  # a resume's larger patience goes on
    assert not BestWatch("val_loss").restore(w.meta())  # another metric: nothing taken


def test_validation_keep_best_and_early_stop(straight):
    run_dir, stdout = straight
    e = read_table(run_dir / "metrics.h5", "epochs")
    assert np.isfinite(e["val_loss"]).all() and np.isfinite(e["val_accuracy"]).all()
    best_epoch, stop_epoch, tested = expected_course(e["val_loss"], 2)
    assert (best_epoch, stop_epoch) == (4, 6)  # the case the module is about (see ARGS)
    assert e["epoch"].tolist() == list(range(1, stop_epoch + 1))  # ended early, after epoch 6 of 8
    assert np.isfinite(e["test_accuracy"]).tolist() == tested[:stop_epoch]  # the test set: when it may end
    assert tested[stop_epoch - 1]  # ... and so at the end
    assert "1150 train / 287 validation (--val-fraction 0.2 of the training set, seed 0) / 360 test" in stdout
    assert (
        f"early stop after epoch 6: no better val_loss in 2 epoch(s) (--early-stop 2); the best, "
        f"{e['val_loss'][3]:.4f}, was epoch 4"
    ) in stdout
    # the best epoch's checkpoint, beside the newest one (--keep-checkpoints 1 pruned epoch 4's)
    best = best_checkpoint(run_dir / "checkpoints")
    assert best.name.startswith("ckpt-e000004-") and best.parent.name == "best"
    assert [p.name[:12] for p in (run_dir / "checkpoints").glob("*.h5")] == ["ckpt-e000006"]
    meta = read_checkpoint(best).meta
    assert (meta["epoch"], meta["best_epoch"], meta["is_best"]) == (4, 4, True)
    assert meta["best_value"] == pytest.approx(e["val_loss"][3], rel=1e-12)


def test_the_report_says_which_set_each_number_comes_from(straight):
    run_dir, _ = straight
    proc = fork_flodl("report", str(run_dir), timeout=120)
    assert proc.returncode == 0, proc.stderr
    e = read_table(run_dir / "metrics.h5", "epochs")
    assert (
        f"  validation    val_loss {e['val_loss'][-1]:.4f} (last)   best {e['val_loss'][3]:.4f} at epoch 4 "
        "(kept in checkpoints/best/)"
    ) in proc.stdout
    assert f"  test accuracy {e['test_accuracy'][-1]:.4f} (test set, epoch 6: the model of that epoch)" in proc.stdout
    assert "best" not in proc.stdout.split("test accuracy", 1)[1].splitlines()[0]  # no best chosen on the test set


def test_a_stop_and_resume_keeps_the_best_and_the_patience(straight, tmp_path):
    """Stopped in epoch 5 (round 150 of 36 an epoch), resumed: the same epochs, verdicts, best file and weights."""
    run_dir, _ = straight
    stopped = fork_flodl(*ARGS, "--run-dir", str(tmp_path / "r"), hooks=("--stop-at-round", "150"), timeout=300)
    assert stopped.returncode == 4, stopped.stdout + stopped.stderr
    resumed = fork_flodl(*ARGS, "--run-dir", str(tmp_path / "r"), "--resume", timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    a, b = (read_table(d / "metrics.h5", "epochs") for d in (run_dir, tmp_path / "r"))
    for column in ("epoch", "val_loss", "val_accuracy", "test_accuracy", "avg_loss"):
        np.testing.assert_array_equal(a[column], b[column], err_msg=column)
    ka, kb = (best_checkpoint(d / "checkpoints") for d in (run_dir, tmp_path / "r"))
    assert ka.name == kb.name
    sa, sb = load_state_dict(ka), load_state_dict(kb)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_what_needs_a_validation_set_is_refused_without_one():
    from flodl_mpi.config import ConfigError, TrainConfig
    from flodl_mpi.training.validation import settle_validation

    data = Dataset(
        Split(np.zeros((10, 2), np.float32), np.arange(10) % 2),
        Split(np.zeros((4, 2), np.float32), np.arange(4) % 2),
        2,
        "d.h5",
    )
    with pytest.raises(ValueError) as info:
        settle_validation(data, TrainConfig(keep_best="val_loss", early_stop=3))
    assert str(info.value) == (
        "--keep-best, --early-stop need a validation set: add --val-fraction F or a val/ group to the data "
        "(the test set is not for choosing a model)"
    )
    own = Dataset(data.train, data.test, 2, "d.h5", val=Split(np.zeros((3, 2), np.float32), np.arange(3) % 2))
    assert settle_validation(own, TrainConfig(keep_best="val_loss")) is own  # the data's own validation set
    with pytest.raises(ValueError) as info:
        settle_validation(own, TrainConfig(val_fraction=0.2))
    assert (
        str(info.value) == "--val-fraction 0.2: 'd.h5' holds a validation set already (3 samples); use one or the other"
    )
    with pytest.raises(ConfigError, match=r"^--val-fraction 1.0: must be a number in \(0, 1\)$"):
        TrainConfig(val_fraction=1.0)
    with pytest.raises(ConfigError, match="^--keep-best 'test_accuracy': must be one of val_loss, val_accuracy$"):
        TrainConfig(val_fraction=0.1, keep_best="test_accuracy")


def test_a_resume_of_a_run_that_stopped_early_has_nothing_to_do(straight, tmp_path):
    run_dir, _ = straight
    shutil.copytree(run_dir, tmp_path / "r")
    before = read_table(tmp_path / "r" / "metrics.h5", "epochs")["epoch"].tolist()
    proc = fork_flodl(*ARGS, "--run-dir", str(tmp_path / "r"), "--resume", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (
        "nothing to do: the run stopped early after epoch 6 (no better val_loss since epoch 4, --early-stop 2); "
        "raise --early-stop to train further; no checkpoint, metrics.h5 or config record written"
    ) in proc.stdout
    assert read_table(tmp_path / "r" / "metrics.h5", "epochs")["epoch"].tolist() == before
