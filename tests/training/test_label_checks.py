"""An implausible class count is refused before the model is built (trial6 F2): one
stray huge label (a sentinel, -1 stored unsigned) made the model allocate an output per
class up to it. A stated ``num_classes`` attribute is the class count and bounds the labels."""

from __future__ import annotations

import time

import h5py
import numpy as np
import pytest

from flodl_mpi.training.data import DataError, dataset_from_arrays, load_dataset
from tests.conftest import fork_flodl


def _write(path, train_y, test_y=None, dtype=np.int64, root_attr=None, y_attr=None):
    train_y = np.asarray(train_y, dtype=dtype)
    test_y = np.asarray(test_y if test_y is not None else train_y[:4], dtype=dtype)
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f["train/x"] = rng.random((len(train_y), 8), dtype=np.float32)
        f["train/y"] = train_y
        f["test/x"] = rng.random((len(test_y), 8), dtype=np.float32)
        f["test/y"] = test_y
        if root_attr is not None:
            f.attrs["num_classes"] = root_attr
        if y_attr is not None:
            f["train/y"].attrs["num_classes"] = y_attr
    return str(path)


def _labels(n=64, k=2):
    return np.arange(n) % k


def _refused(path, match):
    start = time.monotonic()
    with pytest.raises(DataError) as info:
        load_dataset(path)
    assert time.monotonic() - start < 30
    assert "\n" not in str(info.value)
    assert str(info.value) == match
    return str(info.value)


def test_one_stray_huge_label_is_refused_naming_the_row(tmp_path):
    y = _labels()
    y[17] = 2_000_000_000
    path = _write(tmp_path / "d.h5", y)
    _refused(path, f"'train/y' in {path!r}: label 2000000000 at row 17 makes 2000000001 classes (largest label + 1), "
                   "more than 1048576: a stray or sentinel label? Fix that row, or state the class count as the "
                   "attribute num_classes (file root or the labels' dataset)")


def test_a_sentinel_minus_one_stored_unsigned_is_refused(tmp_path):
    y = _labels().astype(np.uint32)
    y[5] = np.uint32(0xFFFFFFFF)
    path = _write(tmp_path / "d.h5", y, dtype=np.uint32)
    msg = _refused(path, f"'train/y' in {path!r}: label 4294967295 at row 5 makes 4294967296 classes (largest label "
                         "+ 1), more than 1048576: a stray or sentinel label? Fix that row, or state the class count "
                         "as the attribute num_classes (file root or the labels' dataset)")
    assert "row 5" in msg


def test_a_sparse_class_count_is_refused_in_the_test_split_too(tmp_path):
    test_y = np.array([0, 1, 1, 0, 1, 5000, 0])
    path = _write(tmp_path / "d.h5", _labels(), test_y)
    _refused(path, f"'test/y' in {path!r}: label 5000 at row 5 makes 5001 classes (largest label + 1), more than "
                   "64x the 3 distinct labels: a stray or sentinel label? Fix that row, or state the class count as "
                   "the attribute num_classes (file root or the labels' dataset)")


@pytest.mark.parametrize(("train_y", "classes"), [
    (_labels(), 2),
    (np.array([0, 1, 1000, 1, 0]), 1001),                # under the floor: a few classes far apart pass
    (np.arange(3000) % 2000, 2000),                       # many classes, all used: dense
    (np.r_[np.arange(40), [2559]], 2560),                 # 41 distinct, 2560 <= 64 * 41
])
def test_plausible_class_counts_pass_and_are_noted(tmp_path, train_y, classes):
    path = _write(tmp_path / "d.h5", train_y, train_y[:4])
    data = load_dataset(path)
    assert data.num_classes == classes
    assert data.classes_note == f"{classes} classes (largest label {classes - 1} in 'train/y')"


@pytest.mark.parametrize("where", ["root", "y"])
def test_a_stated_class_count_is_the_count_and_bounds_every_label(tmp_path, where):
    kw = {"root_attr" if where == "root" else "y_attr": np.int64(10)}
    path = _write(tmp_path / "d.h5", _labels(k=3), **kw)
    data = load_dataset(path)
    assert data.num_classes == 10 and data.classes_note == f"10 classes (attribute num_classes of {path!r})"
    sparse = _write(tmp_path / "s.h5", np.array([0, 1, 5000, 1]), **{k: np.int64(6000) for k in kw})
    assert load_dataset(sparse).num_classes == 6000   # stated: the heuristic does not apply
    y = _labels(k=3)
    y[9] = 10
    bad = _write(tmp_path / "b.h5", y, **kw)
    _refused(bad, f"'train/y' in {bad!r}: label 10 at row 9 is not below the data's num_classes 10 (labels are 0..9)")
    bad_test = _write(tmp_path / "t.h5", _labels(k=3), np.array([0, 12, 1]), **kw)
    _refused(bad_test, f"'test/y' in {bad_test!r}: label 12 at row 1 is not below the data's num_classes 10 "
                       "(labels are 0..9)")


@pytest.mark.parametrize(("kw", "want"), [
    ({"root_attr": 2.5}, "attribute num_classes of the file's root in {p!r} must be an integer >= 1, got 2.5"),
    ({"y_attr": np.int64(0)}, "attribute num_classes of 'train/y' in {p!r} must be an integer >= 1, got 0"),
    ({"root_attr": np.int64(3), "y_attr": np.int64(4)},
     "attribute num_classes differs in {p!r}: 3 on the file's root, 4 on 'train/y'"),
])
def test_a_bad_stated_class_count_is_refused(tmp_path, kw, want):
    path = _write(tmp_path / "d.h5", _labels(), **kw)
    _refused(path, want.format(p=path))


def test_in_memory_labels_get_the_same_check():
    x = np.zeros((5, 3), np.float32)
    y = np.array([0, 1, 0, 1, 70_000])
    with pytest.raises(DataError, match=r"^'train y' in 'in-memory arrays': label 70000 at row 4 makes 70001 "
                                        r"classes .*more than 64x the 3 distinct labels"):
        dataset_from_arrays((x, y), (x[:4], y[:4]))


@pytest.mark.slow
def test_the_cli_refuses_a_stray_label_in_one_line_exit_2(tmp_path):
    """At a world of 1 in a fork (tests/conftest.py's fork_flodl; was two 2-rank launches): the refusal is the
    data's, before any peer matters; every rank of a launched run refusing with one line between them is
    tests/cli/test_cli.py's test_missing_data_file_is_one_line_and_exit_2_on_every_rank."""
    y = _labels()
    y[17] = 2_000_000_000
    path = _write(tmp_path / "big.h5", y)
    start = time.monotonic()
    proc = fork_flodl("train", "--data", path, "--epochs", "1", "--run-dir", str(tmp_path / "run"), "-q",
                      timeout=300)
    assert time.monotonic() - start < 200
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"'train/y' in {path!r}: label 2000000000 at row 17 makes 2000000001 classes" in \
        lines[0], proc.stderr
    assert "allocate" not in proc.stderr and not (tmp_path / "run").exists()
    # A stated class count: trained, and train.log says where the count came from.
    stated = _write(tmp_path / "stated.h5", _labels(k=3), root_attr=np.int64(5))
    proc = fork_flodl("train", "--data", stated, "--epochs", "1", "--run-dir", str(tmp_path / "ok"), "-q",
                      timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"5 classes (attribute num_classes of {stated!r})" in (tmp_path / "ok" / "train.log").read_text()


def test_a_test_label_training_never_has_and_one_based_labels_are_warned(tmp_path):
    """issue 26 item 9: both silently added classes (an output training never targets); each is one line
    naming the labels, the first row and the remedy, logged under train.log's header. A stated class
    count says it is meant: no warning."""
    import logging
    from types import SimpleNamespace

    import torch

    from flodl_mpi.config import TrainConfig
    from flodl_mpi.training.train import log, log_header

    test_y = np.array([0, 1, 7, 1, 7, 9])
    path = _write(tmp_path / "d.h5", _labels(k=3), test_y)
    data = load_dataset(path)
    assert data.num_classes == 10
    assert data.warnings == (
        f"warning: 'test/y' in {path!r} holds labels 7, 9 that 'train/y' never has (3 test rows, the first at row "
        "2): the model gets an output for them that training never targets, and those rows count as errors; check "
        "the labels of both splits",)
    one_based = _write(tmp_path / "one.h5", _labels(k=3) + 1)
    data = load_dataset(one_based)
    assert data.warnings == (
        f"warning: no label is 0 in 'train/y' or 'test/y' of {one_based!r} (labels 1..3): class 0 gets an output "
        "that training never targets; 1-based labels? subtract 1 (labels are 0..C-1)",)
    assert load_dataset(_write(tmp_path / "ok.h5", _labels(k=3))).warnings == ()
    stated = _write(tmp_path / "s.h5", _labels(k=3) + 1, test_y, root_attr=np.int64(10))
    assert load_dataset(stated).warnings == ()
    # the CLI's header says them (stdout and train.log), as warnings
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append((record.levelno, record.getMessage()))
    log.addHandler(handler)
    try:
        log_header(TrainConfig(), 1, SimpleNamespace(params=[torch.zeros(3)]), ["cpu"], data, tmp_path)
    finally:
        log.removeHandler(handler)
    assert (logging.WARNING, data.warnings[0]) in lines
