"""The command as a user runs it: bad input, injected faults, never a hang."""

import time

import h5py
import numpy as np
import pytest

from flodl_mpi.errors import EXIT_ERROR, EXIT_INPUT, EXIT_STALL, EXIT_STOPPED
from tests.conftest import rank_pids, run_flodl, start_flodl

QUICK = ("--epochs", "1", "--batch-size", "64")


def error_lines(proc):
    return [line for line in proc.stderr.splitlines() if "error" in line]


def test_missing_data_file_is_one_line_and_exit_2_on_every_rank(tmp_path):
    proc = run_flodl(2, "train", "--data", str(tmp_path / "nope.h5"), "--run-dir", str(tmp_path / "r"), timeout=120)
    assert proc.returncode == EXIT_INPUT, proc.stderr
    assert error_lines(proc) == [f"flodl-mpi: error: --data '{tmp_path / 'nope.h5'}': no such file"]
    assert not (tmp_path / "r").exists()  # nothing created for a run that never started


def test_bad_flag_is_one_usage_line(tmp_path):
    proc = run_flodl(2, "train", "--epochs", "zero", timeout=120)
    assert proc.returncode == EXIT_INPUT
    assert len(error_lines(proc)) == 1 and "--epochs" in proc.stderr


def test_bad_value_names_the_option(tmp_path):
    proc = run_flodl(2, "train", "--window", "0", "--policy", "window", timeout=120)
    assert proc.returncode == EXIT_INPUT
    assert error_lines(proc) == ["flodl-mpi: error: --window 0: must be an integer >= 1"]


def test_wrong_data_shapes_are_refused(tmp_path):
    path = tmp_path / "bad.h5"
    with h5py.File(path, "w") as f:
        f["train/x"] = np.zeros((10, 4), np.float32)
        f["train/y"] = np.zeros(9, np.int64)
        f["test/x"] = np.zeros((5, 4), np.float32)
        f["test/y"] = np.zeros(5, np.int64)
    proc = run_flodl(2, "train", "--data", str(path), "--run-dir", str(tmp_path / "r"), timeout=120)
    assert proc.returncode == EXIT_INPUT
    assert len(error_lines(proc)) == 1 and "10 rows" in proc.stderr and "9" in proc.stderr


def test_models_that_differ_across_ranks_are_refused(tmp_path):
    module = tmp_path / "net.py"
    module.write_text(
        "import torch\n"
        "from flodl_mpi.launcher import launcher_rank\n"
        "def make(input_shape, num_classes):\n"
        "    hidden = 8 + launcher_rank()\n"
        "    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, hidden),\n"
        "                               torch.nn.ReLU(), torch.nn.Linear(hidden, num_classes))\n"
    )
    proc = run_flodl(2, "train", "--model", f"{module}:make", "--run-dir", str(tmp_path / "r"), timeout=120)
    assert proc.returncode == EXIT_INPUT, proc.stderr
    assert error_lines(proc) and "model differs across ranks" in error_lines(proc)[0]


@pytest.mark.parametrize("earlier", ["metrics.h5", "checkpoints/ckpt-e000003-r000069.h5", "config.json"])
def test_existing_run_dir_is_never_overwritten(tmp_path, earlier):
    run_dir = tmp_path / "r"
    (run_dir / earlier).parent.mkdir(parents=True)
    (run_dir / earlier).write_bytes(b"earlier work")
    proc = run_flodl(2, "train", *QUICK, "--run-dir", str(run_dir), timeout=120)
    assert proc.returncode == EXIT_INPUT
    assert error_lines(proc) == [f"flodl-mpi: error: --run-dir '{run_dir}' is not empty (it may hold another run); "
                                 "choose a new or empty directory so nothing saved is overwritten"]
    assert (run_dir / earlier).read_bytes() == b"earlier work"
    assert sorted(p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*") if p.is_file()) == [earlier]


def test_model_with_too_few_outputs_is_bad_input(tmp_path):
    module = tmp_path / "net.py"
    module.write_text("import torch\ndef make(input_shape):\n    return torch.nn.Linear(input_shape[0], 3)\n")
    proc = run_flodl(2, "train", "--model", f"{module}:make", "--run-dir", str(tmp_path / "r"), timeout=120)
    assert proc.returncode == EXIT_INPUT, proc.stderr
    assert error_lines(proc) == [f"flodl-mpi: error: --model '{module}:make': outputs 3 logits per sample but "
                                 "the data has 10 classes (labels 0..9)"]
    assert not (tmp_path / "r").exists()  # bad input creates no run directory


def test_a_rank_hung_in_setup_is_ended_by_the_watchdog(tmp_path):
    module = tmp_path / "net.py"
    module.write_text("import time, torch\n"
                      "from flodl_mpi.launcher import launcher_rank\n"
                      "def make(input_shape, num_classes):\n"
                      "    if launcher_rank() == 1:\n"
                      "        time.sleep(600)\n"
                      "    return torch.nn.Linear(input_shape[0], num_classes)\n")
    proc = run_flodl(2, "train", "--model", f"{module}:make", "--stall-timeout", "3",
                     "--run-dir", str(tmp_path / "r"), timeout=120)
    assert proc.returncode == EXIT_STALL, proc.stderr
    assert "watchdog: setup step 'model' made no progress" in proc.stderr


@pytest.mark.parametrize("kind", ["bridge", "step"])
def test_injected_error_ends_the_job_in_seconds(tmp_path, kind):
    t0 = time.monotonic()
    proc = run_flodl(2, "train", *QUICK, "--run-dir", str(tmp_path / "r"), "--inject-fault", f"{kind}@1:3",
                     timeout=120)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    assert "injected fault" in proc.stderr
    if kind == "bridge":
        assert "failed at stage 'params reduce'" in proc.stderr
    print(f"{kind} fault: job ended with exit {proc.returncode} after {elapsed:.1f} s")


def test_a_writer_failure_on_rank_0_ends_the_job_and_keeps_what_was_written(tmp_path):
    run_dir = tmp_path / "r"
    proc = run_flodl(2, "train", "--epochs", "3", "--run-dir", str(run_dir), "--inject-fault", "disk@0:30",
                     timeout=120)
    assert proc.returncode == EXIT_ERROR, proc.stderr
    assert "rank 0: error: WriterError" in proc.stderr
    from flodl_mpi.checkpoint import latest_checkpoint
    from flodl_mpi.metrics import read_table

    # Epoch 1's checkpoint (moved aside by the fault) is whole; epoch 2's save failed
    # and ended the job at the next round instead of training on without saving.
    assert latest_checkpoint(run_dir / "checkpoints.moved-by-fault").name == "ckpt-e000001-r000023.h5"
    assert len(read_table(run_dir / "metrics.h5", "rounds")["round"]) <= 47


def test_a_hung_rank_is_ended_by_the_watchdog(tmp_path):
    proc = run_flodl(2, "train", *QUICK, "--run-dir", str(tmp_path / "r"), "--inject-fault", "hang@1:2",
                     "--stall-timeout", "3", timeout=120)
    assert proc.returncode == EXIT_STALL, proc.stderr
    assert "watchdog: a round made no progress" in proc.stderr


def test_non_finite_parameters_end_every_rank_with_one_line_and_keep_checkpoints(tmp_path):
    run_dir = tmp_path / "r"
    # Round 40 is in epoch 2 (23 rounds per epoch at batch 32): epoch 1's checkpoint must survive.
    proc = run_flodl(2, "train", "--epochs", "3", "--run-dir", str(run_dir), "--inject-fault", "nan@0:40",
                     timeout=180)
    assert proc.returncode == EXIT_ERROR, proc.stderr
    lines = error_lines(proc)
    assert len(lines) == 1 and "non-finite parameters in round 40: rank(s) 0 had NaN" in lines[0]
    from flodl_mpi.checkpoint import latest_checkpoint, read_checkpoint

    ckpt = read_checkpoint(latest_checkpoint(run_dir / "checkpoints"))
    assert ckpt.meta["epoch"] == 1 and all(np.isfinite(a).all() for a in ckpt.params.values())


def test_flags_override_the_config_file_with_what_they_imply(tmp_path):
    from flodl_mpi.cli import build_parser, config_from_args

    toml = tmp_path / "run.toml"
    toml.write_text('policy = "window"\nwindow = 2\nepochs = 4\n')
    cfg = config_from_args(build_parser().parse_args(["train", "--config", str(toml), "--policy", "sync"]))
    assert (cfg.policy, cfg.window, cfg.epochs) == ("sync", 1, 4)
    toml.write_text('policy = "sync"\n')
    cfg = config_from_args(build_parser().parse_args(["train", "--config", str(toml), "--window", "3"]))
    assert (cfg.policy, cfg.window) == ("window", 3)
    toml.write_text('window = 5\n')
    assert config_from_args(build_parser().parse_args(["train", "--config", str(toml)])).policy == "window"


@pytest.mark.parametrize("signame", ["SIGUSR1", "SIGINT"])
def test_stop_signal_saves_and_exits_cleanly_while_metrics_are_read(tmp_path, signame):
    """SIGUSR1 (Slurm's --signal) or Ctrl-C to one rank: every rank stops after the same round.

    Also reads metrics.h5 with SWMR while the run is still writing it.
    """
    import os
    import signal

    from flodl_mpi.checkpoint import latest_checkpoint, read_checkpoint
    from flodl_mpi.metrics import read_table
    run_dir = tmp_path / "sig"
    proc = start_flodl(2, "train", "--epochs", "50", "--run-dir", str(run_dir))
    try:
        deadline = time.monotonic() + 120
        rows = 0
        while rows < 30 and time.monotonic() < deadline:  # wait for the run to be well under way
            time.sleep(0.5)
            if (run_dir / "metrics.h5").exists():
                rows = len(read_table(run_dir / "metrics.h5", "rounds")["round"])
        assert rows >= 30, "the run did not start"
        ranks = rank_pids(proc, f"--run-dir {run_dir}")
        assert len(ranks) == 2
        os.kill(ranks[-1], getattr(signal, signame))
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.communicate()  # closes the pipes
    assert proc.returncode == EXIT_STOPPED, err  # stopped, resumable: not "done"
    ckpt = read_checkpoint(latest_checkpoint(run_dir / "checkpoints"))
    assert ckpt.meta["reason"] == "graceful_shutdown"
    rounds = read_table(run_dir / "metrics.h5", "rounds")
    assert ckpt.meta["round"] == len(rounds["round"]) < 50 * 23  # stopped early, every round recorded
    assert "stopped on request" in out and "done:" not in out
