"""Messages about the training data name what can help: a 1-sample training set; the data dir variable."""

import pytest

from flodl_mpi.config import TrainConfig
from flodl_mpi.training.train import smallest_training_batch as _smallest_training_batch


@pytest.mark.parametrize("n, batch_size, drop_last", [(1, 64, False), (1, 1, False), (5, 64, False), (5, 5, True)])
def test_a_training_set_of_one_batch_suggests_no_batch_option(n, batch_size, drop_last):
    """The whole training set is the smallest batch: --drop-last / --batch-size cannot make it larger."""
    k, remedy = _smallest_training_batch(TrainConfig(batch_size=batch_size, drop_last=drop_last), n)
    assert k == n
    assert "--drop-last" not in remedy and "--batch-size" not in remedy
    assert f"the whole training set is {n} sample" in remedy


def test_a_short_last_batch_still_suggests_drop_last():
    k, remedy = _smallest_training_batch(TrainConfig(batch_size=64), 100)
    assert k == 36 and "add --drop-last" in remedy


def test_an_unwritable_data_dir_names_the_variable(tmp_path, monkeypatch):
    """``FLODL_MPI_DATA_DIR=/proc/nope``: the message names the variable, its value and the OS's reason."""
    from flodl_mpi.training.data import ensure_digits

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("FLODL_MPI_DATA_DIR", str(blocker / "nope"))
    with pytest.raises(OSError) as err:
        ensure_digits()
    assert str(err.value) == (f"FLODL_MPI_DATA_DIR={str(blocker / 'nope')!r}: cannot write the built-in digits "
                              "file digits.h5 there: Not a directory")


def test_non_finite_features_name_the_first_row_and_the_count(tmp_path):
    """issue 26 item 9: NaN in x was refused without naming the row; the line names the first and the count."""
    import h5py
    import numpy as np

    from flodl_mpi.training.data import DataError, dataset_from_arrays, load_dataset

    x = np.zeros((50, 2, 3), np.float32)
    x[17, 1, 2], x[30, 0, 0], x[31, 1, 1] = np.nan, np.inf, np.nan
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as f:
        f["train/x"], f["train/y"] = x, np.arange(50) % 2
        f["test/x"], f["test/y"] = x[:4], np.arange(4) % 2
    with pytest.raises(DataError) as err:
        load_dataset(path)
    assert str(err.value) == (f"'train/x' in {str(path)!r} holds non-finite values (NaN or Inf as float32): row 17 "
                              "first (nan), 3 rows of 50 in all")
    big = np.ones((3, 2)) * 1e300  # finite float64, Inf as float32
    with pytest.raises(DataError) as err:
        dataset_from_arrays((np.ones((3, 2)), np.arange(3)), (big, np.arange(3)))
    assert str(err.value) == ("'test x' in 'in-memory arrays' holds non-finite values (NaN or Inf as float32): "
                              "row 0 first (inf), 3 rows of 3 in all")
