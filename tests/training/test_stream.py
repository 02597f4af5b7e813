"""flodl_mpi.training.stream.H5Rows and load_dataset(loading=...) (issue 22 item 1), serial.

The streamed features equal the in-memory ones bit for bit (float32 and float64 files, contiguous and
chunked-compressed layouts), reads are counted (a run of consecutive rows is one read, nothing else is
read), the read-ahead serves what it was handed and drops the rest, a non-finite row is named, and
``auto`` keeps data that fits in memory.
"""

import h5py
import numpy as np
import pytest

from flodl_mpi.training import data as data_mod
from flodl_mpi.training.data import DataError, load_dataset
from flodl_mpi.training.stream import H5Rows


def _file(path, dtype="float32", chunks=None, bad_row=None):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 5, 3)).astype(dtype)
    if bad_row is not None:
        x[bad_row, 1, 2] = np.nan
    with h5py.File(path, "w") as f:
        kw = {"chunks": chunks, "compression": "gzip"} if chunks else {}
        f.create_dataset("train/x", data=x, **kw)
        f.create_dataset("train/y", data=rng.integers(0, 4, 300))
        f.create_dataset("test/x", data=x[:40], **kw)
        f.create_dataset("test/y", data=np.arange(40) % 4)
    return path


@pytest.mark.parametrize(
    "dtype, chunks",
    [("float32", None), ("float64", None), ("float32", (16, 5, 3))],
    ids=["f32-contiguous", "f64-contiguous", "f32-chunked-gzip"],
)
def test_streamed_rows_equal_the_in_memory_ones_and_reads_are_counted(tmp_path, dtype, chunks):
    path = _file(tmp_path / "d.h5", dtype, chunks)
    mem, st = load_dataset(path), load_dataset(path, loading="stream")
    x = st.train.x
    assert isinstance(x, H5Rows) and (x._fd is not None) == (chunks is None)  # the pread path where it can
    assert x.shape == mem.train.x.shape and x.dtype == np.float32 and st.num_classes == mem.num_classes
    np.testing.assert_array_equal(st.train.y, mem.train.y)
    idx = np.array([7, 3, 4, 5, 200, 3, 299])  # any order, a repeat: runs 3-5, 7, 200, 299
    got = x[idx]
    assert got.dtype == np.float32 and got.flags.c_contiguous
    np.testing.assert_array_equal(got, mem.train.x[idx])
    assert (x.reads, x.rows_read) == (4, 6)  # one read per run of consecutive rows; the repeat read once
    np.testing.assert_array_equal(st.test.x[10:30], mem.test.x[10:30])
    np.testing.assert_array_equal(st.test.x[::9], mem.test.x[::9])
    assert st.test.x.reads == 1 + 5  # the slice in one read; every 9th row: 5 rows, none consecutive
    perm = data_mod.epoch_permutation(300, 1, 2)
    batches = [data_mod.batch_indices(perm, 32, b) for b in range(data_mod.num_batches(300, 32))]
    x.prefetch(batches[:4])
    for b in batches[:4]:
        np.testing.assert_array_equal(x[b], mem.train.x[b])
    assert x.rows_read == 6 + 4 * 32 and not x._pending
    x.prefetch(batches[4:])  # asked for something else first: the read-ahead is dropped, the rows read in-line
    np.testing.assert_array_equal(x[batches[0]], mem.train.x[batches[0]])
    assert x._thread is None and not x._pending
    x.close()
    x.close()


def test_a_non_finite_row_is_named_when_its_batch_is_read(tmp_path):
    path = _file(tmp_path / "bad.h5", bad_row=123)
    with pytest.raises(DataError, match="holds non-finite values"):
        load_dataset(path)  # in memory: at start
    x = load_dataset(path, loading="stream").train.x
    np.testing.assert_array_equal(np.isfinite(x[np.array([1, 2, 250])]), True)  # other rows read fine
    x.prefetch([np.array([5, 123, 9])])
    with pytest.raises(
        DataError,
        match=r"^'train/x' in '.*bad\.h5' holds non-finite values \(NaN or Inf as "
        r"float32\): row 123, read while streaming it",
    ):
        x[np.array([5, 123, 9])]  # from the read-ahead thread, raised where the batch is taken


def test_auto_keeps_data_that_fits_in_memory_and_streams_what_does_not(tmp_path, monkeypatch):
    path = _file(tmp_path / "d.h5")
    assert isinstance(load_dataset(path, loading="auto").train.x, np.ndarray)
    # 340 rows of 15 float32: 20,400 bytes; a quarter of 100,000 is 25,000 for one rank, 12,500 each for two
    monkeypatch.setattr("flodl_mpi.training.stream.memory_available", lambda: 100_000)
    assert isinstance(load_dataset(path, loading="auto", ranks_per_host=1).train.x, np.ndarray)
    assert isinstance(load_dataset(path, loading="auto", ranks_per_host=2).train.x, H5Rows)
    with pytest.raises(ValueError, match="^loading must be one of auto, memory, stream, got 'disk'$"):
        load_dataset(path, loading="disk")
