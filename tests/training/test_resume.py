"""Resuming a run: after a stop, a kill, damage on disk, at another world size; the final save."""

import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from flodl_mpi.outputs.checkpoint import latest_checkpoint, load_state_dict, read_checkpoint
from flodl_mpi.training.data import default_digits_path, load_dataset, num_batches
from flodl_mpi.errors import EXIT_INPUT, EXIT_STALL, EXIT_STOPPED
from flodl_mpi.outputs.metrics import read_table
from tests.conftest import MPIEXEC, flip_data_byte, fork_flodl, launch_argv, launch_env, run_flodl

pytestmark = pytest.mark.slow

HOOKED = str(Path(__file__).parents[1] / "hooked_flodl.py")
#: The exit statuses of a run stopped on request (stopped, resumable: not done).
STOPPED = (EXIT_STOPPED,)


def run_hooked(n, *args, timeout=300.0):
    """``mpiexec -n N python tests/hooked_flodl.py ARGS`` (hooks, then ``--``, then the CLI's arguments)."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    return subprocess.run(launch_argv(n, sys.executable, HOOKED, *args), env=launch_env(), capture_output=True,
                          text=True, timeout=timeout, cwd=str(Path(__file__).parents[2]), check=False)


def _final_state(run_dir):
    ckpt = read_checkpoint(latest_checkpoint(run_dir / "checkpoints"))
    return ckpt, {**ckpt.params, **ckpt.buffers}


#: A world of 1 (a fork of this process, tests/conftest.py's fork_flodl): 1437 digits samples at batch 32 are
#: ceil(1437 / 32) = 45 batches, and at window 1 one rank makes a round a batch: 45 rounds an epoch.
ONE_RANK_ROUNDS = 45
#: The uninterrupted run at a world of 1 that several tests here compare with or copy: 3 epochs, the defaults
#: otherwise (Adam, window 1, gamma 1; the newest 3 checkpoints kept: epochs 1-3).
STRAIGHT_EPOCHS = 3


@pytest.fixture(scope="module")
def straight_one(tmp_path_factory):
    """``flodl-mpi train --epochs 3`` at a world of 1, once for this module: read it, or copy it
    (``shutil.copytree``) to resume or refuse. Three epochs: a stop in epoch 2 is then followed by a whole
    epoch after the resumed one, and its checkpoints are epochs 1-3 (the newest 3 kept)."""
    run_dir = tmp_path_factory.mktemp("straight") / "r"
    proc = fork_flodl("train", "--epochs", str(STRAIGHT_EPOCHS), "--run-dir", str(run_dir), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run_dir


def assert_metrics_as_uninterrupted(stopped, straight, rounds_total: int, epochs_total: int) -> None:
    """The stopped-and-resumed run's metrics.h5 reads like the uninterrupted run's: every round once, in order,
    with the same steps; one row per epoch with the same per-rank batches, loss and accuracy; the same batch
    records; a clock that only grows."""
    rounds = read_table(stopped / "metrics.h5", "rounds")
    np.testing.assert_array_equal(rounds["round"], np.arange(rounds_total))
    np.testing.assert_array_equal(rounds["steps"], read_table(straight / "metrics.h5", "rounds")["steps"])
    assert np.all(np.diff(rounds["time_s"]) >= 0)
    epochs, epochs_straight = (read_table(d / "metrics.h5", "epochs") for d in (stopped, straight))
    np.testing.assert_array_equal(epochs["epoch"], np.arange(1, epochs_total + 1))
    np.testing.assert_array_equal(epochs["per_rank_batches"], epochs_straight["per_rank_batches"])
    np.testing.assert_allclose(epochs["avg_loss"], epochs_straight["avg_loss"], rtol=1e-12)
    np.testing.assert_array_equal(epochs["test_accuracy"], epochs_straight["test_accuracy"])
    batches = read_table(stopped / "metrics.h5", "batches")
    assert sorted(zip(batches["rank"], batches["step"])) == sorted(
        zip(*(read_table(straight / "metrics.h5", "batches")[k] for k in ("rank", "step"))))


def test_resume_after_a_stop_mid_epoch_continues_as_if_never_interrupted(tmp_path, straight_one, run_hook):
    """Stop a run with SIGUSR1 somewhere in epoch 2, resume it: the weights end bit-identical, and metrics.h5
    reads like the uninterrupted run's.

    A world of 1 in a fork (fork_flodl): the point is the resume, which needs no peer; the signal is a real
    SIGUSR1, which the training process sends itself from the ``round_start`` hook at round 60 (epoch 2,
    45 rounds an epoch), so the product's own handler takes it. It was a 2-rank launch signalled by pid
    (against run A); the same resume at 2 ranks, bit for bit on every rank, is
    test_integer_buffers_resume_per_rank_bitwise's, and a stop signal through mpiexec to the ranks by pid is
    tests/cli/test_cli.py's test_stop_signal_saves_and_exits_cleanly_while_metrics_are_read."""
    total = STRAIGHT_EPOCHS * ONE_RANK_ROUNDS  # 135
    epochs = ("--epochs", str(STRAIGHT_EPOCHS))
    stopped = tmp_path / "stopped"
    straight = straight_one  # read only
    sent = []

    def stop_in_epoch_2(trainer):
        if trainer.bridge.version == ONE_RANK_ROUNDS + 15 and not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGUSR1)

    run_hook("round_start", stop_in_epoch_2)  # the forked child's too
    first = fork_flodl("train", *epochs, "--run-dir", str(stopped), timeout=300)
    assert first.returncode == EXIT_STOPPED, first.stdout[-3000:] + first.stderr[-3000:]  # stopped, resumable
    ckpt, _ = _final_state(stopped)
    assert ckpt.meta["reason"] == "graceful_shutdown" and ckpt.meta["round"] < total
    assert ckpt.meta["epoch"] == 1  # one epoch done: the stop was in epoch 2
    assert not ckpt.meta["epoch_complete"] and 0 < ckpt.meta["cursor"] < 45  # the stop was mid-epoch

    resumed = fork_flodl("train", *epochs, "--run-dir", str(stopped), "--resume", timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    a_meta, a = _final_state(straight)
    b_meta, b = _final_state(stopped)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert a_meta.meta["test_accuracy"] == b_meta.meta["test_accuracy"]
    # metrics.h5 reads like one run: every round once, in order; one row per epoch; a clock that only grows
    assert_metrics_as_uninterrupted(stopped, straight, total, STRAIGHT_EPOCHS)
    assert (stopped / "config.json").exists() and list(stopped.glob("config-resume-r*.json"))


def test_resume_refuses_other_options(tmp_path, straight_one):
    """A refused resume writes nothing to train.log (issue 26 item 9: it left an orphan "torch threads:" line);
    ``--resume auto`` starts a run dir that does not exist and says so (issue 26 item 1).

    A world of 1 in a fork, on a copy of this module's finished run: the refusal and the new run need no
    peer (was: 2 launches at 2 ranks, on a copy of run A). A refusal at 2 ranks (every rank, one line,
    exit 2) is tests/cli/test_cli.py's."""
    run_dir = tmp_path / "r"
    shutil.copytree(straight_one, run_dir)  # a finished 3-epoch run at gamma 1 (its own copy)
    log = (run_dir / "train.log").read_bytes()
    other = fork_flodl("train", "--epochs", "6", "--run-dir", str(run_dir), "--resume", "--gamma", "0.5",
                       timeout=300)
    assert other.returncode == 2
    assert "--resume: the run in" in other.stderr and "--gamma 0.5 (was 1.0)" in other.stderr
    assert "rank(s) up; loading PyTorch" in other.stdout  # refused by the resume's checks, after train.log opened
    assert (run_dir / "train.log").read_bytes() == log
    new = tmp_path / "new"
    fresh = fork_flodl("train", "--epochs", "1", "--run-dir", str(new), "--resume", "auto", timeout=300)
    assert fresh.returncode == 0, fresh.stderr[-3000:]  # nothing to resume: a requeued job's first start
    line = f"no checkpoint in {new}: starting a new run"
    assert fresh.stdout.count(line) == 1, fresh.stdout[-3000:]
    logged = (new / "train.log").read_text().splitlines()
    assert [entry.split(" ", 1)[1] for entry in logged].count(line) == 1
    assert logged[-1].split(" ", 1)[1].startswith("done"), logged[-1]


def test_resume_after_kill_9_and_of_a_finished_run(tmp_path):
    """kill -9 leaves metrics.h5 open for write; resume still goes on from the last checkpoint.

    The killed run is a real 2-rank launch: the kill is of one rank of a launched run, by pid (its launcher
    then ends the other), which leaves metrics.h5 and the checkpoints as a crash does. The resumes are at a
    world of 1 in a fork (were 2-rank launches): reading back what the crash left needs no peer; the first
    goes on from the 2-rank checkpoint at another world size (resumes at another world size, at 2 and 3
    ranks: test_resume_at_another_world_size), the second, of the finished run, does nothing (at the run's
    own world size: tests/runtime/test_finished_and_stopped_lines.py)."""
    run_dir = tmp_path / "k"
    # Batches of 2 (359 rounds an epoch at 2 ranks, 718 at 1: 1437 samples, the lone one folded): the kill, made once the first checkpoint is
    # there, lands well before the run ends (at batch 32 a quiet machine ran the two epochs left, 23 rounds
    # each, before the kill did: the run had finished).
    batch = ("--batch-size", "2")
    two_rank_rounds, one_rank_rounds = -(-num_batches(1437, 2) // 2), num_batches(1437, 2)
    proc = subprocess.Popen(launch_argv(2, sys.executable, "-m", "flodl_mpi", "train", "--epochs", "3", *batch,
                             "--run-dir", str(run_dir)),
                             env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while latest_checkpoint(run_dir / "checkpoints") is None and time.monotonic() < deadline:
            time.sleep(0.05)
        pattern = f"--run-dir {run_dir}"
        pids = subprocess.run(["pgrep", "-f", "--", pattern], capture_output=True, text=True).stdout.split()
        os.kill(max(int(p) for p in pids if int(p) != proc.pid), signal.SIGKILL)
        proc.communicate(timeout=300)
    finally:
        proc.kill()
        proc.communicate()  # closes the pipes
    assert proc.returncode != 0
    meta = read_checkpoint(latest_checkpoint(run_dir / "checkpoints")).meta
    saved = meta["round"]
    # killed, not stopped: the newest checkpoint is an epoch's end; at 2 ranks, ceil(718 / 2) = 359 rounds an epoch
    assert meta["epoch_complete"] and 1 <= meta["epoch"] < 3 and saved == two_rank_rounds * meta["epoch"]
    damaged = run_dir / "checkpoints" / "ckpt-e000009-r000999.h5"  # say, a truncated copy
    damaged.write_bytes(b"\x89HDF\r\n\x1a\n truncated")

    resumed = fork_flodl("train", "--epochs", "3", *batch, "--run-dir", str(run_dir), "--resume", "--lr", "0.002",
                         timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"round {saved}" in resumed.stdout
    assert "warning: ckpt-e000009-r000999.h5 is damaged (not a complete checkpoint)" in resumed.stdout
    assert damaged.with_name(damaged.name + ".damaged").read_bytes().endswith(b"truncated")
    rounds = read_table(run_dir / "metrics.h5", "rounds")
    # rows after the checkpoint redone, once: the epochs left at one rank, 45 rounds each
    np.testing.assert_array_equal(rounds["round"], np.arange(saved + (3 - meta["epoch"]) * one_rank_rounds))
    lr = read_table(run_dir / "metrics.h5", "batches")["lr"]
    assert set(lr[-10:]) == {0.002}  # a resume may change the learning rate

    again = fork_flodl("train", "--epochs", "3", *batch, "--run-dir", str(run_dir), "--resume", timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "nothing to do: the run already did 3 epochs (--epochs 3)" in again.stdout


# ---------------------------------------------------------------- state-dict names HDF5 cannot hold

ODD_MODEL = """
import torch
from torch import nn


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({"conv1/7x7": nn.Linear(64, 32), "fc/out": nn.Linear(32, 10)})

    def forward(self, x):
        return self.layers["fc/out"](self.layers["conv1/7x7"](x).relu())


def make():
    return Odd()


class Complex(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 10)
        self.register_buffer("phase", torch.zeros(3, dtype=torch.complex64))

    def forward(self, x):
        return self.fc(x)


def make_complex():
    return Complex()

"""


def test_state_dict_names_with_slashes_train_checkpoint_resume_and_load_back(tmp_path):
    """A world of 1 in a fork (was 2 launches at 2 ranks): names HDF5 cannot hold as they are need no peer.
    2 epochs of 45 rounds (1437 samples at batch 32, one rank, window 1): the last checkpoint is round 90."""
    module = tmp_path / "odd.py"
    module.write_text(ODD_MODEL)
    run_dir = tmp_path / "r"
    args = ("train", "--model", f"{module}:make", "--epochs", "2", "--run-dir", str(run_dir))
    stopped = fork_flodl(*args, hooks=("--stop-at-round", "10"), timeout=300)
    assert stopped.returncode in STOPPED, stopped.stderr[-3000:]
    assert read_checkpoint(latest_checkpoint(run_dir / "checkpoints")).meta["round"] == 10
    resumed = fork_flodl(*args, "--resume", timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from ckpt-e000001-r000010.h5" in resumed.stdout

    path = latest_checkpoint(run_dir / "checkpoints")
    ckpt = read_checkpoint(path)
    assert ckpt.meta["epoch"] == 2 and ckpt.meta["round"] == 2 * ONE_RANK_ROUNDS
    state = load_state_dict(path)
    want = ["layers.conv1/7x7.weight", "layers.conv1/7x7.bias", "layers.fc/out.weight", "layers.fc/out.bias"]
    assert list(state) == want
    sys.path.insert(0, str(tmp_path))
    try:
        import odd
    finally:
        sys.path.remove(str(tmp_path))
    model = odd.make()
    model.load_state_dict(state)  # strict: exactly the model's names
    for name, value in model.state_dict().items():
        assert value.numpy().tobytes() == ckpt.params[name].tobytes(), name
    from flodl_mpi.outputs.checkpoint import escape_name

    with h5py.File(path, "r") as f:
        assert sorted(f["params"]) == sorted(escape_name(n) for n in want)


def test_a_model_the_checkpoint_cannot_store_is_refused_before_training(tmp_path):
    """A world of 1 in a fork (was a 2-rank launch): the refusal is the model's, before any peer matters; one
    line at 2 ranks (every rank refuses, one prints) is tests/cli/test_cli.py's refusals'."""
    module = tmp_path / "odd.py"
    module.write_text(ODD_MODEL)
    t0 = time.monotonic()
    proc = fork_flodl("train", "--model", f"{module}:make_complex", "--epochs", "1", "--run-dir",
                     str(tmp_path / "r"), timeout=300)
    assert proc.returncode == EXIT_INPUT, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("flodl-mpi:")]
    assert errors == [("flodl-mpi: error: the model's state cannot be saved in a checkpoint: tensor 'phase' has "
                       "dtype complex64; expected floating, integer or bool")]
    assert "epoch 1" not in proc.stdout and time.monotonic() - t0 < 200  # generous: a loaded machine
    # Nothing left on disk (the run dir this run made is removed), so the same command can run again.
    assert not (tmp_path / "r").exists()


# ---------------------------------------------------------------- integer buffers are each rank's own

BN_MODEL = """
from torch import nn


def make():
    # momentum=None: the running stats are a cumulative mean weighted by num_batches_tracked,
    # so a rank that resumes with another rank's counter drifts from the uninterrupted run.
    return nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32, momentum=None), nn.ReLU(), nn.Linear(32, 10))
"""


#: The BatchNorm run the per-rank tests share: 3 epochs (at 2 ranks: 45 batches an epoch, 23 rounds; rank 0
#: reads 23 batches an epoch, rank 1 22). A stop at round 30 is in epoch 2 (cursor 14: 7 rounds of 2 ranks),
#: and epoch 3 then runs whole after the resumed one.
BN_EPOCHS = 3


@pytest.fixture(scope="module")
def bn_common(tmp_path_factory):
    """The BatchNorm run's arguments (without ``--run-dir``), its model in a module file of this module's."""
    module = tmp_path_factory.mktemp("bn") / "bn.py"
    module.write_text(BN_MODEL)
    return ("train", "--model", f"{module}:make", "--epochs", str(BN_EPOCHS))


@pytest.fixture(scope="module")
def bn_straight(tmp_path_factory, bn_common):
    """The uninterrupted BatchNorm run at 2 ranks (read it only)."""
    run_dir = tmp_path_factory.mktemp("bn_straight") / "r"
    proc = run_flodl(2, *bn_common, "--run-dir", str(run_dir), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run_dir


def _stopped_bn_run(tmp_path_factory, bn_common, ranks: int, stop: int) -> Path:
    run_dir = tmp_path_factory.mktemp(f"bn_stopped_{ranks}") / "r"
    first = run_hooked(ranks, "--stop-at-round", str(stop), "--", *bn_common, "--run-dir", str(run_dir))
    assert first.returncode in STOPPED, first.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def bn_stopped_at_2(tmp_path_factory, bn_common):
    """The BatchNorm run at 2 ranks stopped after round 30 (mid-epoch 2), not resumed: copy it to resume it
    (at 2 ranks: the per-rank buffers' test; at 3: the world size's)."""
    return _stopped_bn_run(tmp_path_factory, bn_common, 2, 30)


def _every_rank_state(run_dir):
    """The final consensus and each rank's own integer buffers, from the last checkpoint."""
    ckpt = read_checkpoint(latest_checkpoint(run_dir / "checkpoints"))
    ints = {r: {k: v for k, v in arrays.items() if k.startswith("int_buffers/")}
            for r, (arrays, _) in ckpt.ranks.items()}
    return ckpt, {**ckpt.params, **ckpt.buffers}, ints


def test_integer_buffers_resume_per_rank_bitwise(tmp_path, bn_common, bn_straight, bn_stopped_at_2):
    """BatchNorm1d(momentum=None) stopped mid-epoch and resumed equals the uninterrupted run on every rank.

    Real 2-rank launches: the point is each rank's own counter. The stopped run (2 ranks, round 30) is
    shared with test_resume_at_another_world_size[2-3], which resumes its own copy at 3 ranks; 3 epochs
    (was 2), so that run has a whole epoch at its new world size. The resumed run's metrics.h5 reads like
    the uninterrupted one's at 2 ranks (every round once; the steps, the epochs' rows, each rank's batches),
    as test_resume_after_a_stop_mid_epoch_continues_as_if_never_interrupted checks at a world of 1."""
    stopped = tmp_path / "stopped"
    shutil.copytree(bn_stopped_at_2, stopped)
    meta = read_checkpoint(latest_checkpoint(stopped / "checkpoints")).meta
    assert (meta["epoch"], meta["cursor"], meta["round"]) == (1, 14, 30)  # mid-epoch 2: 45 batches an epoch
    resumed = run_flodl(2, *bn_common, "--run-dir", str(stopped), "--resume", timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    straight = bn_straight
    a_ckpt, a, a_ints = _every_rank_state(straight)
    b_ckpt, b, b_ints = _every_rank_state(stopped)
    assert a.keys() == b.keys()
    for name in a:  # a rank resumed with another rank's counter weights its running stats wrong
        assert a[name].tobytes() == b[name].tobytes(), name
    assert a_ckpt.meta["test_accuracy"] == b_ckpt.meta["test_accuracy"]
    nbt = "int_buffers/1.num_batches_tracked"
    # ceil(45 / 2) = 23 and 22 batches an epoch, 3 epochs: ranks differ
    assert [int(a_ints[r][nbt]) for r in (0, 1)] == [3 * 23, 3 * 22]
    for r in (0, 1):
        assert a_ints[r].keys() == b_ints[r].keys() == {nbt}
        assert int(b_ints[r][nbt]) == int(a_ints[r][nbt]), f"rank {r}"
    # metrics.h5 reads like the uninterrupted run's: 3 epochs of 23 rounds, each once, in order
    assert_metrics_as_uninterrupted(stopped, straight, BN_EPOCHS * 23, BN_EPOCHS)


# ---------------------------------------------------------------- another world size


@pytest.mark.parametrize("old, new", [(2, 3), (3, 2)])
def test_resume_at_another_world_size(tmp_path, tmp_path_factory, bn_common, old, new, request):
    """Real launches at 2 and 3 ranks: the point is the world size. The run is the BatchNorm one (3 epochs;
    the default model before), so what a new rank takes over includes an integer buffer; the 2-rank stop is
    the one test_integer_buffers_resume_per_rank_bitwise resumes (shared, this test resumes a copy)."""
    data = load_dataset(default_digits_path())
    n_batches = math.ceil(data.train.n / 32)
    per_epoch = {w: math.ceil(n_batches / w) for w in (2, 3)}  # rounds an epoch at window 1
    stop = per_epoch[old] + 7  # mid-epoch 2
    assert BN_EPOCHS == 3
    if old == 2:
        run_dir = tmp_path / "r"
        shutil.copytree(request.getfixturevalue("bn_stopped_at_2"), run_dir)  # stopped after round 30
        assert stop == 30
    else:
        run_dir = _stopped_bn_run(tmp_path_factory, bn_common, old, stop)  # this test's own
    common = (*bn_common, "--run-dir", str(run_dir))
    saved = read_checkpoint(latest_checkpoint(run_dir / "checkpoints")).meta
    assert (saved["epoch"], saved["cursor"], saved["world_size"]) == (1, 7 * old, old)

    resumed = run_flodl(new, *common, "--resume", timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (f"world size {old} -> {new}: rank r took the optimizer state, step count and integer buffers "
            f"of old rank r mod {old}") in resumed.stdout

    # the data cursor carried over exactly: epoch 2 finished the batches epoch 2 had left
    rest = n_batches - 7 * old
    rounds = read_table(run_dir / "metrics.h5", "rounds")
    total = stop + math.ceil(rest / new) + per_epoch[new]
    np.testing.assert_array_equal(rounds["round"], np.arange(total))
    width = max(old, new)
    assert rounds["steps"].shape == (total, width)
    if new > old:
        assert np.all(rounds["steps"][:stop, old:] == -1) and np.all(np.isnan(rounds["mass"][:stop, old:]))
    else:
        assert np.all(rounds["steps"][stop:, new:] == -1) and np.all(np.isnan(rounds["mass"][stop:, new:]))
    assert rounds["steps"][:, :min(old, new)].min() >= 0
    # every epoch adds up, the stopped one included: each sample once
    epochs = read_table(run_dir / "metrics.h5", "epochs")
    np.testing.assert_array_equal(epochs["epoch"], [1, 2, 3])
    samples = np.where(epochs["per_rank_samples"] < 0, 0, epochs["per_rank_samples"])
    np.testing.assert_array_equal(samples.sum(axis=1), [data.train.n] * 3)
    batches_per_epoch = np.where(epochs["per_rank_batches"] < 0, 0, epochs["per_rank_batches"]).sum(axis=1)
    np.testing.assert_array_equal(batches_per_epoch, [n_batches] * 3)
    np.testing.assert_array_equal(epochs["batches"], [n_batches] * 3)
    assert len(read_table(run_dir / "metrics.h5", "batches")["step"]) == 3 * n_batches
    with h5py.File(run_dir / "metrics.h5", "r") as f:
        assert f.attrs["world_size_history"] == f"[[0, {old}], [{stop}, {new}]]"
    final = read_checkpoint(latest_checkpoint(run_dir / "checkpoints"))
    assert final.meta["world_size"] == new and sorted(final.ranks) == list(range(new))
    assert final.meta["epoch"] == 3 and final.meta["test_accuracy"] > 0.8


# ---------------------------------------------------------------- damaged weight data



def test_resume_passes_over_a_checkpoint_whose_weights_fail_their_checksum(tmp_path, straight_one):
    """A world of 1 in a fork, on a copy of this module's finished 3-epoch run (45 rounds an epoch: its
    checkpoints are rounds 45, 90, 135); was a 2-rank resume of a copy of run A. What is read back and set
    aside is the file's, whatever the world size."""
    run_dir = tmp_path / "r"
    shutil.copytree(straight_one, run_dir)
    newest = latest_checkpoint(run_dir / "checkpoints")
    assert newest.name == "ckpt-e000003-r000135.h5"
    flip_data_byte(newest, "params", "1.weight")
    resumed = fork_flodl("train", "--epochs", "3", "--run-dir", str(run_dir), "--resume", timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"warning: {newest.name} is damaged (unreadable data in 'params/1.weight'" in resumed.stdout
    assert "resuming from ckpt-e000002-r000090.h5" in resumed.stdout
    assert newest.with_name(newest.name + ".damaged").exists()
    assert read_checkpoint(latest_checkpoint(run_dir / "checkpoints")).meta["round"] == 135  # epoch 3 redone


# ---------------------------------------------------------------- the final save


def test_a_final_save_slower_than_any_fixed_cap_completes(tmp_path):
    """The old writer gave the last save 30 s; here every bounded wait is 100x shorter (0.3 s)
    and the save takes 3 s: it must still complete, and the run exit 0. A world of 1 in a fork (was a
    1-rank launch): the hooks are installed in the child."""
    run_dir = tmp_path / "r"
    proc = fork_flodl("train", "--epochs", "1", "--run-dir", str(run_dir),
                      hooks=("--save-delay", "3", "--scale-bounded-waits", "100"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "final save written in" in proc.stdout
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["ckpt-e000001-r000045.h5"]
    assert read_checkpoint(run_dir / "checkpoints" / "ckpt-e000001-r000045.h5").meta["round"] == 45


def test_a_hung_final_save_is_ended_by_the_watchdog(tmp_path):
    """A world of 1 in a fork (was a 1-rank launch): the watchdog aborts the forked child's singleton world."""
    t0 = time.monotonic()
    proc = fork_flodl("train", "--epochs", "1", "--stall-timeout", "3", "--run-dir", str(tmp_path / "r"),
                      hooks=("--save-delay", "1e6"), timeout=300)
    assert proc.returncode == EXIT_STALL, proc.stderr[-3000:]
    assert "watchdog: no rank made progress" in proc.stderr and "in the final save" in proc.stderr
    assert time.monotonic() - t0 < 200  # the save never ends: the watchdog did (generous: load)


# ---------------------------------------------------------------- checkpoints of an older flodl-mpi


def _drop_config_key(ckpt_path, key):
    """Make a checkpoint look written before ``key`` existed (its config JSON without it)."""
    import json

    with h5py.File(ckpt_path, "r+") as f:
        config = json.loads(f.attrs["config"])
        del config[key]
        f.attrs["config"] = json.dumps(config)


@pytest.mark.parametrize("batch_size, resumable", [(32, True), (4, False)])
def test_a_checkpoint_from_before_drop_last_resumes_unless_the_batch_plan_changed(tmp_path, batch_size, resumable):
    """1437 samples: at batch 32 the plan is as it was; at batch 4 a lone sample is now folded in.

    A world of 1 in a fork (was 2 launches at 2 ranks): the refusal is decided by the training samples and
    the batch size alone (``CheckpointContents.batch_plan_refusal``), whatever the world size."""
    run_dir = tmp_path / "r"
    common = ("train", "--epochs", "2", "--batch-size", str(batch_size), "--window", "8", "--run-dir", str(run_dir))
    first = fork_flodl(*common, hooks=("--stop-at-round", "3"), timeout=300)
    assert first.returncode in STOPPED, first.stderr[-3000:]
    _drop_config_key(latest_checkpoint(run_dir / "checkpoints"), "drop_last")
    again = fork_flodl(*common, "--resume", timeout=300)
    if resumable:
        assert again.returncode == 0, again.stderr[-3000:]
        assert "resuming from" in again.stdout
    else:
        assert again.returncode == EXIT_INPUT, again.stderr[-3000:]
        assert "written by an older flodl-mpi whose batch plan differs at --batch-size 4" in again.stderr
