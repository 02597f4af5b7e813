"""Tests for flodl_mpi.training.data: digits file, dataset validation, epoch order and batches."""

import os

import h5py
import numpy as np
import pytest
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from flodl_mpi.training.data import (
    DEFAULT_NAMES,
    DataError,
    batch_indices,
    default_digits_path,
    ensure_digits,
    epoch_permutation,
    load_dataset,
    num_batches,
    smallest_batch,
    write_digits,
)


def write_h5(path, **datasets):
    """Write ``name=array`` pairs (``train__x`` -> ``train/x``) into a fresh HDF5 file."""
    with h5py.File(path, "w") as f:
        for key, arr in datasets.items():
            f.create_dataset(key.replace("__", "/"), data=arr)
    return path


def good_arrays(n_train=10, n_test=4, features=3):
    rng = np.random.default_rng(0)
    return {
        "train__x": rng.random((n_train, features)),
        "train__y": np.arange(n_train) % 3,
        "test__x": rng.random((n_test, features)),
        "test__y": np.arange(n_test) % 2,
    }


# --------------------------------------------------------------------------- digits


def test_digits_round_trip(tmp_path):
    path = write_digits(tmp_path / "sub" / "digits.h5")  # parent dir is created
    ds = load_dataset(path)

    digits = load_digits()
    x_tr, _, y_tr, y_te = train_test_split(
        digits.data, digits.target, test_size=0.2, stratify=digits.target, random_state=0
    )
    assert ds.train.n + ds.test.n == 1797
    assert (ds.train.n, ds.test.n) == (1437, 360)
    assert ds.input_shape == (64,)
    assert ds.num_classes == 10
    assert ds.train.x.dtype == np.float32 and ds.train.x.flags.c_contiguous
    assert ds.train.y.dtype == np.int64
    assert 0.0 <= ds.train.x.min() and ds.train.x.max() <= 1.0
    np.testing.assert_array_equal(np.bincount(ds.train.y, minlength=10), np.bincount(y_tr))
    np.testing.assert_array_equal(np.bincount(ds.test.y, minlength=10), np.bincount(y_te))
    np.testing.assert_array_equal(ds.test.y, y_te)
    np.testing.assert_array_equal(ds.train.x, (x_tr / 16).astype(np.float32))
    with h5py.File(path, "r") as f:
        assert f.attrs["source"] == "sklearn.datasets.load_digits"
        assert f.attrs["split"] == "stratified 80/20, random_state=0"
        assert "scikit_learn_version" in f.attrs
    assert os.listdir(path.parent) == ["digits.h5"]  # no temporary file left behind


def test_digits_write_is_deterministic(tmp_path):
    a = load_dataset(write_digits(tmp_path / "a.h5"))
    b = load_dataset(write_digits(tmp_path / "b.h5"))
    np.testing.assert_array_equal(a.train.x, b.train.x)
    np.testing.assert_array_equal(a.test.y, b.test.y)


def test_ensure_digits_reuses_existing_file(tmp_path):
    path = tmp_path / "digits.h5"
    write_digits(path)
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))  # a stamp a rewrite cannot keep
    assert ensure_digits(path) == path
    assert path.stat().st_mtime_ns == 1_000_000_000


def test_ensure_digits_rewrites_corrupt_file(tmp_path):
    path = tmp_path / "digits.h5"
    path.write_bytes(b"not hdf5 at all")
    assert ensure_digits(path) == path
    assert load_dataset(path).train.n == 1437
    assert sorted(os.listdir(tmp_path)) == ["digits.h5"]


def test_ensure_digits_default_path(tmp_path, monkeypatch):
    monkeypatch.setenv("FLODL_MPI_DATA_DIR", str(tmp_path / "data"))
    path = ensure_digits()
    assert path == tmp_path / "data" / "digits.h5"
    assert path.is_file()


def test_default_digits_path(tmp_path, monkeypatch):
    monkeypatch.setenv("FLODL_MPI_DATA_DIR", str(tmp_path))
    assert default_digits_path() == tmp_path / "digits.h5"
    monkeypatch.delenv("FLODL_MPI_DATA_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_digits_path() == tmp_path / "cache" / "flodl_mpi" / "digits.h5"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_digits_path() == tmp_path / "home" / ".cache" / "flodl_mpi" / "digits.h5"


# --------------------------------------------------------------------------- load_dataset


def test_load_casts_and_counts_classes(tmp_path):
    arrays = good_arrays()
    arrays["train__x"] = np.arange(30, dtype=np.int16).reshape(10, 3)
    arrays["test__y"] = np.array([0, 7, 1, 2], dtype=np.uint8)
    ds = load_dataset(write_h5(tmp_path / "d.h5", **arrays))
    assert ds.train.x.dtype == np.float32 and ds.test.y.dtype == np.int64
    np.testing.assert_array_equal(ds.train.x, np.arange(30).reshape(10, 3))
    assert ds.num_classes == 8  # max label 7 is in test only
    assert ds.source == str(tmp_path / "d.h5")


def test_custom_names(tmp_path):
    rng = np.random.default_rng(1)
    path = tmp_path / "c.h5"
    with h5py.File(path, "w") as f:
        f["a/feat"] = rng.random((5, 2, 2))
        f["a/lab"] = np.array([0, 1, 2, 3, 4])
        f["b/feat"] = rng.random((2, 2, 2))
        f["b/lab"] = np.array([1, 1])
    names = {"train_x": "a/feat", "train_y": "a/lab", "test_x": "b/feat", "test_y": "b/lab"}
    ds = load_dataset(path, names)
    assert (ds.train.n, ds.test.n, ds.input_shape, ds.num_classes) == (5, 2, (2, 2), 5)


def test_partial_names_keep_defaults(tmp_path):
    arrays = good_arrays()
    arrays["other__y"] = np.arange(10) % 5
    ds = load_dataset(write_h5(tmp_path / "d.h5", **arrays), {"train_y": "other/y"})
    assert ds.num_classes == 5


def test_unknown_name_key(tmp_path):
    path = write_h5(tmp_path / "d.h5", **good_arrays())
    with pytest.raises(ValueError, match="unknown keys.*'train_z'"):
        load_dataset(path, {"train_z": "x"})


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match=r"--data '.*nope\.h5': no such file"):
        load_dataset(tmp_path / "nope.h5")


def test_not_hdf5(tmp_path):
    path = tmp_path / "bad.h5"
    path.write_text("hello")
    with pytest.raises(DataError, match=r"bad\.h5'.*cannot open as HDF5"):
        load_dataset(path)


def test_missing_dataset_lists_what_exists(tmp_path):
    arrays = good_arrays()
    del arrays["test__y"]
    path = write_h5(tmp_path / "d.h5", **arrays)
    has = r"\(has: test/x, train/x, train/y\)"
    with pytest.raises(DataError, match=r"dataset 'test/y' not found in '.*d\.h5' " + has):
        load_dataset(path)


def test_dataset_is_a_group(tmp_path):
    path = write_h5(tmp_path / "d.h5", **good_arrays())
    with pytest.raises(DataError, match="dataset 'train' is a group, not a dataset"):
        load_dataset(path, {"train_x": "train"})


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("train__y", np.arange(9) % 3, r"'train/x' has 10 rows but 'train/y' has 9"),
        ("test__x", np.ones((5, 3)), r"'test/x' has 5 rows but 'test/y' has 4"),
        (
            "train__y",
            np.ones((10, 3), dtype=np.float32),
            r"'train/y' in '.*' must be 1-D integer class labels, got float32 \(10, 3\)",
        ),
        (
            "test__y",
            np.array([0, 1, 0, 1.0]),
            r"'test/y' .*must be 1-D integer class labels, got float64 \(4,\)",
        ),
        ("test__y", np.array([[0], [1], [0], [1]]), r"'test/y' .*1-D integer.*int64 \(4, 1\)"),
        ("train__y", np.array([0, 1, -1, 0, 0, 0, 0, 0, 0, 0]), r"'train/y' .*negative labels"),
        ("train__x", np.full((10, 3), "a", dtype="S1"), r"'train/x' .*must be numeric"),
        ("train__x", np.arange(10.0), r"'train/x' .*must have shape \(N, features\.\.\.\)"),
        ("test__x", np.array([[0, np.nan, 0]] * 4), r"'test/x' .*holds non-finite values"),
        ("train__x", np.full((10, 3), np.inf), r"'train/x' .*holds non-finite values"),
        ("train__x", np.full((10, 3), 1e300), r"'train/x' .*non-finite"),  # inf as float32
        ("train__x", np.zeros((0, 3)), r"'train/x' .*is empty"),
        ("test__y", np.zeros(0, dtype=np.int64), r"'test/y' .*is empty"),
        (
            "test__x",
            np.zeros((4, 2)),
            r"'train/x' has feature shape \(3,\) but 'test/x' has \(2,\)",
        ),
    ],
)
def test_bad_content(tmp_path, key, value, message):
    arrays = good_arrays()
    arrays[key] = value
    path = write_h5(tmp_path / "d.h5", **arrays)
    with pytest.raises(DataError, match=message) as info:
        load_dataset(path)
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------- epoch order


def test_permutation_deterministic_and_per_epoch():
    a = epoch_permutation(100, seed=3, epoch=0)
    assert a.dtype == np.int64 and a.shape == (100,)
    np.testing.assert_array_equal(a, epoch_permutation(100, 3, 0))
    np.testing.assert_array_equal(a, np.random.default_rng([3, 0]).permutation(100))
    np.testing.assert_array_equal(np.sort(a), np.arange(100))
    assert not np.array_equal(a, epoch_permutation(100, 3, 1))
    assert not np.array_equal(a, epoch_permutation(100, 4, 0))


@pytest.mark.parametrize(
    "args, exc, match",
    [
        ((10.0, 0, 0), TypeError, "n_samples must be an int"),
        ((True, 0, 0), TypeError, "n_samples must be an int"),
        ((-1, 0, 0), ValueError, "n_samples must be >= 0, got -1"),
        ((10, -2, 0), ValueError, "seed must be >= 0, got -2"),
        ((10, 0, "1"), TypeError, "epoch must be an int"),
        ((10, 0, -1), ValueError, "epoch must be >= 0, got -1"),
    ],
)
def test_permutation_validates(args, exc, match):
    with pytest.raises(exc, match=match):
        epoch_permutation(*args)


def test_num_batches():
    assert num_batches(11, 3) == 4
    assert num_batches(10, 3) == 3  # 3 + 3 + 4: the lone sample is folded in
    assert num_batches(9, 3) == 3
    assert num_batches(0, 3) == 0
    assert num_batches(1437, 1437) == 1
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        num_batches(10, 0)


def reference_plan(n, batch_size, drop_last=False):
    """Batch sizes of an epoch worked out by hand: full batches, then the rest (a lone one folded back)."""
    full, rest = divmod(n, batch_size)
    sizes = [batch_size] * full
    if drop_last or rest == 0:
        return sizes
    if rest == 1 and sizes:
        sizes[-1] += 1
        return sizes
    return sizes + [rest]


# The digits' 1437 training samples leave one sample over at each of these batch sizes.
DIGITS_LONE = [4, 2, 359, 718, 1436]


@pytest.mark.parametrize("n, batch_size", [(23, 5), (20, 5), (7, 10), (1, 1), (1, 4), (21, 5), (11, 10), (6, 5)]
                         + [(1437, bs) for bs in DIGITS_LONE + [1, 32, 1437]])
@pytest.mark.parametrize("drop_last", [False, True])
def test_batches_cover_every_index_once(n, batch_size, drop_last):
    perm = epoch_permutation(n, 0, 2)
    count = num_batches(n, batch_size, drop_last)
    batches = [batch_indices(perm, batch_size, b, drop_last) for b in range(count)]
    sizes = reference_plan(n, batch_size, drop_last)
    assert [len(b) for b in batches] == sizes
    assert smallest_batch(n, batch_size, drop_last) == min(sizes, default=0)
    seen = np.concatenate(batches) if batches else np.zeros(0, np.int64)
    np.testing.assert_array_equal(seen, perm[: sum(sizes)])  # in order, each sample once
    if not drop_last:
        np.testing.assert_array_equal(np.sort(seen), np.arange(n))  # every sample, every epoch


@pytest.mark.parametrize("batch_size", DIGITS_LONE)
def test_a_lone_left_over_sample_is_folded_into_the_last_batch(batch_size):
    """1437 % bs == 1 used to end every epoch with a batch of 1 (fatal to BatchNorm)."""
    assert 1437 % batch_size == 1
    count = num_batches(1437, batch_size)
    assert count == 1437 // batch_size
    perm = epoch_permutation(1437, 3, 0)
    last = batch_indices(perm, batch_size, count - 1)
    assert len(last) == batch_size + 1 and last[-1] == perm[-1]
    assert min(len(batch_indices(perm, batch_size, b)) for b in range(count)) >= batch_size >= 2
    assert num_batches(1437, batch_size, drop_last=True) == count  # the lone sample dropped instead
    assert len(batch_indices(perm, batch_size, count - 1, drop_last=True)) == batch_size


def test_drop_last_drops_the_short_batch():
    assert num_batches(1437, 32, drop_last=True) == 44 and num_batches(1437, 32) == 45
    assert smallest_batch(1437, 32) == 29 and smallest_batch(1437, 32, drop_last=True) == 32
    assert num_batches(10, 32, drop_last=True) == 0 and smallest_batch(10, 32, drop_last=True) == 0
    assert smallest_batch(10, 32) == 10


def test_batch_indices_out_of_range():
    perm = np.arange(10)
    with pytest.raises(IndexError, match=r"batch must be in \[0, 3\), got 3"):
        batch_indices(perm, 3, 3)
    with pytest.raises(IndexError, match=r"got -1"):
        batch_indices(perm, 3, -1)
    with pytest.raises(ValueError, match="perm must be 1-D"):
        batch_indices(perm.reshape(2, 5), 3, 0)


def test_default_names_unchanged():
    assert DEFAULT_NAMES == {
        "train_x": "train/x",
        "train_y": "train/y",
        "test_x": "test/x",
        "test_y": "test/y",
    }
