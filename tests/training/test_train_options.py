"""The options of a training step (issue 22 items 3, 4): gradient accumulation equals the larger batch,
bf16 autocast trains as float32 does, fp16's skipped steps carry no mass, and a schedule's lr column is
its closed form across a stop, a resume and a world-size change.

The ``fit`` cases run at a world of one in a forked child (``in_fork``: tests/conftest.py); the resume
starts at one rank (forked) and goes on at two (one launch).
"""

import copy
import math
import time

import numpy as np
import pytest
import torch
from torch import nn

import flodl_mpi
from flodl_mpi.errors import EXIT_INPUT
from flodl_mpi.outputs.checkpoint import latest_checkpoint, load_state_dict, read_rank_state
from flodl_mpi.outputs.metrics import read_table
from flodl_mpi.policy.cadence import plan_window
from flodl_mpi.training.train import check_amp
from tests.conftest import fork_flodl, run_flodl

#: digits: 1437 training samples.
DIGITS_N = 1437


def mlp(input_shape, num_classes):
    """No BatchNorm: a micro-batch's statistics would differ from the whole step's."""
    return nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), 32), nn.ReLU(), nn.Linear(32, num_classes))


def _one_epoch(run_dir, **options):
    """``fit`` of `mlp` with SGD on the digits for one epoch of batches of 64, no evaluation, no checkpoint but
    the last, in ``run_dir``; waits for it and returns the `flodl_mpi.Run`."""
    run = flodl_mpi.fit(mlp, "sgd", epochs=1, batch_size=64, eval_every=0, checkpoint_every=0, run_dir=run_dir,
                        **options)
    run.wait()
    return run


def params(run) -> list[torch.Tensor]:
    return [p.detach().clone() for p in run.model.parameters()]


@pytest.mark.in_fork
def test_accumulating_4_micro_batches_of_8_is_one_batch_of_32(tmp_path):
    """SGD without momentum: the same parameters, to float32 rounding; the same 45 steps an epoch."""
    common = dict(optimizer="sgd", momentum=0.0, lr=0.1, epochs=1, eval_every=0, checkpoint_every=0, seed=3)
    torch.manual_seed(0)
    start = mlp((64,), 10)
    big = flodl_mpi.fit(copy.deepcopy(start), batch_size=32, run_dir=tmp_path / "big", **common)
    big.wait()
    small = flodl_mpi.fit(copy.deepcopy(start), batch_size=8, accumulate=4, run_dir=tmp_path / "small", **common)
    small.wait()
    for name in ("big", "small"):  # 45 steps, each of 32 samples but the last (29)
        assert len(read_table(tmp_path / name / "metrics.h5", "batches")["lr"]) == math.ceil(DIGITS_N / 32)
    moved = max(float((a - b.detach()).abs().max()) for a, b in zip(params(big), start.parameters()))
    assert moved > 1e-2  # the steps moved the parameters: the comparison below is not of two initial states
    for a, b in zip(params(big), params(small)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.in_fork
def test_bf16_autocast_trains_digits_within_a_point_of_float32():
    common = dict(epochs=2, eval_every=0, checkpoint_every=0, lr=3e-3)
    acc = {}
    for amp in ("off", "bf16"):
        run = flodl_mpi.fit(amp=amp, **common)
        run.wait()
        acc[amp] = run.history[-1].metrics["accuracy"]
    assert acc["off"] > 0.95
    assert abs(acc["bf16"] - acc["off"]) <= 0.01, acc


@pytest.mark.in_fork
def test_fp16_steps_the_grad_scaler_skips_carry_no_mass(tmp_path):
    """A loss whose scaled gradients overflow float16 at the first scales: the scaler skips those steps
    (its scale halves each time), the parameters do not move, and the round counts them as no steps."""
    seen = []

    def overflowing(model, batch):
        if model.training:  # (not the evaluation's calls)
            seen.append([p.detach().clone() for p in model.parameters()])  # the parameters before this step
        x, y = batch
        return nn.functional.cross_entropy(model(x), y) * 300.0  # x 65536 (the first scale): fp16 overflows

    run = _one_epoch(tmp_path / "fp16", train_step=overflowing, amp="fp16", momentum=0.0, lr=0.01)
    steps = read_table(tmp_path / "fp16" / "metrics.h5", "rounds")["steps"][:, 0]
    assert len(steps) == math.ceil(DIGITS_N / 64)  # 23 rounds, one step each
    before = seen[-len(steps) :]  # (the calls before: setup's trial step on the model, undone)
    after = before[1:] + [params(run)]
    moved = [any(not torch.equal(a, b) for a, b in zip(x, y)) for x, y in zip(before, after)]
    assert moved[0] is False and moved[-1] is True, (
        moved,
        steps,
    )  # some skipped, then stepped: the case is what it says
    assert steps.tolist() == [int(m) for m in moved], steps


def cosine_lr(step: int, total: int, warmup: int, lr: float = 1e-3) -> float:
    """By hand: linear from 0 over the warm-up, then (1 + cos(pi t / T)) / 2."""
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * (1 + math.cos(math.pi * (step - warmup) / (total - warmup))) / 2


def test_the_lr_column_is_the_schedule_across_a_stop_a_resume_and_another_world_size(tmp_path):
    """1 rank stops at round 15 of epoch 1, 2 ranks go on: every batch record's lr is the closed form at its
    cohort step (the steps of each window as the sync plan deals them: rank r the r-th of the window). With a
    validation split (the same at both world sizes): validation every epoch, the test set at the end."""
    args = (
        "train",
        "--run-dir",
        str(tmp_path / "r"),
        "--epochs",
        "2",
        "--batch-size",
        "64",
        "--lr-schedule",
        "cosine",
        "--warmup-steps",
        "10",
        "--val-fraction",
        "0.2",
    )
    first = fork_flodl(*args, hooks=("--stop-at-round", "15"))
    assert first.returncode == 4, first.stdout + first.stderr
    second = run_flodl(2, *args, "--resume", timeout=300)
    assert second.returncode == 0, second.stdout + second.stderr
    b = read_table(tmp_path / "r" / "metrics.h5", "batches")
    n = math.ceil(1150 / 64)  # 1437 - 287 held out: 18 steps an epoch, 36 in the run
    expected = {(0, e): [] for e in (1, 2)} | {(1, e): [] for e in (1, 2)}
    expected[(0, 1)] = list(range(15))  # the first rank alone: steps 0..14
    for epoch, cursor in ((1, 15), (2, 0)):
        while cursor < n:  # the sync plan at 2 ranks: a quota of 1 each
            window = plan_window([1, 1], cursor, n)
            for r in (0, 1):
                expected[(r, epoch)] += [(epoch - 1) * n + window.starts[r] + i for i in range(window.counts[r])]
            cursor = window.end
    for (rank, epoch), steps in expected.items():
        mine = (b["rank"] == rank) & (b["epoch"] == epoch)
        np.testing.assert_allclose(b["lr"][mine], [cosine_lr(s, 2 * n, 10) for s in steps], rtol=1e-12)
    assert len(b["lr"]) == 2 * n
    e = read_table(tmp_path / "r" / "metrics.h5", "epochs")
    assert np.isfinite(e["val_accuracy"]).tolist() == [True, True]
    assert np.isfinite(e["test_accuracy"]).tolist() == [False, True]


def test_a_stop_and_resume_with_fp16_accumulation_and_a_schedule_is_bit_identical(tmp_path):
    """1 rank, 2 epochs of 45 steps (16 x 2 accumulated): stopped at round 30 and resumed, the run ends on
    the straight run's parameters bit for bit, with the same loss and lr of every step (the GradScaler's
    state travels in the checkpoint)."""
    args = (
        "train",
        "--epochs",
        "2",
        "--batch-size",
        "16",
        "--accumulate",
        "2",
        "--amp",
        "fp16",
        "--lr-schedule",
        "linear",
        "--warmup-steps",
        "5",
        "--optimizer",
        "sgd",
        "--lr",
        "0.05",
    )
    straight = fork_flodl(*args, "--run-dir", str(tmp_path / "straight"))
    assert straight.returncode == 0, straight.stdout + straight.stderr
    stopped = fork_flodl(*args, "--run-dir", str(tmp_path / "stopped"), hooks=("--stop-at-round", "30"))
    assert stopped.returncode == 4, stopped.stdout + stopped.stderr
    resumed = fork_flodl(*args, "--run-dir", str(tmp_path / "stopped"), "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    a, b = (load_state_dict(latest_checkpoint(tmp_path / name / "checkpoints")) for name in ("straight", "stopped"))
    _, attrs = read_rank_state(latest_checkpoint(tmp_path / "stopped" / "checkpoints"), 0)
    assert attrs["grad_scaler"]["scale"] == 65536.0  # saved with the rank's state (no overflow here: the first)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    rows = [read_table(tmp_path / name / "metrics.h5", "batches") for name in ("straight", "stopped")]
    assert len(rows[0]["lr"]) == 2 * math.ceil(DIGITS_N / 32)
    for column in ("loss", "lr"):
        np.testing.assert_array_equal(rows[0][column], rows[1][column], err_msg=column)


def test_an_amp_mode_torch_cannot_run_on_the_device_is_refused_in_one_line(monkeypatch):
    check_amp("bf16", torch.device("cpu"))  # this torch autocasts on the CPU in both dtypes
    check_amp("fp16", torch.device("cpu"))

    def no_autocast(device_type, dtype):
        raise RuntimeError(f"User specified an unsupported autocast device_type '{device_type}'\nmore")

    monkeypatch.setattr(torch, "autocast", no_autocast)
    with pytest.raises(ValueError) as info:
        check_amp("fp16", torch.device("cpu"))
    assert str(info.value) == (
        f"--amp fp16: torch {torch.__version__} cannot autocast to torch.float16 on cpu "
        "(RuntimeError: User specified an unsupported autocast device_type 'cpu'); use --amp "
        "bf16 or --amp off"
    )


@pytest.mark.parametrize(
    "flags, toml, line",
    [
        (
            ("--lr-schedule", "step"),
            None,
            "--lr-schedule step needs --lr-step-size N: the cohort steps between decays by --lr-gamma",
        ),
        (("--accumulate", "0"), None, "--accumulate 0: must be an integer >= 1"),
        (
            (),
            'lr-schedule = "step"\nlr-step-size = 10\nlr-gamma = 2.0\n',
            "key 'lr-gamma': 2.0: must be a number in (0, 1]",
        ),
    ],
)
def test_a_bad_option_is_refused_before_mpi_starts(tmp_path, flags, toml, line):
    """One line, exit 2, before MPI starts ("rank(s) up" is what a rank prints once it has), nothing created."""
    if toml is not None:
        (tmp_path / "run.toml").write_text(toml)
        flags = ("--config", str(tmp_path / "run.toml"))
        line = f"--config '{tmp_path / 'run.toml'}': {line}"
    t0 = time.monotonic()
    proc = fork_flodl("train", *flags, "--run-dir", str(tmp_path / "r"), timeout=120)
    assert proc.returncode == EXIT_INPUT and time.monotonic() - t0 < 60
    assert [x for x in proc.stderr.splitlines() if "error" in x] == [f"flodl-mpi: error: {line}"]
    assert "rank(s) up" not in proc.stdout and not (tmp_path / "r").exists()


@pytest.mark.in_fork
def test_fit_takes_a_schedule_by_name(tmp_path):
    _one_epoch(tmp_path / "f", lr=0.1, lr_schedule="step", lr_step_size=10, lr_gamma=0.5)
    lr = read_table(tmp_path / "f" / "metrics.h5", "batches")["lr"]
    np.testing.assert_allclose(lr, [0.1 * 0.5 ** (s // 10) for s in range(math.ceil(DIGITS_N / 64))], rtol=1e-12)
    with pytest.raises(flodl_mpi.InputError, match=r"^lr_schedule='exp': must be a callable or one of constant, "):
        flodl_mpi.fit(lr_schedule="exp")
