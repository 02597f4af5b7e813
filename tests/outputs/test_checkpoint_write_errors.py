"""A write the disk refuses (full, quota, file size limit) while a checkpoint or metrics.h5 is written:
an OSError with the system's errno, one line from the writer, the temporary file removed, every earlier
file whole, and never a crashed HDF5 library (trial 7: rank 0 died of SIGSEGV closing metrics.h5)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from flodl_mpi.outputs import checkpoint, h5sink
from flodl_mpi.outputs.checkpoint import read_checkpoint, verify_checkpoint, write_checkpoint
from flodl_mpi.outputs.metrics import MetricsFile, MetricsWriter, WriterError, disk_error, read_table, table_schema

ROOT = Path(__file__).resolve().parents[2]


def _rows(table: str, k: int = 1, world_size: int = 1) -> dict[str, np.ndarray]:
    return {c: np.zeros((k, *shape), dtype) for c, (dtype, shape) in table_schema(world_size)[table].items()}


# The writer thread of rank 0, in a process of its own: a first checkpoint written, then a file size limit
# (RLIMIT_FSIZE, as `ulimit -f`; Python ignores SIGXFSZ, so the write fails with EFBIG) below the second one.
_WRITER_SCRIPT = textwrap.dedent("""
    import resource, sys
    from pathlib import Path
    import numpy as np
    sys.path.insert(0, sys.argv[2])
    from flodl_mpi.outputs.metrics import MetricsWriter, WriterError, table_schema
    def _rows(table, k):
        return {c: np.zeros((k, *shape), dtype) for c, (dtype, shape) in table_schema(1)[table].items()}
    run = Path(sys.argv[1])
    writer = MetricsWriter(run, 1, {}, run / "checkpoints", 3)
    writer.start()
    writer.append("rounds", _rows("rounds", 3))
    small = {"w": np.arange(65536, dtype=np.float32)}
    writer.save_checkpoint("ckpt-e000001-r000003.h5", small, {}, {"epoch": 1, "round": 3}, ["w"])
    writer.flush_wait()
    resource.setrlimit(resource.RLIMIT_FSIZE, (4_000_000, resource.RLIM_INFINITY))
    big = {f"w{i}": np.full((1024, 1024), i, np.float32) for i in range(4)}  # 16 MB
    writer.append("rounds", _rows("rounds", 2))
    writer.save_checkpoint("ckpt-e000002-r000005.h5", big, {}, {"epoch": 2, "round": 5}, list(big))
    try:
        writer.close()
    except WriterError as exc:
        print(f"plain={exc.plain}: {exc}", flush=True)
        sys.exit(1)
    print("no error", flush=True)
""")


def test_a_checkpoint_over_the_file_size_limit_is_one_line_not_a_segfault(tmp_path):
    """Before the fix the process died of SIGSEGV (-11): HDF5 kept the dataset IDs whose close failed (their chunks
    could not be written) after their file was gone, and the next walk over every dataset ID (metrics.h5's close,
    or the library's end at exit) dereferenced them."""
    run = tmp_path / "run"
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", _WRITER_SCRIPT, str(run), str(ROOT)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout, proc.stderr = proc.communicate(timeout=120)
    assert time.monotonic() - t0 < 120
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr[-3000:])
    tmp_name = f"checkpoints/ckpt-e000002-r000005.h5.tmp-{proc.pid}"  # this process's write, named
    assert proc.stdout.splitlines() == [
        f"plain=True: run dir {run}: File too large: could not write {tmp_name} (removed); raise the job's file "
        "size limit (ulimit -f), then go on with --resume (the newest complete checkpoint is kept)"], proc.stdout
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["ckpt-e000001-r000003.h5"]
    verify_checkpoint(run / "checkpoints" / "ckpt-e000001-r000003.h5")
    np.testing.assert_array_equal(read_checkpoint(run / "checkpoints" / "ckpt-e000001-r000003.h5").params["w"],
                                  np.arange(65536, dtype=np.float32))
    assert len(read_table(run / "metrics.h5", "rounds")["round"]) == 5  # both appends, the file closed whole


class _Refusing:
    """``os.pwrite`` that writes ``budget`` bytes, then fails every write with ``code``."""

    def __init__(self, budget: int, code: int):
        self.budget, self.code, self.calls_failed = budget, code, 0

    def __call__(self, fd, data, offset):
        if self.budget <= 0:
            self.calls_failed += 1
            raise OSError(self.code, os.strerror(self.code))
        n = min(len(data), self.budget)
        self.budget -= n
        return os.pwrite(fd, bytes(data[:n]), offset)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EFBIG])
def test_write_checkpoint_raises_the_oserror_and_leaves_no_file(tmp_path, monkeypatch, code):
    refusing = _Refusing(300_000, code)
    monkeypatch.setattr(h5sink.WriteSink, "_pwrite", staticmethod(refusing))
    params = {f"w{i}": np.full((256, 256), i, np.float32) for i in range(8)}  # 2 MB
    with pytest.raises(OSError) as info:
        write_checkpoint(tmp_path / "c.h5", params, {}, {"epoch": 1}, list(params))
    assert info.value.errno == code
    assert info.value.filename == str(tmp_path / f"c.h5.tmp-{os.getpid()}")
    assert refusing.calls_failed >= 1  # the failure was met in the write path
    assert list(tmp_path.iterdir()) == []
    # The library is whole: another file writes, closes and reads back.
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["x"] = np.arange(10)
    with h5py.File(tmp_path / "other.h5", "r") as f:
        np.testing.assert_array_equal(f["x"][()], np.arange(10))


def test_the_writer_stops_adding_datasets_after_the_first_refused_write(tmp_path, monkeypatch):
    """After the disk refused one write, no further dataset is created: the overlay holds at most the rest
    of the one in flight."""
    monkeypatch.setattr(h5sink.WriteSink, "_pwrite", staticmethod(_Refusing(100_000, errno.ENOSPC)))
    created = []
    real = checkpoint._create
    monkeypatch.setattr(checkpoint, "_create", lambda g, name, data: (created.append(name), real(g, name, data)))
    params = {f"w{i}": np.zeros((256, 256), np.float32) for i in range(8)}  # 256 kB each
    with pytest.raises(OSError):
        write_checkpoint(tmp_path / "c.h5", params, {}, {}, list(params))
    assert created == ["w0"]  # w0's chunks already overflow 100 kB; w1 is never begun


@pytest.mark.parametrize("code, words, remedy", [
    (errno.ENOSPC, "No space left on device", "free space there"),
    (errno.EDQUOT, "Disk quota exceeded", "free space under your quota there (or have it raised)"),
])
def test_the_writer_says_the_systems_words_and_keeps_the_newest_checkpoint(tmp_path, monkeypatch, code, words,
                                                                         remedy):
    writer = MetricsWriter(tmp_path, 1, {}, tmp_path / "checkpoints", 3)
    writer.start()
    small = {"w": np.ones(10, np.float32)}
    writer.save_checkpoint("ckpt-e000001-r000001.h5", small, {}, {"round": 1}, ["w"])
    writer.flush_wait()
    monkeypatch.setattr(h5sink.WriteSink, "_pwrite", staticmethod(_Refusing(50_000, code)))
    big = {"w": np.ones((512, 512), np.float32)}
    writer.save_checkpoint("ckpt-e000002-r000002.h5", big, {}, {"round": 2}, ["w"])
    t0 = time.monotonic()
    with pytest.raises(WriterError) as info:
        writer.close(timeout=60)
    assert time.monotonic() - t0 < 60
    assert info.value.plain
    assert str(info.value) == (
        f"run dir {tmp_path}: {words}: could not write checkpoints/ckpt-e000002-r000002.h5.tmp-{os.getpid()} "
        f"(removed); {remedy}, then go on with --resume (the newest complete checkpoint is kept)")
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["ckpt-e000001-r000001.h5"]
    verify_checkpoint(tmp_path / "checkpoints" / "ckpt-e000001-r000001.h5")


def test_clearly_too_little_room_fails_before_a_byte_is_written(tmp_path, monkeypatch):
    """Less free space than a checkpoint's arrays alone: the writer refuses it with the sizes, writes nothing."""
    writer = MetricsWriter(tmp_path, 1, {}, tmp_path / "checkpoints", 3)
    writer.start()
    monkeypatch.setattr(h5sink, "free_bytes", lambda directory: 1_000_000)
    opened = []
    monkeypatch.setattr(h5sink.WriteSink, "__init__", lambda self, path: opened.append(path))
    params = {"w": np.ones((1000, 1000), np.float64)}  # stored float32: 4.0 MB
    writer.save_checkpoint("ckpt-e000001-r000001.h5", params, {}, {}, ["w"])
    with pytest.raises(WriterError) as info:
        writer.close(timeout=60)
    assert str(info.value) == (
        f"run dir {tmp_path}: No space left on device: checkpoint ckpt-e000001-r000001.h5 needs about 4.0 MB, "
        f"{tmp_path / 'checkpoints'} has 1.0 MB free; free space there, then go on with --resume (the newest "
        "complete checkpoint is kept)")
    assert opened == [] and list((tmp_path / "checkpoints").iterdir()) == []


def test_a_resume_rebuild_of_metrics_h5_refused_by_the_disk_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "metrics.h5"
    f = MetricsFile(path, 1, {})
    f.append("rounds", _rows("rounds", 40))
    f.close()
    before = path.read_bytes()
    monkeypatch.setattr(h5sink.WriteSink, "_pwrite", staticmethod(_Refusing(2_000, errno.ENOSPC)))
    with pytest.raises(OSError) as info:
        MetricsFile(path, 1, {}, keep_rows={"rounds": 30, "epochs": 0, "batches": 0})
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(tmp_path / "metrics.h5.resume-tmp")
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.h5"]  # the temporary copy removed


def test_disk_errors_are_recognised_by_errno_and_in_h5pys_text():
    for code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        assert disk_error(OSError(code, os.strerror(code))).errno == code
        text = RuntimeError(f"Unable to flush (file write failed: ..., errno = {code}, error message = "
                            f"'{os.strerror(code)}', ...)")
        assert disk_error(text).errno == code
        try:
            try:
                raise OSError(code, "x")
            except OSError as inner:
                raise RuntimeError("wrapped") from inner
        except RuntimeError as outer:
            assert disk_error(outer).errno == code
    assert disk_error(RuntimeError("Unable to flush dataset (errno = 5, error message = 'Input/output error')")) \
        is None
    assert disk_error(OSError(errno.EACCES, "Permission denied")) is None


def test_the_sink_reads_back_what_hdf5_wrote_after_the_failure(tmp_path):
    """The overlay: reads after a refused write see the refused bytes, as HDF5 wrote them."""
    sink = h5sink.WriteSink(tmp_path / "f")
    sink._pwrite = _Refusing(6, errno.ENOSPC)
    sink.seek(0)
    sink.write(b"abcdefghij")  # 6 bytes to disk, 4 into the overlay
    sink.seek(20)
    sink.write(b"XY")
    sink.seek(2)
    sink.write(b"Q")
    sink.seek(0)
    assert sink.read(24) == b"abQdefghij" + b"\0" * 10 + b"XY\0\0"
    assert sink.error.errno == errno.ENOSPC and (tmp_path / "f").read_bytes() == b"abcdef"
    with pytest.raises(OSError):
        sink.fsync()
    sink.close()
