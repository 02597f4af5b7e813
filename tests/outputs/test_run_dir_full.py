"""A run dir that refuses bytes (a full disk, the file size limit): refused before training when it is
known, else one line naming the run dir and the system's words, exit 1, nothing saved lost; and what a
resume finds there (temporary files, damaged checkpoints) said and kept, never silently.

Most runs here are a world of 1 in a fork of this process (``fork_flodl`` / ``fork_python``: torch loaded,
about half a CPU second a run, where a 2-rank launch costs about 9): what a full disk or a file size limit
does to rank 0's writes needs no peer. One 2-rank launch is left (the file size limit above one
checkpoint): a checkpoint holds every rank's optimizer state, so the estimate must count the world, and
the refusal is every rank's exit 2 with one line. The resume tests share one 2-epoch run of this module
(`_w1_run`), copied by each (was: the session's run A, 2 ranks, and a 2-epoch run of their own)."""

from __future__ import annotations

import errno
import hashlib
import os
import re
import resource
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from flodl_mpi.outputs.checkpoint import list_checkpoints, verify_checkpoint
from flodl_mpi.errors import EXIT_ERROR, EXIT_INPUT
from flodl_mpi.outputs.metrics import disk_error, read_table
from tests.conftest import fork_flodl, fork_python, launch_command, launch_env

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


#: ``flodl-mpi ARGV[2:]`` under a file size limit of ARGV[1] bytes (``ulimit -f``), for `fork_python`.
_LIMITED = """
import resource, sys
from flodl_mpi.cli.main import main
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), resource.RLIM_INFINITY))
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("limit_mb, expect", [(48, "above the limit"), (8, "save check")])
def test_a_checkpoint_above_the_file_size_limit_is_refused_before_training(tmp_path, limit_mb, expect):
    """``ulimit -f`` below one checkpoint is refused at setup, exit 2, one line; nothing trained, nothing left.
    Before: SIGSEGV after epoch 1.

    48 MB: 2 ranks, launched (see the module's docstring): a checkpoint is the params and Adam's two moments
    for each of 2 ranks, 5x the 17.4 MB of params (87 MB); the estimate must count both ranks, and every rank
    exits 2 with one line between them. 8 MB: the save check's own file (the params, 17.4 MB) is refused
    by the system before any estimate; a world of 1 in a fork suffices (was: 2 ranks, launched)."""
    limit = limit_mb * 1_000_000
    run_dir = tmp_path / "r"
    args = ("train", "--run-dir", str(run_dir), "--model", _model_file(tmp_path, 2048), "--epochs", "1",
            "--node-reduce", "mpi")
    t0 = time.monotonic()
    if expect == "above the limit":
        proc = subprocess.run(
            launch_command(2, *args), capture_output=True, text=True, timeout=300, check=False, env=launch_env(),
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY)))
    else:
        (tmp_path / "limited.py").write_text(_LIMITED)
        proc = fork_python(tmp_path / "limited.py", str(limit), *args, timeout=300)
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
    the run, naming the sizes and the --keep-checkpoints that fits (1). Lowering it, the same run trains.

    A world of 1 in a fork (was: 2 ranks, launched; the world's share of the estimate is the 48 MB case
    above): a checkpoint of the 1.1M-param MLP is its params and Adam's two moments, 3 x 4.5 MB = 13.5 MB,
    so a 36 MiB (37.7 MB) tmpfs holds 2 but not 3 (the test had 60 MiB for 2 ranks' 22.5 MB)."""
    mnt = _tmpfs(tmp_path, "36m")
    try:
        model = _model_file(tmp_path, 1024)  # 4.5 MB of params, 13.5 MB a checkpoint at 1 rank with Adam
        assert 2 * 3 * _params(1024) * 4 < 36 * 2**20 < 3 * 3 * _params(1024) * 4  # what the tmpfs is sized for
        t0 = time.monotonic()
        proc = fork_flodl("train", "--run-dir", str(mnt / "r"), "--model", model, "--epochs", "4",
                          "--node-reduce", "mpi", timeout=300)
        assert time.monotonic() - t0 < 300
        assert proc.returncode == EXIT_INPUT, proc.stderr[-3000:]
        m = re.search(rf"^flodl-mpi: error: {re.escape(str(mnt / 'r' / 'checkpoints'))} has (\d+\.\d) MB free, this "
                      r"run needs about (\d+\.\d) MB there \(4 checkpoints of about (\d+\.\d) MB: --keep-checkpoints "
                      r"3 kept, and the next written beside them before the oldest is deleted\); free space there or "
                      r"lower --keep-checkpoints to 1 \(nothing was trained\)$", proc.stderr, re.M)
        assert m, proc.stderr[-3000:]
        free, need, one = (float(g) for g in m.groups())
        # each figure is rounded to 0.1 MB: 4 x one's +-0.05 and need's own +-0.05
        assert 2 * one <= free < 3 * one and need == pytest.approx(4 * one, abs=0.25)
        assert 3 * _params(1024) * 4 / 1e6 <= one < 3 * _params(1024) * 4 / 1e6 * 1.02  # 1 rank's: 3x the params
        assert not (mnt / "r").exists()
        ok = fork_flodl("train", "--run-dir", str(mnt / "r"), "--model", model, "--epochs", "2",
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
    """300 KiB: room for the save check's file (the built-in model's 26,378 params, 105.5 kB) but less than
    one checkpoint (the params and Adam's two moments: 3 x 105.5 = 316.5 kB at 1 rank): refused before
    training. A world of 1 in a fork (was: 2 ranks, launched, on 600 kB, less than 2 ranks' 5 x 105.5 kB);
    4 saves at --epochs 4 (was 3), so that the run's need (4 x ~317 kB) is said in MB as the line's form has it."""
    mnt = _tmpfs(tmp_path, "300k")
    try:
        t0 = time.monotonic()
        proc = fork_flodl("train", "--epochs", "4", "--run-dir", str(mnt / "r"), "-q", timeout=240)
        assert time.monotonic() - t0 < 240
        assert proc.returncode == EXIT_INPUT, proc.stderr[-3000:]
        lines = [line for line in proc.stderr.splitlines() if "error:" in line]
        assert len(lines) == 1, proc.stderr[-3000:]
        assert re.fullmatch(rf"flodl-mpi: error: {re.escape(str(mnt / 'r' / 'checkpoints'))} has \d+\.\d kB free, "
                            r"this run needs about \d+\.\d MB there \(4 checkpoints of about \d+\.\d kB: "
                            r"--keep-checkpoints 3 kept, and the next written beside them before the oldest is "
                            r"deleted\); free space there or choose a run dir on a larger file system \(nothing was "
                            r"trained\)", lines[0]), lines[0]
        assert "Traceback" not in proc.stderr and not (mnt / "r").exists()
    finally:
        _umount(mnt)


@pytest.mark.parametrize("leave", [3_000_000, 0])
def test_a_disk_that_fills_mid_run_ends_with_one_line_and_keeps_every_checkpoint(tmp_path, leave, run_hook):
    """The trial's case: checkpoints fit until the disk fills. Exit 1 (before: SIGSEGV, exit 11), one line
    naming the checkpoint and the free space (or the write the disk refused), train.log gives the reason (or,
    full to the last byte, one warning says train.log is no longer written; no logging traceback per line),
    no temporary file is left, the earlier checkpoints and metrics.h5 read back whole.

    A world of 1 in a fork (was: 2 ranks, launched; a writer failure on rank 0 ending a 2-rank job is
    tests/cli/test_cli.py's launched test): the disk is filled by a hook at the first round that starts with
    a checkpoint on disk (was: this process, polling the run dir while the run went on)."""
    mnt = _tmpfs(tmp_path, "200m")
    run_dir = mnt / "r"
    filled = []

    def fill_after_the_first_checkpoint(trainer):
        if not filled and list_checkpoints(run_dir / "checkpoints"):
            filled.append(_fill(mnt, leave))  # room for less than one checkpoint's arrays

    run_hook("round_start", fill_after_the_first_checkpoint)  # the fork's child has it too
    try:
        model = _model_file(tmp_path, 1024)
        t0 = time.monotonic()
        proc = fork_flodl("train", "--run-dir", str(run_dir), "--model", model, "--epochs", "40",
                          "--keep-checkpoints", "2", "--node-reduce", "mpi", timeout=300)
        assert time.monotonic() - t0 < 300
        err = proc.stderr
        assert (mnt / "filler").exists(), err[-3000:]  # the hook filled the disk, in the child
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


#: `_w1_run`'s epochs: the resumes below go on to one more.
W1_EPOCHS = 2
#: Rounds an epoch at 1 rank: 1437 digits samples at batch 32 are 45 batches (the last one partial), one
#: round each at window 1.
W1_ROUNDS = -(-1437 // 32)


@pytest.fixture(scope="module")
def _w1_run(tmp_path_factory) -> Path:
    """A finished run at a world of 1 (a fork): ``train --epochs 2 --keep-checkpoints 1`` (the defaults
    otherwise: Adam, window 1), read by the resume tests through a copy each (`_copy_of_w1_run`)."""
    run_dir = tmp_path_factory.mktemp("full") / "w1"
    proc = fork_flodl("train", "--run-dir", str(run_dir), "--epochs", str(W1_EPOCHS), "--keep-checkpoints", "1",
                      "-q", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def _copy_of_w1_run(w1_run: Path, dest: Path) -> Path:
    shutil.copytree(w1_run, dest)
    return dest


def test_a_resume_whose_metrics_rebuild_meets_a_full_disk_says_so_and_the_next_one_finishes(tmp_path, _w1_run):
    """The finished run is a copy of the module's 2-epoch run at 1 rank (`_w1_run`; was the session's run A
    at 2 ranks, and before it a 2-epoch run of this test's own), resumed to 3 epochs (was 6) in forks."""
    mnt = _tmpfs(tmp_path, "40m")
    run_dir = mnt / "r"
    try:
        _copy_of_w1_run(_w1_run, run_dir)
        metrics = run_dir / "metrics.h5"
        md5 = hashlib.md5(metrics.read_bytes()).hexdigest()
        assert metrics.stat().st_size > 48 * 1024  # a copy of it cannot fit in what _fill leaves
        filler = _fill(mnt, 48 * 1024)  # the small files fit, not a copy of metrics.h5
        t0 = time.monotonic()
        proc = fork_flodl("train", "--run-dir", str(run_dir), "--epochs", str(W1_EPOCHS + 1), "--resume", "-q",
                          timeout=240)
        assert time.monotonic() - t0 < 240
        assert proc.returncode == EXIT_ERROR, proc.stderr[-3000:]
        lines = [line for line in proc.stderr.splitlines() if "error:" in line]
        assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert lines[0].startswith(f"flodl-mpi: error: run dir {run_dir}: No space left on device: could not "
                                   "write "), lines[0]
        assert hashlib.md5(metrics.read_bytes()).hexdigest() == md5
        assert not (run_dir / "metrics.h5.resume-tmp").exists()
        filler.unlink()
        again = fork_flodl("train", "--run-dir", str(run_dir), "--epochs", str(W1_EPOCHS + 1), "--resume",
                           timeout=240)
        assert again.returncode == 0, again.stderr[-3000:]
        assert "killed" not in again.stdout
        assert len(read_table(metrics, "epochs")["epoch"]) == W1_EPOCHS + 1
    finally:
        _umount(mnt)


def test_a_resume_removes_every_temporary_file_an_earlier_run_left_and_says_so(tmp_path, _w1_run):
    """Held by the lock, any ``*.tmp-<pid>`` is stale, whatever the pid: 1 (always alive) and this test's own
    included. Before: those of live pids stayed forever. The finished run is a copy of the module's 2-epoch
    run at 1 rank (`_w1_run`, `W1_ROUNDS` = 45 rounds an epoch; was the session's run A at 2 ranks, 23 rounds
    an epoch), resumed in a fork to 3 epochs (was 6): the left checkpoint is the 3rd epoch's, at round
    3 x 45 = 135 (was the 6th's, ckpt-e000006-r000138)."""
    run_dir = _copy_of_w1_run(_w1_run, tmp_path / "r")
    ckpts = run_dir / "checkpoints"
    name = f"ckpt-e{W1_EPOCHS + 1:06d}-r{(W1_EPOCHS + 1) * W1_ROUNDS:06d}.h5"
    assert name == "ckpt-e000003-r000135.h5"
    left = {ckpts / f"{name}.tmp-1": 1_000_000, ckpts / f"save-check.h5.tmp-{os.getpid()}": 4096,
            run_dir / "metrics.h5.resume-tmp": 2048}
    for path, size in left.items():
        path.write_bytes(np.random.default_rng(0).bytes(size))
    proc = fork_flodl("train", "--run-dir", str(run_dir), "--epochs", str(W1_EPOCHS + 1), "--resume", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = ("warning: removed 3 temporary files an earlier run left unfinished (killed or failed while writing), "
            f"1.0 MB in all: checkpoints/{name}.tmp-1 (1.0 MB), checkpoints/save-check.h5.tmp-"
            f"{os.getpid()} (4.1 kB), metrics.h5.resume-tmp (2.0 kB)")
    assert proc.stdout.count(line) == 1, proc.stdout[-3000:]
    assert (run_dir / "train.log").read_text().count(line) == 1
    assert not any(p.exists() for p in left)
    assert not [p for p in ckpts.iterdir() if ".tmp-" in p.name]
    assert (ckpts / name).exists()  # the resume wrote the checkpoint whose temporary was left


def test_a_resume_with_every_checkpoint_damaged_starts_again_and_keeps_the_history(tmp_path, _w1_run):
    """The finished run is a copy of the module's 2-epoch run at 1 rank (`_w1_run`, ``--keep-checkpoints 1``,
    as this test's own 2-rank run was), resumed in a fork (was: launched at 2 ranks)."""
    run_dir = _copy_of_w1_run(_w1_run, tmp_path / "r")
    old = {t: read_table(run_dir / "metrics.h5", t) for t in ("rounds", "epochs")}
    (ckpt,) = list_checkpoints(run_dir / "checkpoints")
    os.truncate(ckpt, ckpt.stat().st_size // 2)
    proc = fork_flodl("train", "--run-dir", str(run_dir), "--epochs", str(W1_EPOCHS), "--keep-checkpoints", "1",
                      "--resume", "auto", "-q", timeout=240)  # a plain --resume refuses it (test_resume_target.py)
    assert proc.returncode == 0, proc.stderr[-3000:]
    kept = sorted(run_dir.glob("metrics.h5.before-restart-*"))
    assert len(kept) == 1
    n_rounds, n_epochs = len(old["rounds"]["round"]), len(old["epochs"]["epoch"])
    assert (n_rounds, n_epochs) == (W1_EPOCHS * W1_ROUNDS, W1_EPOCHS)
    line = (f"warning: every checkpoint in {run_dir / 'checkpoints'} is damaged ({ckpt.name}; kept as *.damaged): "
            f"the run starts again from epoch 1; metrics.h5's history ({n_rounds} rounds, {n_epochs} epochs) kept "
            f"as {kept[0].name}")
    assert proc.stdout.count(line) == 1, proc.stdout[-3000:]  # shown under -q: a warning
    assert (run_dir / "train.log").read_text().count(line) == 1
    for table, columns in old.items():
        history = read_table(kept[0], table)
        for name, values in columns.items():
            np.testing.assert_array_equal(history[name], values)
    assert len(read_table(run_dir / "metrics.h5", "epochs")["epoch"]) == W1_EPOCHS  # the run again, from epoch 1
    assert (run_dir / "checkpoints" / (ckpt.name + ".damaged")).exists()
