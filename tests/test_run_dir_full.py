"""A full disk under the run dir: one line naming the run dir and "No space left on device", exit 1."""

import errno
import os
import subprocess
import time

import pytest

from flodl_mpi.metrics import _disk_full
from tests.conftest import run_flodl


def test_disk_full_is_recognised_in_h5pys_text_and_in_oserror():
    h5 = RuntimeError("Unable to flush dataset (file write failed: ..., errno = 28, error message = 'No space "
                      "left on device', ...)")
    assert _disk_full(h5)
    assert _disk_full(OSError(errno.ENOSPC, "No space left on device"))
    try:
        try:
            raise OSError(errno.ENOSPC, "x")
        except OSError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        assert _disk_full(outer)
    assert not _disk_full(RuntimeError("Unable to flush dataset (errno = 5, error message = 'Input/output error')"))


@pytest.mark.slow
def test_a_fresh_run_on_a_full_file_system_says_so_in_one_line(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(mnt)],
                                           capture_output=True, check=False).returncode != 0:
        pytest.skip("needs to mount a small tmpfs (root)")
    try:
        t0 = time.monotonic()
        proc = run_flodl(2, "train", "--epochs", "3", "--run-dir", str(mnt / "r"), "-q", timeout=240)
        assert time.monotonic() - t0 < 240
        assert proc.returncode == 1
        line = (f"flodl-mpi: rank 0: error: run dir {mnt / 'r'}: No space left on device: the writer could not "
                "write metrics.h5 or a checkpoint")
        assert proc.stderr.count(line) == 1, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr and "resume-tmp" not in proc.stderr
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
