"""End to end: `mpiexec -n N flodl-mpi train` on the built-in digits, as a user runs it."""

import math

import numpy as np
import pytest
import torch

from flodl_mpi.policy.cadence import fixed_quotas, plan_window
from flodl_mpi.outputs.checkpoint import latest_checkpoint, load_state_dict, read_checkpoint
from flodl_mpi.training.data import default_digits_path, load_dataset
from flodl_mpi.outputs.metrics import read_table
from flodl_mpi.training.models import digits_mlp
from flodl_mpi.training.task import evaluate
from tests._runs import RUN_A, RUN_B, session_run_a, session_run_b, trained_stdout
from tests.conftest import fork_flodl, run_flodl

pytestmark = pytest.mark.slow

# 5 epochs reach test accuracy 0.95-0.97 at 1-3 ranks (10 add little but time).
EPOCHS = 5


def expected_windows(world_size: int, window: int, n_batches: int) -> list[tuple[int, ...]]:
    counts, cursor = [], 0
    while cursor < n_batches:
        w = plan_window(fixed_quotas(world_size, window), cursor, n_batches)
        counts.append(w.counts)
        cursor = w.end
    return counts


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_train_digits(tmp_path, tmp_path_factory, world_size):
    if world_size == 2:  # the session's run A (tests/_runs.py), which other modules read: this command
        assert RUN_A[1:] == ("--epochs", str(EPOCHS))
        run_dir = session_run_a(tmp_path_factory)
        stdout = trained_stdout("A")
    else:
        run_dir = tmp_path / "run"
        # One torch thread a rank, as each rank of 2 or 3 gets on this 2-core machine: a lone rank would take
        # both cores, whose second thread mostly spins here (the thread rule: tests/runtime/test_launch.py).
        proc = run_flodl(world_size, "train", "--epochs", str(EPOCHS), "--run-dir", str(run_dir), timeout=400,
                         env={"OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        stdout = proc.stdout
    assert "policy sync (a round after every batch)" in stdout  # the header says the policy once, plainly

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
    # epoch counts from 1, as in the log ("epoch 3/10") and the checkpoint names
    np.testing.assert_array_equal(epochs["epoch"], np.arange(1, EPOCHS + 1))
    assert f"epoch {EPOCHS}/{EPOCHS} " in stdout
    np.testing.assert_array_equal(epochs["per_rank_samples"].sum(axis=1), [data.train.n] * EPOCHS)
    batches = read_table(run_dir / "metrics.h5", "batches")
    assert len(batches["rank"]) == n_batches * EPOCHS
    np.testing.assert_array_equal(np.bincount(batches["epoch"]), [0] + [n_batches] * EPOCHS)
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


def test_fixed_window_policy(tmp_path_factory):
    # The session's run B (tests/_runs.py, shared with test_report): 2 ranks, 3 epochs, --window 4 --gamma 0.5.
    assert RUN_B[1:] == ("--epochs", "3", "--window", "4", "--gamma", "0.5")
    run_dir = session_run_b(tmp_path_factory)
    assert "policy window (4 batches per rank per round)" in trained_stdout("B")
    data = load_dataset(default_digits_path())
    windows = expected_windows(2, 4, math.ceil(data.train.n / 32)) * 3
    rounds = read_table(run_dir / "metrics.h5", "rounds")
    np.testing.assert_array_equal(rounds["steps"], np.array(windows))
    np.testing.assert_allclose(rounds["mass"], np.sqrt(np.array(windows, dtype=float)))
    assert np.all(rounds["anchor"] == 4)
    assert read_table(run_dir / "metrics.h5", "epochs")["test_accuracy"][-1] > 0.8


# The digits' 1437 training samples leave a lone sample at each of these batch sizes,
# which used to make a 1-sample batch that BatchNorm (in the built-in model) rejects.
BATCH_CASES = [(2, False), (4, False), (359, False), (718, False), (1436, False), (4, True)]


def _plan_assertions(n: int, batch_size: int, drop_last: bool) -> tuple[int, int]:
    """The batch plan's counts asserted for a run of 1 epoch: (batches, samples trained)."""
    full = n // batch_size  # batches; the lone sample folded into the last one, or dropped
    trained = full * batch_size if drop_last else n
    return full, trained


def test_every_batch_size_trains_with_batchnorm(tmp_path):
    """One run (batch 4, a lone sample folded into the last batch): the run's metrics.h5 has the plan's counts.
    A world of 1 in a fork (was a 2-rank launch): the counts asserted are the epoch's, summed over ranks (the
    plan's 359 batches of 1437 samples, whatever the world size); whole runs at 1-3 ranks: test_train_digits.
    The other cases of `BATCH_CASES` were one launch each (test_every_batch_size_trains_with_batchnorm[...]
    in this module): the same assertions, now in one process by `test_every_batch_size_plan_trains_in_process`."""
    batch_size, drop_last = 4, False
    run_dir = tmp_path / "run"
    # --window 8: the batch plan is the policy's own business; fewer rounds make the test quicker.
    proc = fork_flodl("train", "--epochs", "1", "--batch-size", str(batch_size), "--window", "8",
                      "--run-dir", str(run_dir), timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    full, trained = _plan_assertions(1437, batch_size, drop_last)
    epochs = read_table(run_dir / "metrics.h5", "epochs")
    assert int(epochs["batches"][0]) == full
    assert int(epochs["per_rank_samples"].sum()) == trained  # each sample once (or dropped with --drop-last)
    assert len(read_table(run_dir / "metrics.h5", "batches")["step"]) == full


@pytest.mark.parametrize("batch_size, drop_last", BATCH_CASES)
def test_every_batch_size_plan_trains_in_process(batch_size, drop_last):
    """Was test_every_batch_size_trains_with_batchnorm[batch_size-drop_last] (one launch each): the same
    assertions, now in one process. The epoch's plan has the batches the run recorded (``epochs/batches``,
    one ``batches`` row each), its batches hold each sample once (``per_rank_samples`` summed; with
    ``--drop-last`` the left-over ones dropped), and the built-in model (BatchNorm) takes a training step on
    every batch size of the plan, as a rank does (the launched case shows the run records these counts)."""
    from flodl_mpi.training.data import batch_indices, epoch_permutation, num_batches

    data = load_dataset(default_digits_path())
    n = data.train.n
    assert n == 1437
    full, trained = _plan_assertions(n, batch_size, drop_last)
    assert num_batches(n, batch_size, drop_last) == full
    perm = epoch_permutation(n, 0, 0)
    batches = [batch_indices(perm, batch_size, b, drop_last) for b in range(full)]
    samples = np.concatenate(batches)
    assert len(samples) == trained and len(np.unique(samples)) == trained  # each sample once
    model = digits_mlp(data.input_shape, data.num_classes)
    model.train()
    for size in sorted({len(b) for b in batches}):  # BatchNorm rejects a training batch of 1 sample
        assert size >= 2
        batch = batches[[len(b) for b in batches].index(size)]
        x = torch.as_tensor(np.asarray(data.train.x[np.sort(batch)]), dtype=torch.float32)
        y = torch.as_tensor(np.asarray(data.train.y[np.sort(batch)]), dtype=torch.long)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        assert torch.isfinite(loss)
