"""Messages about the training data name what can help: a 1-sample training set; the data dir variable."""

import pytest

from flodl_mpi.config import TrainConfig
from flodl_mpi.train import _smallest_training_batch


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
    from flodl_mpi.data import ensure_digits

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("FLODL_MPI_DATA_DIR", str(blocker / "nope"))
    with pytest.raises(OSError) as err:
        ensure_digits()
    assert str(err.value) == (f"FLODL_MPI_DATA_DIR={str(blocker / 'nope')!r}: cannot write the built-in digits "
                              "file digits.h5 there: Not a directory")
