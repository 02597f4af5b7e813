"""What a finished run's resume and a stop on an epoch's last round say and write (trial7 F10).

Every run here is at a world of 1 in a forked child of pytest (tests/conftest.py's fork_flodl; they were
1-rank launches): what a run says and writes needs no peer.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flodl_mpi.training.data import ensure_digits, load_dataset, num_batches
from flodl_mpi.errors import EXIT_STOPPED
from tests.conftest import fork_flodl

pytestmark = pytest.mark.slow

BATCH = ("--batch-size", "128")


def _snapshot(run_dir: Path) -> dict:
    """Every file but train.log: bytes and modification time."""
    return {p.relative_to(run_dir): (p.read_bytes(), os.stat(p).st_mtime_ns)
            for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name != "train.log"}


def test_a_finished_run_resumed_does_nothing_writes_nothing_and_says_so(tmp_path):
    run_dir = tmp_path / "r"
    first = fork_flodl("train", *BATCH, "--epochs", "2", "--run-dir", str(run_dir), timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    before = _snapshot(run_dir)
    for epochs in ("2", "1"):
        again = fork_flodl("train", *BATCH, "--epochs", epochs, "--run-dir", str(run_dir), "--resume", timeout=300)
        assert again.returncode == 0, again.stderr[-3000:]
        assert (f"nothing to do: the run already did 2 epochs (--epochs {epochs}); raise --epochs to train further; "
                "no checkpoint, metrics.h5 or config record written") in again.stdout
        assert "finishing:" not in again.stdout and "final save" not in again.stdout
        assert _snapshot(run_dir) == before  # no config-resume-*.json, metrics.h5 and checkpoints untouched
    log = (run_dir / "train.log").read_text()
    assert log.count("nothing to do: the run already did 2 epochs") == 2


@pytest.mark.parametrize("at_end", [True, False])
def test_a_stop_on_an_epochs_last_round_says_the_epoch_completed(tmp_path, at_end):
    n = num_batches(load_dataset(ensure_digits()).train.n, 128, False)  # 1 rank, window 1: a round a batch
    stop = n if at_end else n - 1
    proc = fork_flodl("train", *BATCH, "--epochs", "2", "--run-dir", str(tmp_path / "r"),
                      hooks=("--stop-at-round", str(stop)), timeout=300)
    assert proc.returncode == EXIT_STOPPED, proc.stderr[-3000:]
    if at_end:
        assert "epoch 1/2 (complete: the stop came with its last round)  loss" in proc.stdout
        assert f"of {n} batches" not in proc.stdout
    else:
        assert f"epoch 1/2 (stopped after {n - 1} of {n} batches)  loss" in proc.stdout
