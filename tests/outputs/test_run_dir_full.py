"""A run dir that refuses bytes (a full disk, the file size limit): refused before training when it is
known, else one line naming the run dir and the system's words, exit 1, nothing saved lost; and what a
resume finds there (temporary files, damaged checkpoints) said and kept, never silently."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import resource
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from flodl_mpi.outputs.checkpoint import list_checkpoints, verify_checkpoint
from flodl_mpi.errors import EXIT_ERROR, EXIT_INPUT
from flodl_mpi.outputs.metrics import disk_error, read_table
from tests._runs import copy_of_run_a
from tests.conftest import launch_command, launch_env, run_flodl, start_flodl

pytestmark = pytest.mark.slow


def test_disk_full_is_recognised_in_h5pys_text_and_in_oserror():
    h5 = RuntimeError("Unable to flush dataset (file write failed: ..., errno = 28, error message = 'No space "
                      "left on device', ...)")
    assert disk_error(h5).errno == errno.ENOSPC
    assert disk_error(OSError(errno.ENOSPC, "No space left on device")).errno == errno.ENOSPC
    assert disk_error(RuntimeError("Unable to flush dataset (errno = 5, error message = 'Input/output error')")) \
        is None


def _model_file(tmp_path: Path, width: int) -> str:
    """A ``--model`` spec: an MLP of two hidden layers of ``width`` (width 1024: 1.1M params, 4.5 MB)."""
    path = tmp_path / "wide.py"
    path.write_text("import math\nimport torch.nn as nn\n\n\ndef make(input_shape, num_classes):\n"
                    "    d = math.prod(input_shape)\n"
                    f"    return nn.Sequential(nn.Flatten(), nn.Linear(d, {width}), nn.ReLU(), "
                    f"nn.Linear({width}, {width}), nn.ReLU(), nn.Linear({width}, num_classes))\n")
    return f"{path}:make"


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _params(width: int, d: int = 64, classes: int = 10) -> int:
    return d * width + width + width * width + width + width * classes + classes


@pytest.mark.parametrize("limit_mb, expect", [(48, "above the limit"), (8, "save check")])
def test_a_checkpoint_above_the_file_size_limit_is_refused_before_training(tmp_path, limit_mb, expect):
    """``ulimit -f`` below one checkpoint (Adam's two moments for each of 2 ranks: 5x the 17.4 MB of params)
    is refused at setup, exit 2, one line; nothing trained, nothing left. Before: SIGSEGV after epoch 1."""
    limit = limit_mb * 1_000_000
    run_dir = tmp_path / "r"
    t0 = time.monotonic()
    proc = subprocess.run(
        launch_command(2, "train", "--run-dir", str(run_dir), "--model", _model_file(tmp_path, 2048),
                       "--epochs", "1", "--node-reduce", "mpi"),
        capture_output=True, text=True, timeout=300, check=False, env=launch_env(),
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY)))
    assert time.monotonic() - t0 < 300
    assert proc.returncode == EXIT_INPUT, proc.stderr[-3000:]
    ckpts = run_dir / "checkpoints"
    if expect == "above the limit":
        assert re.search(rf"^flodl-mpi: error: {re.escape(str(ckpts))}: a checkpoint of this run needs about "
                         rf"(\d+\.\d) MB, above the file size limit of this job \({limit_mb}\.0 MB: ulimit -f\); "
                         r"raise the limit \(nothing was trained\)$", proc.stderr, re.M), proc.stderr[-3000:]
        one = float(re.search(r"needs about (\d+\.\d) MB", proc.stderr).group(1))
        assert 5 * _params(2048) * 4 / 1e6 <= one < 5 * _params(2048) * 4 / 1e6 * 1.02  # the arrays, + HDF5's own
    else:
        assert (f"flodl-mpi: error: {ckpts}: File too large: the save check could not write a checkpoint there; "
                "raise the job's file size limit (ulimit -f) (nothing was "
                "trained)") in proc.stderr.splitlines(), proc.stderr[-3000:]
    assert proc.stderr.count("error:") == 1 and "Traceback" not in proc.stderr
    assert "epoch 1/1" not in proc.stdout
    assert not run_dir.exists()  # a new run refused at setup leaves nothing


def test_a_run_dir_without_room_for_the_kept_checkpoints_is_refused_before_training(tmp_path):
    """``--keep-checkpoints 3`` and 4 saves need 4 checkpoints at once; a file system with room for 2 refuses
    the run, naming the sizes and the --keep-checkpoints that fits (1). Lowering it, the same run trains."""
    mnt = _tmpfs(tmp_path, "60m")
    try:
        model = _model_file(tmp_path, 1024)  # 4.5 MB of params, 22.5 MB a checkpoint at 2 ranks with Adam
        t0 = time.monotonic()
        proc = run_flodl(2, "train", "--run-dir", str(mnt / "r"), "--model", model, "--epochs", "4",
                         "--node-reduce", "mpi", timeout=300)
        assert time.monotonic() - t0 < 300
        assert proc.returncode == EXIT_INPUT, proc.stderr[-3000:]
        m = re.search(rf"^flodl-mpi: error: {re.escape(str(mnt / 'r' / 'checkpoints'))} has (\d+\.\d) MB free, this "
                      r"run needs about (\d+\.\d) MB there \(4 checkpoints of about (\d+\.\d) MB: --keep-checkpoints "
                      r"3 kept, and the next written beside them before the oldest is deleted\); free space there or "
                      r"lower --keep-checkpoints to 1 \(nothing was trained\)$", proc.stderr, re.M)
        assert m, proc.stderr[-3000:]
        free, need, one = (float(g) for g in m.groups())
        assert 2 * one <= free < 3 * one and need == pytest.approx(4 * one, abs=0.11)
        assert not (mnt / "r").exists()
        ok = run_flodl(2, "train", "--run-dir", str(mnt / "r"), "--model", model, "--epochs", "2",
                       "--keep-checkpoints", "1", "--node-reduce", "mpi", "-q", timeout=300)
        assert ok.returncode == 0, ok.stderr[-3000:]
        size = list_checkpoints(mnt / "r" / "checkpoints")[-1].stat().st_size
        assert one == pytest.approx(size / 1e6, rel=0.01)  # the estimate is the real file's size
    finally:
        _umount(mnt)


def _tmpfs(tmp_path: Path, size: str) -> Path:
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                                           capture_output=True, check=False).returncode != 0:
        pytest.skip("needs to mount a small tmpfs (root)")
    return mnt


def _umount(mnt: Path) -> None:
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(mnt: Path, leave: int) -> Path:
    st = os.statvfs(mnt)
    filler = mnt / "filler"
    with open(filler, "wb") as fh:
        os.posix_fallocate(fh.fileno(), 0, max(1, st.f_bavail * st.f_frsize - leave))
    return filler


def test_a_fresh_run_on_a_full_file_system_says_so_in_one_line(tmp_path):
    """600 kB: less than one checkpoint of the built-in model (3 saves at --epochs 3): refused before training."""
    mnt = _tmpfs(tmp_path, "600k")
    try:
        t0 = time.monotonic()
        proc = run_flodl(2, "train", "--epochs", "3", "--run-dir", str(mnt / "r"), "-q", timeout=240)
        assert time.monotonic() - t0 < 240
        assert proc.returncode == EXIT_INPUT, proc.stderr[-3000:]
        lines = [line for line in proc.stderr.splitlines() if "error:" in line]
        assert len(lines) == 1, proc.stderr[-3000:]
        assert re.fullmatch(rf"flodl-mpi: error: {re.escape(str(mnt / 'r' / 'checkpoints'))} has \d+\.\d kB free, "
                            r"this run needs about \d+\.\d MB there \(3 checkpoints of about \d+\.\d kB: "
                            r"--keep-checkpoints 3 kept, and the next written beside them before the oldest is "
                            r"deleted\); free space there or choose a run dir on a larger file system \(nothing was "
                            r"trained\)", lines[0]), lines[0]
        assert "Traceback" not in proc.stderr and not (mnt / "r").exists()
    finally:
        _umount(mnt)


@pytest.mark.parametrize("leave", [3_000_000, 0])
def test_a_disk_that_fills_mid_run_ends_with_one_line_and_keeps_every_checkpoint(tmp_path, leave):
    """The trial's case: checkpoints fit until the disk fills. Exit 1 (before: SIGSEGV, exit 11), one line
    naming the checkpoint and the free space (or the write the disk refused), train.log gives the reason (or,
    full to the last byte, one warning says train.log is no longer written; no logging traceback per line),
    no temporary file is left, the earlier checkpoints and metrics.h5 read back whole."""
    mnt = _tmpfs(tmp_path, "200m")
    run_dir = mnt / "r"
    try:
        model = _model_file(tmp_path, 1024)
        t0 = time.monotonic()
        proc = start_flodl(2, "train", "--run-dir", str(run_dir), "--model", model, "--epochs", "40",
                           "--keep-checkpoints", "2", "--node-reduce", "mpi")
        try:
            while not list_checkpoints(run_dir / "checkpoints") and proc.poll() is None:
                assert time.monotonic() - t0 < 300
                time.sleep(0.05)
            _fill(mnt, leave)  # room for less than one checkpoint's arrays
            out, err = proc.communicate(timeout=300)
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        assert time.monotonic() - t0 < 600
        assert proc.returncode == EXIT_ERROR, err[-3000:]
        lines = [line for line in err.splitlines() if "error:" in line]
        assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
        ck = re.escape(str(run_dir / "checkpoints"))
        m = (re.fullmatch(rf"flodl-mpi: rank 0: error: run dir {re.escape(str(run_dir))}: No space left on device: "
                          rf"checkpoint (ckpt-e\d+-r\d+\.h5) needs about \d+\.\d MB, {ck} has [\d.]+ [kMG]?B free; free "
                          r"space there, then go on with --resume \(the newest complete checkpoint is kept\); "
                          r"aborting the job", lines[0])
             or re.fullmatch(rf"flodl-mpi: rank 0: error: run dir {re.escape(str(run_dir))}: No space left on device: "
                             r"could not write (?:checkpoints/(ckpt-e\d+-r\d+\.h5)\.tmp-\d+ \(removed\)|metrics\.h5); "
                             r"free space there, then go on with --resume \(the newest complete checkpoint is kept\); "
                             r"aborting the job", lines[0]))
        assert m, lines[0]
        assert "Logging error" not in err
        log = (run_dir / "train.log").read_text().splitlines()
        silenced = f"flodl-mpi: warning: {run_dir / 'train.log'}: No space left on device: its lines are no longer " \
                   "written (stdout has them)"
        assert err.count(silenced) <= 1
        if silenced not in err:
            assert "rank 0 failed: WriterError: run dir" in log[-1] and "No space left on device" in log[-1]
        assert not [p for p in (run_dir / "checkpoints").iterdir() if ".tmp-" in p.name]
        kept = list_checkpoints(run_dir / "checkpoints")
        assert kept and (m.group(1) is None or kept[-1].name < m.group(1))
        for path in kept:
            verify_checkpoint(path)
        assert len(read_table(run_dir / "metrics.h5", "epochs")["epoch"]) >= 1
    finally:
        _umount(mnt)


def test_a_resume_whose_metrics_rebuild_meets_a_full_disk_says_so_and_the_next_one_finishes(tmp_path,
                                                                                          tmp_path_factory):
    """The finished run is a copy of the session's run A (tests/_runs.py: 5 epochs; it was a 2-epoch run of
    this test's own, one launch more), resumed to 6 epochs (was 3)."""
    mnt = _tmpfs(tmp_path, "40m")
    run_dir = mnt / "r"
    try:
        copy_of_run_a(tmp_path_factory, run_dir)
        metrics = run_dir / "metrics.h5"
        md5 = hashlib.md5(metrics.read_bytes()).hexdigest()
        filler = _fill(mnt, 48 * 1024)  # the small files fit, not a copy of metrics.h5
        t0 = time.monotonic()
        proc = run_flodl(2, "train", "--run-dir", str(run_dir), "--epochs", "6", "--resume", "-q", timeout=240)
        assert time.monotonic() - t0 < 240
        assert proc.returncode == EXIT_ERROR, proc.stderr[-3000:]
        lines = [line for line in proc.stderr.splitlines() if "error:" in line]
        assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert lines[0].startswith(f"flodl-mpi: error: run dir {run_dir}: No space left on device: could not "
                                   "write "), lines[0]
        assert hashlib.md5(metrics.read_bytes()).hexdigest() == md5
        assert not (run_dir / "metrics.h5.resume-tmp").exists()
        filler.unlink()
        again = run_flodl(2, "train", "--run-dir", str(run_dir), "--epochs", "6", "--resume", timeout=240)
        assert again.returncode == 0, again.stderr[-3000:]
        assert "killed" not in again.stdout
        assert len(read_table(metrics, "epochs")["epoch"]) == 6
    finally:
        _umount(mnt)


def test_a_resume_removes_every_temporary_file_an_earlier_run_left_and_says_so(tmp_path, tmp_path_factory):
    """Held by the lock, any ``*.tmp-<pid>`` is stale, whatever the pid: 1 (always alive) and this test's own
    included. Before: those of live pids stayed forever. The finished run is a copy of the session's run A
    (tests/_runs.py: 5 epochs, 23 rounds each; it was a 1-epoch run of this test's own, one launch more),
    resumed to 6 epochs (was 2): the left checkpoint is the 6th epoch's (was the 2nd's, ckpt-e000002-r000046)."""
    run_dir = copy_of_run_a(tmp_path_factory, tmp_path / "r")
    ckpts = run_dir / "checkpoints"
    left = {ckpts / "ckpt-e000006-r000138.h5.tmp-1": 1_000_000, ckpts / f"save-check.h5.tmp-{os.getpid()}": 4096,
            run_dir / "metrics.h5.resume-tmp": 2048}
    for path, size in left.items():
        path.write_bytes(np.random.default_rng(0).bytes(size))
    proc = run_flodl(2, "train", "--run-dir", str(run_dir), "--epochs", "6", "--resume", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = ("warning: removed 3 temporary files an earlier run left unfinished (killed or failed while writing), "
            "1.0 MB in all: checkpoints/ckpt-e000006-r000138.h5.tmp-1 (1.0 MB), checkpoints/save-check.h5.tmp-"
            f"{os.getpid()} (4.1 kB), metrics.h5.resume-tmp (2.0 kB)")
    assert proc.stdout.count(line) == 1, proc.stdout[-3000:]
    assert (run_dir / "train.log").read_text().count(line) == 1
    assert not any(p.exists() for p in left)
    assert not [p for p in ckpts.iterdir() if ".tmp-" in p.name]


def test_a_resume_with_every_checkpoint_damaged_starts_again_and_keeps_the_history(tmp_path):
    run_dir = tmp_path / "r"
    assert run_flodl(2, "train", "--run-dir", str(run_dir), "--epochs", "2", "--keep-checkpoints", "1",
                     "-q").returncode == 0
    old = {t: read_table(run_dir / "metrics.h5", t) for t in ("rounds", "epochs")}
    (ckpt,) = list_checkpoints(run_dir / "checkpoints")
    os.truncate(ckpt, ckpt.stat().st_size // 2)
    proc = run_flodl(2, "train", "--run-dir", str(run_dir), "--epochs", "2", "--keep-checkpoints", "1", "--resume",
                     "auto", "-q", timeout=240)  # a plain --resume refuses it (tests/training/test_resume_target.py)
    assert proc.returncode == 0, proc.stderr[-3000:]
    kept = sorted(run_dir.glob("metrics.h5.before-restart-*"))
    assert len(kept) == 1
    n_rounds, n_epochs = len(old["rounds"]["round"]), len(old["epochs"]["epoch"])
    line = (f"warning: every checkpoint in {run_dir / 'checkpoints'} is damaged ({ckpt.name}; kept as *.damaged): "
            f"the run starts again from epoch 1; metrics.h5's history ({n_rounds} rounds, {n_epochs} epochs) kept "
            f"as {kept[0].name}")
    assert proc.stdout.count(line) == 1, proc.stdout[-3000:]  # shown under -q: a warning
    assert (run_dir / "train.log").read_text().count(line) == 1
    for table, columns in old.items():
        history = read_table(kept[0], table)
        for name, values in columns.items():
            np.testing.assert_array_equal(history[name], values)
    assert len(read_table(run_dir / "metrics.h5", "epochs")["epoch"]) == 2  # the run again, from epoch 1
    assert (run_dir / "checkpoints" / (ckpt.name + ".damaged")).exists()
