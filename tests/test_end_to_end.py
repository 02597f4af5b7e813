"""End to end: `mpiexec -n N flodl-mpi train` on the built-in digits, as a user runs it."""

import math

import numpy as np
import pytest
import torch

from flodl_mpi.cadence import fixed_quotas, plan_window
from flodl_mpi.checkpoint import latest_checkpoint, load_state_dict, read_checkpoint
from flodl_mpi.data import default_digits_path, load_dataset
from flodl_mpi.metrics import read_table
from flodl_mpi.models import digits_mlp
from flodl_mpi.worker import evaluate
from tests.conftest import run_flodl

pytestmark = pytest.mark.slow

EPOCHS = 10


def expected_windows(world_size: int, window: int, n_batches: int) -> list[tuple[int, ...]]:
    counts, cursor = [], 0
    while cursor < n_batches:
        w = plan_window(fixed_quotas(world_size, window), cursor, n_batches)
        counts.append(w.counts)
        cursor = w.end
    return counts


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_train_digits(tmp_path, world_size):
    run_dir = tmp_path / "run"
    proc = run_flodl(world_size, "train", "--epochs", str(EPOCHS), "--run-dir", str(run_dir), timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]

    data = load_dataset(default_digits_path())
    n_batches = math.ceil(data.train.n / 32)
    windows = expected_windows(world_size, 1, n_batches) * EPOCHS

    # -- one record per round, with every rank's steps, masses and divergences
    rounds = read_table(run_dir / "metrics.h5", "rounds")
    assert len(rounds["round"]) == len(windows)
    np.testing.assert_array_equal(rounds["round"], np.arange(len(windows)))
    np.testing.assert_array_equal(rounds["version"], np.arange(1, len(windows) + 1))
    np.testing.assert_array_equal(rounds["steps"], np.array(windows))  # sync: steps = batches run
    np.testing.assert_array_equal(rounds["mass"], np.array(windows, dtype=float))  # gamma 1: mass = steps
    assert rounds["divergence"].shape == (len(windows), world_size)
    assert np.all(np.isfinite(rounds["divergence"])) and np.all(rounds["divergence"] >= 0)
    if world_size == 1:
        assert np.all(rounds["divergence"] == 0.0)  # one rank always agrees with itself
    else:
        # Where every rank moved, replicas had drifted apart; where only rank 0
        # moved (the epoch's last window), the consensus is rank 0's own params.
        everyone = np.all(np.array(windows) > 0, axis=1)
        assert np.all(rounds["divergence"][everyone] > 0)
        only_rank0 = np.all(np.array(windows)[:, 1:] == 0, axis=1)
        assert np.all(rounds["divergence"][only_rank0, 0] <= 1e-6)

    # -- per epoch and per batch
    epochs = read_table(run_dir / "metrics.h5", "epochs")
    np.testing.assert_array_equal(epochs["epoch"], np.arange(EPOCHS))
    np.testing.assert_array_equal(epochs["per_rank_samples"].sum(axis=1), [data.train.n] * EPOCHS)
    batches = read_table(run_dir / "metrics.h5", "batches")
    assert len(batches["rank"]) == n_batches * EPOCHS
    assert sorted(set(batches["rank"].tolist())) == list(range(world_size))
    final_accuracy = float(epochs["test_accuracy"][-1])
    print(f"{world_size} rank(s), {EPOCHS} epochs: test accuracy {final_accuracy:.4f}")
    assert final_accuracy >= 0.93

    # -- the checkpoint loads into the model and reproduces the logged accuracy
    path = latest_checkpoint(run_dir / "checkpoints")
    ckpt = read_checkpoint(path)
    assert ckpt.meta["epoch"] == EPOCHS and ckpt.meta["round"] == len(windows)
    model = digits_mlp(data.input_shape, data.num_classes)
    model.load_state_dict(load_state_dict(path))
    _, correct, count = evaluate(model, data.test, 0, 1, torch.device("cpu"), 1024)
    assert count == data.test.n
    assert correct / count == final_accuracy == ckpt.meta["test_accuracy"]


def test_fixed_window_policy(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_flodl(2, "train", "--epochs", "3", "--window", "4", "--gamma", "0.5", "--run-dir", str(run_dir),
                     timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = load_dataset(default_digits_path())
    windows = expected_windows(2, 4, math.ceil(data.train.n / 32)) * 3
    rounds = read_table(run_dir / "metrics.h5", "rounds")
    np.testing.assert_array_equal(rounds["steps"], np.array(windows))
    np.testing.assert_allclose(rounds["mass"], np.sqrt(np.array(windows, dtype=float)))
    assert np.all(rounds["anchor"] == 4)
    assert read_table(run_dir / "metrics.h5", "epochs")["test_accuracy"][-1] > 0.8


def _final_state(run_dir):
    ckpt = read_checkpoint(latest_checkpoint(run_dir / "checkpoints"))
    return ckpt, {**ckpt.params, **ckpt.buffers}


def test_resume_after_a_stop_mid_epoch_continues_as_if_never_interrupted(tmp_path):
    """Stop a run with SIGUSR1 somewhere in epoch 2, resume it: the weights end bit-identical."""
    import os
    import signal
    import time

    from flodl_mpi.errors import EXIT_STOPPED
    from tests.conftest import rank_pids, start_flodl

    epochs = ("--epochs", "4")
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert run_flodl(2, "train", *epochs, "--run-dir", str(straight), timeout=300).returncode == 0

    proc = start_flodl(2, "train", *epochs, "--run-dir", str(stopped))
    try:
        deadline, rows = time.monotonic() + 120, 0
        while rows < 30 and time.monotonic() < deadline:  # into epoch 2 (23 rounds an epoch)
            time.sleep(0.05)
            if (stopped / "metrics.h5").exists():
                rows = len(read_table(stopped / "metrics.h5", "rounds")["round"])
        for pid in rank_pids(proc, f"--run-dir {stopped}"):
            os.kill(pid, signal.SIGUSR1)
        proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.communicate()  # closes the pipes
    assert proc.returncode == EXIT_STOPPED  # stopped, resumable: not done
    ckpt, _ = _final_state(stopped)
    assert ckpt.meta["reason"] == "graceful_shutdown" and ckpt.meta["round"] < 92

    resumed = run_flodl(2, "train", *epochs, "--run-dir", str(stopped), "--resume", timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    a_meta, a = _final_state(straight)
    b_meta, b = _final_state(stopped)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert a_meta.meta["test_accuracy"] == b_meta.meta["test_accuracy"]
    # metrics.h5 reads like one run: every round once, in order; one row per epoch; a clock that only grows
    rounds = read_table(stopped / "metrics.h5", "rounds")
    np.testing.assert_array_equal(rounds["round"], np.arange(92))
    np.testing.assert_array_equal(rounds["steps"], read_table(straight / "metrics.h5", "rounds")["steps"])
    assert np.all(np.diff(rounds["time_s"]) >= 0)
    epochs, epochs_straight = (read_table(d / "metrics.h5", "epochs") for d in (stopped, straight))
    np.testing.assert_array_equal(epochs["epoch"], np.arange(4))
    np.testing.assert_array_equal(epochs["per_rank_batches"], epochs_straight["per_rank_batches"])
    np.testing.assert_allclose(epochs["avg_loss"], epochs_straight["avg_loss"], rtol=1e-12)
    np.testing.assert_array_equal(epochs["test_accuracy"], epochs_straight["test_accuracy"])
    batches = read_table(stopped / "metrics.h5", "batches")
    assert sorted(zip(batches["rank"], batches["step"])) == sorted(
        zip(*(read_table(straight / "metrics.h5", "batches")[k] for k in ("rank", "step"))))
    assert (stopped / "config.json").exists() and list(stopped.glob("config-resume-r*.json"))


def test_resume_refuses_other_options_and_world_sizes(tmp_path):
    run_dir = tmp_path / "r"
    assert run_flodl(2, "train", "--epochs", "1", "--run-dir", str(run_dir), timeout=300).returncode == 0
    other = run_flodl(2, "train", "--epochs", "2", "--run-dir", str(run_dir), "--resume", "--gamma", "0.5",
                      timeout=120)
    assert other.returncode == 2
    assert "--resume: the run in" in other.stderr and "--gamma 0.5 (was 1.0)" in other.stderr
    size = run_flodl(3, "train", "--epochs", "2", "--run-dir", str(run_dir), "--resume", timeout=120)
    assert size.returncode == 2 and "was written by 2 ranks; run with 2" in size.stderr
    fresh = run_flodl(2, "train", "--epochs", "1", "--run-dir", str(tmp_path / "new"), "--resume", timeout=300)
    assert fresh.returncode == 0  # nothing to resume: a requeued job's first start


def test_resume_after_kill_9_and_of_a_finished_run(tmp_path):
    """kill -9 leaves metrics.h5 open for write; resume still goes on from the last checkpoint."""
    import os
    import signal
    import time

    from tests.conftest import rank_pids, start_flodl

    run_dir = tmp_path / "k"
    proc = start_flodl(2, "train", "--epochs", "3", "--run-dir", str(run_dir))
    try:
        deadline = time.monotonic() + 120
        while latest_checkpoint(run_dir / "checkpoints") is None and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(max(rank_pids(proc, f"--run-dir {run_dir}")), signal.SIGKILL)
        proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.communicate()  # closes the pipes
    assert proc.returncode != 0
    saved = read_checkpoint(latest_checkpoint(run_dir / "checkpoints")).meta["round"]
    damaged = run_dir / "checkpoints" / "ckpt-e000009-r000999.h5"  # say, a truncated copy
    damaged.write_bytes(b"\x89HDF\r\n\x1a\n truncated")

    resumed = run_flodl(2, "train", "--epochs", "3", "--run-dir", str(run_dir), "--resume", "--lr", "0.002",
                        timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"round {saved}" in resumed.stdout
    assert "warning: ckpt-e000009-r000999.h5 is not a complete checkpoint" in resumed.stdout
    assert damaged.with_name(damaged.name + ".damaged").read_bytes().endswith(b"truncated")
    rounds = read_table(run_dir / "metrics.h5", "rounds")
    np.testing.assert_array_equal(rounds["round"], np.arange(3 * 23))  # rows after the checkpoint redone, once
    lr = read_table(run_dir / "metrics.h5", "batches")["lr"]
    assert set(lr[-10:]) == {0.002}  # a resume may change the learning rate

    again = run_flodl(2, "train", "--epochs", "3", "--run-dir", str(run_dir), "--resume", timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "nothing to do: 3 of 3 epoch(s) were done already" in again.stdout
