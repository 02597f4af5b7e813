"""One run at a time in a run directory: a second run is refused (exit 2) and touches nothing of the first.

The refused runs are a world of 1 in a fork of this process (``fork_flodl`` / ``fork_python``: torch loaded,
about half a CPU second each, where a 2-rank launch costs about 9), but one: a 2-rank ``--resume`` refused
while the lock is held, for "every rank exits 2, one line between them". A live run that a second one must
find holding the lock, or that is killed by pid, is a real process: a 1-rank launch (``start_flodl``; was 2
ranks): the lock is rank 0's, the other ranks hold none.
"""

import fcntl
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flodl_mpi.outputs import run_dir_lock
from flodl_mpi.outputs.checkpoint import latest_checkpoint
from flodl_mpi.errors import EXIT_INPUT, EXIT_STOPPED
from flodl_mpi.outputs.metrics import read_table
from tests.conftest import fork_flodl, fork_python, rank_pids, run_flodl, start_flodl

pytestmark = pytest.mark.slow

IN_USE = "is in use by another run (it holds .lock); wait for it to end or choose another directory"


def _snapshot(run_dir: Path) -> dict[str, str]:
    """Every file under ``run_dir`` (but the lock file) -> sha256 of its bytes."""
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name != run_dir_lock.LOCK_NAME}


def _start_until_a_checkpoint(run_dir: Path, epochs: int, *args: str) -> subprocess.Popen:
    """A 1-rank run in ``run_dir`` in the background (one torch thread, as in a fork), returned once its first
    checkpoint is on disk (<= 180 s)."""
    proc = start_flodl(1, "train", "--epochs", str(epochs), *args, "--run-dir", str(run_dir),
                       env={"OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 180
    while latest_checkpoint(run_dir / "checkpoints") is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc


class _Held:
    """This test process holds ``run_dir``'s lock, as a live run's rank 0 does."""

    def __init__(self, run_dir: Path) -> None:
        self.fd = os.open(run_dir / run_dir_lock.LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)


def test_claim_is_exclusive_across_processes_and_released_on_close(tmp_path):
    """The lock module alone: a second process cannot claim a held directory; release frees it."""
    run_dir_lock.claim(tmp_path)
    code = ("import sys; from flodl_mpi.outputs import run_dir_lock as L\n"
            "try:\n L.claim(sys.argv[1])\nexcept L.RunDirInUse as e:\n print(e); sys.exit(2)\n")
    probe = [sys.executable, "-c", code, str(tmp_path)]
    refused = subprocess.run(probe, capture_output=True, text=True, timeout=60, check=False)
    assert refused.returncode == 2 and IN_USE in refused.stdout
    assert run_dir_lock.in_use(tmp_path)
    run_dir_lock.release(tmp_path)
    assert subprocess.run(probe, capture_output=True, text=True, timeout=60, check=False).returncode == 0
    assert not run_dir_lock.in_use(tmp_path)


@pytest.fixture(scope="module")
def _finished_run(tmp_path_factory) -> Path:
    """A finished 1-epoch run at a world of 1 (a fork), copied by the tests that need one."""
    run_dir = tmp_path_factory.mktemp("lock") / "done"
    proc = fork_flodl("train", "--epochs", "1", "--run-dir", str(run_dir), "-q", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def test_a_resume_of_a_run_dir_in_use_is_refused_and_touches_nothing(tmp_path, _finished_run):
    """While another process holds the lock, ``--resume`` (and a fresh run) exit 2 with one line within the
    time bound, and every file of the run, a leftover ``metrics.h5.resume-tmp`` included, stays byte-identical.

    The run is a copy of the module's finished 1-epoch run (`_finished_run`; was the session's run A, 5 epochs
    at 2 ranks: any finished run will do). ``--resume`` is refused at 2 ranks, launched (one line, from rank
    0: the module's docstring); the fresh run in a fork at 1 rank (was: launched at 2)."""
    run_dir = tmp_path / "r"
    shutil.copytree(_finished_run, run_dir)
    live_tmp = run_dir / "metrics.h5.resume-tmp"  # as a live run's rebuild of metrics.h5 leaves it
    live_tmp.write_bytes(b"a live run's unfinished copy")
    before = _snapshot(run_dir)
    with _Held(run_dir):
        for extra in (("--resume",), ()):
            t0 = time.monotonic()
            args = ("train", "--epochs", "2", "--run-dir", str(run_dir), *extra)
            second = run_flodl(2, *args, timeout=120) if extra else fork_flodl(*args, timeout=120)
            assert time.monotonic() - t0 < 120
            assert second.returncode == EXIT_INPUT, second.stderr[-2000:]
            assert f"--run-dir '{run_dir}' {IN_USE}" in second.stderr
            assert second.stderr.count(IN_USE) == 1  # one line, from rank 0
            assert "Traceback" not in second.stderr
            assert _snapshot(run_dir) == before
    assert live_tmp.read_bytes() == b"a live run's unfinished copy"


def test_a_second_run_on_a_live_run_dir_is_refused_and_the_first_goes_on(tmp_path):
    """Two real runs: the second (``--resume``) is refused while the first trains; the first then stops on
    request and its metrics.h5 holds each epoch once, in order; train.log holds nothing of the second.
    The first is a 1-rank launch (was 2 ranks), the second a world of 1 in a fork (was 2 ranks, launched; a
    2-rank refusal of a held lock: the test above)."""
    run_dir = tmp_path / "r"
    first = _start_until_a_checkpoint(run_dir, 400)
    try:
        assert first.poll() is None, "the first run ended before the second could start"
        second = fork_flodl("train", "--epochs", "400", "--run-dir", str(run_dir), "--resume", timeout=120)
        assert second.returncode == EXIT_INPUT and IN_USE in second.stderr, second.stderr[-2000:]
        assert first.poll() is None, "the first run ended before the second was refused"
        for pid in rank_pids(first, f"--run-dir {run_dir}"):
            os.kill(pid, signal.SIGUSR1)
        _, err = first.communicate(timeout=180)
    finally:
        first.kill()
        first.communicate()
    assert first.returncode == EXIT_STOPPED, err[-3000:]
    epochs = read_table(run_dir / "metrics.h5", "epochs")["epoch"]
    assert list(epochs) == list(range(1, len(epochs) + 1))
    assert "in use" not in (run_dir / "train.log").read_text()
    assert not run_dir_lock.in_use(run_dir)  # released at the end


def test_a_run_killed_with_sigkill_leaves_no_stale_lock(tmp_path):
    """kill -9 of every rank: the operating system drops the lock; ``--resume`` goes on (exit 0). The run is a
    1-rank launch (was 2 ranks; the lock is rank 0's); the report and the resume are forks at 1 rank (were a
    ``python -m flodl_mpi report`` and a 2-rank launch)."""
    run_dir = tmp_path / "k"
    # batches of 2 (718 rounds an epoch): the kill lands while the run trains (at batch 32 a quiet machine can
    # finish the 2 epochs after the first checkpoint, 45 rounds each, before it)
    batch = ("--batch-size", "2")
    proc = _start_until_a_checkpoint(run_dir, 3, *batch)
    try:
        assert run_dir_lock.in_use(run_dir)
        for pid in rank_pids(proc, f"--run-dir {run_dir}"):
            os.kill(pid, signal.SIGKILL)
        proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.communicate()
    assert not run_dir_lock.in_use(run_dir)
    report = fork_flodl("report", str(run_dir), timeout=120)
    assert "of 3 (not running: ended without a final record (crashed or killed))" in report.stdout, report.stdout
    resumed = fork_flodl("train", "--epochs", "3", *batch, "--run-dir", str(run_dir), "--resume", timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout


def test_report_tells_running_stopped_failed_and_killed_apart(tmp_path):
    """report's word for a run with epochs left: its lock and train.log's last line decide."""
    from flodl_mpi.cli.report import _unfinished

    assert _unfinished(tmp_path) == "running or stopped"  # no lock file: an older run, cannot tell
    (tmp_path / "train.log").write_text("12:00:00 epoch 1/5 ...\n")
    run_dir_lock.claim(tmp_path)
    assert _unfinished(tmp_path) == "running"
    run_dir_lock.release(tmp_path)
    assert _unfinished(tmp_path) == "not running: ended without a final record (crashed or killed)"
    (tmp_path / "train.log").write_text("12:00:01 stopped, not done (5 epochs asked); exit status 4: ...\n")
    assert _unfinished(tmp_path) == "stopped"
    (tmp_path / "train.log").write_text("12:00:01 run failed: CohortError: ...\n")
    assert _unfinished(tmp_path) == "not running: failed (train.log's last line says why)"


_API = """
import sys
import torch
from torch import nn
import flodl_mpi
from flodl_mpi.errors import InputError

run_dir, kind = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = nn.Linear(4, 3)
try:
    if kind == "averager":
        with flodl_mpi.Averager(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), run_dir=run_dir,
                                resume="auto") as avg:  # once the lock is free: a run dir without a checkpoint
            pass
    else:
        x, y = torch.rand(32, 4), torch.randint(0, 3, (32,))
        flodl_mpi.fit(lambda: nn.Linear(4, 3), data={"train": (x, y), "test": (x, y)}, epochs=1,
                      batch_size=8, run_dir=run_dir, resume="auto").wait()
except InputError as exc:
    print("REFUSED", exc)
    sys.exit(2)
print("RAN")
"""


@pytest.mark.parametrize("kind", ["averager", "fit"])
def test_the_api_refuses_a_run_dir_in_use_too(tmp_path, kind):
    """``Averager`` and ``fit`` share the CLI's run-dir claim: refused (InputError) while the lock is held,
    nothing touched; once it is free, the same call runs. Both calls are a world of 1 in a fork (were
    ``python -c``: the same world, a torch import each)."""
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    script = tmp_path / "api.py"
    script.write_text(_API)
    with _Held(run_dir):
        t0 = time.monotonic()
        proc = fork_python(script, str(run_dir), kind, timeout=120)
        assert time.monotonic() - t0 < 120
        assert proc.returncode == 2 and "REFUSED" in proc.stdout, proc.stdout + proc.stderr[-2000:]
        assert "is in use by another run (it holds .lock)" in proc.stdout
        assert sorted(p.name for p in run_dir.iterdir()) == [run_dir_lock.LOCK_NAME]
    proc = fork_python(script, str(run_dir), kind, timeout=300)
    assert proc.returncode == 0 and "RAN" in proc.stdout, proc.stdout + proc.stderr[-2000:]
