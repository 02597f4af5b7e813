"""The command as a user runs it: bad input, injected faults, never a hang."""

import re
import time

import h5py
import numpy as np
import pytest

from flodl_mpi.errors import EXIT_ERROR, EXIT_INPUT, EXIT_STOPPED
from tests.conftest import fork_flodl, rank_pids, run_flodl, start_flodl
from tests.faults import fault_hooks

QUICK = ("--epochs", "1", "--batch-size", "64")
#: Upper bound on a job that must end promptly (start-up included, on a loaded machine:
#: generous, never a measurement); the runs that test it set a --stall-timeout far above
#: it, so a stall cannot pass for a prompt exit.
PROMPT_S = 240
NO_STALL = ("--stall-timeout", "600")


def fault(spec):
    """The test-only hook: the run goes through tests/hooked_flodl.py with ``--fault spec`` (tests/faults.py)."""
    return fault_hooks(spec)


def timed(n, *args, **kwargs):
    """``run_flodl`` and its wall time in seconds."""
    t0 = time.monotonic()
    proc = run_flodl(n, *args, **kwargs)
    return proc, time.monotonic() - t0


def forked(*args, **kwargs):
    """``fork_flodl`` (a world of 1 in a forked child, torch loaded) and its wall time in seconds."""
    t0 = time.monotonic()
    proc = fork_flodl(*args, **kwargs)
    return proc, time.monotonic() - t0


def error_lines(proc):
    return [line for line in proc.stderr.splitlines() if "error" in line]


def test_missing_data_file_is_one_line_and_exit_2_on_every_rank(tmp_path):
    """Also issue 26 item 9: refused before MPI starts (no "rank(s) up; loading PyTorch" line)."""
    proc = run_flodl(2, "train", "--data", str(tmp_path / "nope.h5"), "--run-dir", str(tmp_path / "r"), timeout=300)
    assert proc.returncode == EXIT_INPUT, proc.stderr
    assert error_lines(proc) == [f"flodl-mpi: error: --data '{tmp_path / 'nope.h5'}': no such file"]
    assert "rank(s) up" not in proc.stdout, proc.stdout
    assert not (tmp_path / "r").exists()  # nothing created for a run that never started


def test_bad_flag_is_one_usage_line(tmp_path):
    """A world of 1 in a fork (was a 2-rank launch): argparse refuses before MPI starts, so no peer is involved;
    "every rank, one line, exit 2" through a launcher: test_missing_data_file_is_one_line_and_exit_2_on_every_rank."""
    proc = fork_flodl("train", "--epochs", "zero", timeout=300)
    assert proc.returncode == EXIT_INPUT
    assert len(error_lines(proc)) == 1 and "--epochs" in proc.stderr


def test_bad_value_names_the_option(tmp_path):
    """A world of 1 in a fork (was a 2-rank launch): refused before MPI starts (see test_bad_flag_is_one_usage_line)."""
    proc = fork_flodl("train", "--window", "0", "--policy", "window", timeout=300)
    assert proc.returncode == EXIT_INPUT
    assert error_lines(proc) == ["flodl-mpi: error: --window 0: must be an integer >= 1"]


def test_wrong_data_shapes_are_refused(tmp_path):
    """A world of 1 in a fork (was a 2-rank launch): the data file's check needs no peer."""
    path = tmp_path / "bad.h5"
    with h5py.File(path, "w") as f:
        f["train/x"] = np.zeros((10, 4), np.float32)
        f["train/y"] = np.zeros(9, np.int64)
        f["test/x"] = np.zeros((5, 4), np.float32)
        f["test/y"] = np.zeros(5, np.int64)
    proc = fork_flodl("train", "--data", str(path), "--run-dir", str(tmp_path / "r"), timeout=300)
    assert proc.returncode == EXIT_INPUT
    assert len(error_lines(proc)) == 1 and "10 rows" in proc.stderr and "9" in proc.stderr


def test_models_that_differ_across_ranks_are_refused(tmp_path):
    """A real 2-rank launch: the check compares what the ranks built (one allgather), and this proves its wiring
    through the launcher (every rank refuses alike, exit 2). The exact line, decided by a pure function of the
    gathered descriptions: test_a_parameter_free_layer_that_differs_across_ranks_is_refused, in this process."""
    module = tmp_path / "net.py"
    module.write_text(
        "import torch\n"
        "from flodl_mpi.runtime.launcher import launcher_rank\n"
        "def make(input_shape, num_classes):\n"
        "    hidden = 8 + launcher_rank()\n"
        "    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, hidden),\n"
        "                               torch.nn.ReLU(), torch.nn.Linear(hidden, num_classes))\n"
    )
    proc = run_flodl(2, "train", "--model", f"{module}:make", "--run-dir", str(tmp_path / "r"), timeout=300)
    assert proc.returncode == EXIT_INPUT, proc.stderr
    assert error_lines(proc) and "model differs across ranks" in error_lines(proc)[0]
    assert not (tmp_path / "r").exists()  # refused in setup: no run dir (was asserted by the parameter-free case)


def test_a_parameter_free_layer_that_differs_across_ranks_is_refused():
    """Same tensors on both ranks (Tanh and ReLU have none): only the module tree tells them apart.

    Was a 2-rank launch. The refusal is `check_same_model`'s, a pure function of what ``comm.allgather``
    returns (every rank decides alike from the same gathered rows): asserted here in this process with the
    two ranks' models and a communicator that returns both ranks' descriptions, as rank 0 would see them. The
    wiring through a real launch (exit 2, the line, no run dir, which this test also asserted):
    test_models_that_differ_across_ranks_are_refused."""
    import torch

    from flodl_mpi.errors import InputError
    from flodl_mpi.training.models import check_same_model

    def make(act):
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 8), act, torch.nn.Linear(8, 10))

    models = [make(torch.nn.ReLU()), make(torch.nn.Tanh())]

    class TwoRanks:
        """rank ``rank``'s view of a 2-rank allgather: row r is what rank r built."""

        def __init__(self, rank):
            self.rank = rank

        def allgather(self, mine):
            from flodl_mpi.training.models import model_signature, module_structure

            rows = [(module_structure(m), model_signature(m)) for m in models]
            assert rows[self.rank] == mine  # this rank's own row is what it passed
            return rows

    for rank in (0, 1):  # every rank refuses alike, with the same line
        with pytest.raises(InputError) as refused:
            check_same_model(models[rank], TwoRanks(rank))
        assert str(refused.value) == ("the model differs across ranks: module '2' is ReLU on rank 0 but Tanh on "
                                      "rank(s) 1 (every rank must build the same model)")
    same = make(torch.nn.ReLU())
    models[1] = same
    check_same_model(models[0], TwoRanks(0))  # the same tree and tensors: no refusal


@pytest.mark.parametrize("earlier", ["metrics.h5", "checkpoints/ckpt-e000003-r000069.h5", "config.json"])
def test_existing_run_dir_is_never_overwritten(tmp_path, earlier):
    """A world of 1 in a fork (was a 2-rank launch): rank 0's check of the run dir needs no peer."""
    run_dir = tmp_path / "r"
    (run_dir / earlier).parent.mkdir(parents=True)
    (run_dir / earlier).write_bytes(b"earlier work")
    proc = fork_flodl("train", *QUICK, "--run-dir", str(run_dir), timeout=300)
    assert proc.returncode == EXIT_INPUT
    if earlier == "config.json":  # a flodl-mpi run: say how to continue it
        assert error_lines(proc) == [(f"flodl-mpi: error: --run-dir '{run_dir}' holds a flodl-mpi run: add --resume "
                                     "to continue it, or choose a new or empty directory (nothing in it was touched)")]
    else:
        assert error_lines(proc) == [(f"flodl-mpi: error: --run-dir '{run_dir}' is not empty (it may hold another "
                                     "run); choose a new or empty directory so nothing saved is overwritten")]
    assert (run_dir / earlier).read_bytes() == b"earlier work"
    assert sorted(p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*") if p.is_file()) == [earlier]


def test_model_with_too_few_outputs_is_bad_input(tmp_path):
    """A world of 1 in a fork (was a 2-rank launch): the model's output check is each rank's own."""
    module = tmp_path / "net.py"
    module.write_text("import torch\ndef make(input_shape):\n    return torch.nn.Linear(input_shape[0], 3)\n")
    proc = fork_flodl("train", "--model", f"{module}:make", "--run-dir", str(tmp_path / "r"), timeout=300)
    assert proc.returncode == EXIT_INPUT, proc.stderr
    assert error_lines(proc) == [(f"flodl-mpi: error: --model '{module}:make': outputs 3 logits per sample but "
                                 "the data has 10 classes (labels 0..9)")]
    assert not (tmp_path / "r").exists()  # bad input creates no run directory


@pytest.mark.parametrize("kind, where", [
    ("bridge", ("rank 1: error: RoundError: rank 1: averaging round 3 failed at stage 'params reduce': "
               "InjectedFault: injected fault in the bridge (rank 1, round 3); aborting the job")),
    ("step", "rank 1: error: InjectedFault: injected fault in the training step (rank 1, round 3); aborting the job"),
])
def test_injected_error_ends_the_job_in_seconds(tmp_path, kind, where):
    run_dir = tmp_path / "r"
    proc, elapsed = timed(2, "train", *QUICK, *NO_STALL, "--run-dir", str(run_dir), hooks=fault(f"{kind}@1:3"),
                          timeout=400)
    assert proc.returncode == EXIT_ERROR, proc.stderr
    assert f"flodl-mpi: {where}" in proc.stderr  # the fault fired where it was put, on rank 1, in round 3
    assert "watchdog:" not in proc.stderr  # ended by the error path, not by a stall
    assert elapsed < PROMPT_S, f"{kind} fault: the job took {elapsed:.0f} s to end"
    # The hook is test machinery: it is no option and is not recorded with the run.
    assert "fault" not in (run_dir / "config.json").read_text()


def test_a_writer_failure_on_rank_0_ends_the_job_and_keeps_what_was_written(tmp_path):
    run_dir = tmp_path / "r"
    proc, elapsed = timed(2, "train", "--epochs", "3", *NO_STALL, "--run-dir", str(run_dir), hooks=fault("disk@0:30"),
                          timeout=500)
    assert proc.returncode == EXIT_ERROR, proc.stderr
    assert "rank 0: error: WriterError" in proc.stderr and "checkpoints" in proc.stderr
    assert (run_dir / "checkpoints").is_file()  # the fault was in place: the save had nowhere to go
    assert elapsed < 2 * PROMPT_S
    from flodl_mpi.outputs.checkpoint import latest_checkpoint
    from flodl_mpi.outputs.metrics import read_table

    # Epoch 1's checkpoint (moved aside by the fault) is whole; epoch 2's save failed
    # and ended the job at the next round instead of training on without saving.
    assert latest_checkpoint(run_dir / "checkpoints.moved-by-fault").name == "ckpt-e000001-r000023.h5"
    assert len(read_table(run_dir / "metrics.h5", "rounds")["round"]) <= 47


def test_flags_override_the_config_file_with_what_they_imply(tmp_path):
    from flodl_mpi.cli.main import build_parser, config_from_args

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
    """SIGUSR1 (Slurm's --signal) or Ctrl-C to one rank, then SIGTERM: every rank stops after the same round.

    Also reads metrics.h5 with SWMR while the run is still writing it.
    """
    import os
    import signal

    from flodl_mpi.outputs.checkpoint import latest_checkpoint, read_checkpoint
    from flodl_mpi.outputs.metrics import read_table
    run_dir = tmp_path / "sig"
    proc = start_flodl(2, "train", "--epochs", "50", "--run-dir", str(run_dir))
    try:
        deadline = time.monotonic() + 300
        rows = 0
        while rows < 30 and time.monotonic() < deadline:  # wait for the run to be well under way
            time.sleep(0.5)
            if (run_dir / "metrics.h5").exists():
                rows = len(read_table(run_dir / "metrics.h5", "rounds")["round"])
        assert rows >= 30, "the run did not start"
        ranks = rank_pids(proc, f"--run-dir {run_dir}")
        assert len(ranks) == 2
        os.kill(ranks[-1], getattr(signal, signame))
        time.sleep(0.5)
        os.kill(ranks[-1], signal.SIGTERM)  # a second stop signal while it stops: absorbed, still exit 4
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
        proc.communicate()  # closes the pipes
    assert proc.returncode == EXIT_STOPPED, err  # stopped, resumable: not "done"
    ckpt = read_checkpoint(latest_checkpoint(run_dir / "checkpoints"))
    assert ckpt.meta["reason"] == "graceful_shutdown"
    rounds = read_table(run_dir / "metrics.h5", "rounds")
    assert ckpt.meta["round"] == len(rounds["round"]) < 50 * 23  # stopped early, every round recorded
    assert "stopped on request" in out and "done:" not in out
    lines = out.splitlines()  # the stop line claims no save that has not happened yet
    stop = next(i for i, line in enumerate(lines) if "stopped on request" in line)
    assert "checkpoint saved" not in lines[stop] and "checkpoint is queued" in lines[stop]
    assert any("final save written" in line for line in lines[stop + 1:])


@pytest.mark.parametrize("args, message", [
    (("--batch-size", "1"), ("the built-in model fails on a training batch of 1 sample (BatchNorm needs more than "
                            "1 value per channel): raise --batch-size")),
    (("--batch-size", "2000", "--drop-last"), ("--drop-last with --batch-size 2000 leaves no batch: the training set "
                                              "has 1437 samples; lower --batch-size")),
])
def test_a_batch_the_model_cannot_train_on_is_refused_before_any_epoch(tmp_path, args, message):
    """BatchNorm on a 1-sample batch used to fail after a whole epoch of work, in every epoch.

    A world of 1 in a fork (was a 2-rank launch): the batch plan and the model's trial step are each rank's
    own, and the messages name no world size (the training set's 1437 samples, a batch of 1)."""
    run_dir = tmp_path / "r"
    proc, elapsed = forked("train", "--epochs", "1", *args, "--run-dir", str(run_dir), timeout=400)
    assert proc.returncode == EXIT_INPUT, proc.stderr
    assert error_lines(proc) == [f"flodl-mpi: error: {message}"]
    assert "epoch 1/" not in proc.stdout and not run_dir.exists()  # refused at setup: nothing trained or created
    assert elapsed < PROMPT_S


def test_a_malformed_fault_hook_is_refused():
    """Was a launched run (``FLODL_MPI_FAULT=bridge@one``: exit 2, one line). The fault is the tests'
    own now (tests/faults.py, parsed by tests/hooked_flodl.py before the CLI starts, which then exits
    2 with argparse's error): its refusal, the same words but for the option's name, is asserted here
    in one process."""
    from tests.faults import parse_fault

    with pytest.raises(ValueError) as refused:
        parse_fault("bridge@one")
    assert str(refused.value) == "--fault must look like KIND@RANK:ROUND (e.g. bridge@1:3), got 'bridge@one'"


def test_every_option_has_a_sentence_and_no_test_machinery():
    import re

    from flodl_mpi.cli.main import build_parser
    from flodl_mpi.config import TrainConfig

    parser = build_parser()
    train = next(a for a in parser._actions if a.dest == "command").choices["train"]
    options = [a for a in train._actions if a.option_strings and a.dest != "help"]
    assert {a.dest for a in options} >= set(TrainConfig.field_names())  # every config key is an option
    for action in options:
        words = re.sub(r"\(default[^)]*\)", "", action.help or "").split()
        assert len(words) >= 3, f"{action.option_strings[0]}: help {action.help!r} is no sentence"
    text = train.format_help()
    assert "inject" not in text and "FLODL_MPI_FAULT" not in text
    assert not [name for name in TrainConfig.field_names() if "fault" in name]


def test_fault_injection_is_the_tests_not_the_products():
    """Was: the product read the hook from ``FLODL_MPI_FAULT`` only (none when unset or empty). Now
    the product reads no fault from anywhere (no module of it names the variable or the fault kinds),
    its hook points are empty by default, and the tests' parser keeps the spec's checks."""
    from pathlib import Path

    import flodl_mpi
    from flodl_mpi.runtime import hooks
    from tests.faults import Fault, parse_fault

    sources = {p: p.read_text() for p in Path(flodl_mpi.__file__).parent.rglob("*.py")}
    assert not [p for p, text in sources.items() if "FLODL_MPI_FAULT" in text or "InjectedFault" in text]
    assert all(hooks.registered(point) == () for point in hooks.POINTS)
    assert parse_fault("nan@0:40") == Fault("nan", (0,), 40)
    assert parse_fault("kill@1,2:10") == Fault("kill", (1, 2), 10)  # two ranks at once
    with pytest.raises(ValueError, match="distinct"):
        parse_fault("kill@1,1:10")
    with pytest.raises(ValueError, match="--fault kind must be one of bridge, step, hang, nan, nanloss, disk"):
        parse_fault("boom@0:1")


def test_learning_rate_options_parse_and_bad_values_name_the_option():
    from flodl_mpi.cli.main import build_parser, config_from_args
    from flodl_mpi.config import ConfigError

    cfg = config_from_args(build_parser().parse_args(
        ["train", "--scale-lr", "--warmup-steps", "12", "--clip-grad-norm", "2.5"]))
    assert (cfg.scale_lr, cfg.warmup_steps, cfg.clip_grad_norm) == (True, 12, 2.5)
    with pytest.raises(ConfigError, match=r"--clip-grad-norm 0\.0: must be a finite number > 0"):
        config_from_args(build_parser().parse_args(["train", "--clip-grad-norm", "0"]))
    with pytest.raises(ConfigError, match="--warmup-steps -1: must be an integer >= 0"):
        config_from_args(build_parser().parse_args(["train", "--warmup-steps", "-1"]))


def test_the_header_states_the_effective_batch_and_how_to_scale():
    from flodl_mpi.config import TrainConfig
    from flodl_mpi.training.train import effective_batch_line

    line = effective_batch_line(TrainConfig(batch_size=32, lr=1e-3), 2)
    assert "effective batch 32 x 2 ranks = 64 samples" in line and "raise --lr toward 0.002 or add --scale-lr" in line
    line = effective_batch_line(TrainConfig(batch_size=32, lr=1e-3, scale_lr=True, warmup_steps=45), 3)
    assert "--scale-lr: lr 0.001 x 3 = 0.003 after 45 warm-up steps" in line


def test_the_effective_batch_is_what_the_data_allows():
    """issue 26 item 9: "effective batch 2000" for a 133-sample set; a round averages at most the set.

    Hand-worked: 133 samples in batches of 1000 are one batch, so a round averages 133 samples and one
    process takes as many steps per epoch (no lr advice); batches of 40 on 4 ranks: 4 batches (40, 40, 40,
    13), one round of 133 samples, one process 4 steps."""
    from flodl_mpi.config import TrainConfig
    from flodl_mpi.training.train import effective_batch_line

    line = effective_batch_line(TrainConfig(batch_size=1000, lr=1e-3), 2, n_samples=133)
    assert line == ("batch 1000 per rank, effective batch 133 samples per step of the averaged model, at most: "
                    "1000 x 2 ranks = 2000 asked, capped by the training set of 133 samples (1 batch per epoch)")
    line = effective_batch_line(TrainConfig(batch_size=40, lr=1e-3), 4, n_samples=133)
    assert line.startswith("batch 40 per rank, effective batch 133 samples per step of the averaged model, at most: "
                           "40 x 4 ranks = 160 asked, capped by the training set of 133 samples (4 batches per "
                           "epoch); lr 0.001 as given (one process at batch 40 would take 4x the steps per epoch")
    drop = effective_batch_line(TrainConfig(batch_size=40, drop_last=True), 4, n_samples=133)
    assert "effective batch 120 samples per step" in drop and "(3 batches per epoch)" in drop
    assert effective_batch_line(TrainConfig(batch_size=32), 2, n_samples=1437) == \
        effective_batch_line(TrainConfig(batch_size=32), 2)   # not capped: the line as before


# ---------------------------------------------------------------- polish (issue 7)


def test_every_flag_is_a_config_key_or_refused_with_a_reason(tmp_path):
    """A config file takes every train flag that makes sense in a file (output flags included)."""
    from flodl_mpi.cli.main import build_parser, config_from_args, settle_early
    from flodl_mpi.config import NOT_IN_FILE, ConfigError, read_config_file

    parser = build_parser()
    train = next(a for a in parser._actions if a.dest == "command").choices["train"]
    dests = {a.dest for a in train._actions if a.option_strings}
    toml = tmp_path / "run.toml"
    toml.write_text('verbose = 2\nquiet = true\nprogress = "lines"\nepochs = 3\n')
    assert read_config_file(toml) == {"verbose": 2, "quiet": True, "progress": "lines", "epochs": 3}
    args = parser.parse_args(["train", "--config", str(toml)])
    settle_early(args)
    assert (args.verbose, args.quiet, args.progress) == (2, True, "lines")
    assert config_from_args(args).epochs == 3                       # output keys are not training options
    args = parser.parse_args(["train", "--config", str(toml), "-v", "--progress", "bar"])
    settle_early(args)
    assert (args.verbose, args.quiet, args.progress) == (1, True, "bar")   # flags override the file
    args = parser.parse_args(["train"])
    settle_early(args)
    assert (args.verbose, args.quiet, args.progress) == (0, False, "auto")
    for dest in sorted(dests):
        toml.write_text(f"{dest} = 1\n")
        try:
            read_config_file(toml)
        except ConfigError as exc:
            # the only refusals: no such key is allowed in a file (with the reason), or a bad value
            assert (dest in NOT_IN_FILE and NOT_IN_FILE[dest] in str(exc)) or "unknown key" not in str(exc), dest
    toml.write_text('config = "other.toml"\n')
    with pytest.raises(ConfigError, match="key 'config' is not allowed in a config file: a config file cannot name"):
        read_config_file(toml)
    toml.write_text('progress = "fancy"\n')
    with pytest.raises(ConfigError, match=r"key 'progress': 'fancy': must be one of auto, bar, lines"):
        read_config_file(toml)


def test_a_bad_config_file_is_refused_before_mpi_starts(tmp_path):
    """A world of 1 in a fork (was a 2-rank launch): refused before MPI starts, no peer involved; "rank(s) up"
    is what a run prints once MPI is up (at any world size, the fork's too)."""
    toml = tmp_path / "run.toml"
    toml.write_text("quiet = 3\n")
    t0 = time.monotonic()
    proc = fork_flodl("train", "--config", str(toml), timeout=300)
    assert proc.returncode == EXIT_INPUT and time.monotonic() - t0 < PROMPT_S
    assert error_lines(proc) == [f"flodl-mpi: error: --config '{toml}': key 'quiet': 3: must be true or false"]
    assert "rank(s) up" not in proc.stdout                          # refused before MPI started


@pytest.mark.parametrize("line, key, shown, allowed", [
    ('epochs = "three"', "epochs", "'three' is a string", "an integer >= 1"),  # the type named: issue 26 item 9
    ("epochs = 1.7", "epochs", "1.7", "an integer >= 1"),
    ('lr = "fast"', "lr", "'fast' is a string", "a finite number > 0"),
    ('scale-lr = "no"', "scale-lr", "'no'", "true or false"),
    ("batch_size = 0", "batch_size", "0", "an integer >= 1"),
    ("max-anchor = 5\npolicy = \"cadence\"", "max-anchor", "5", "an integer >= the anchor (10)"),
])
def test_a_bad_value_in_the_config_file_names_the_file_and_key(tmp_path, line, key, shown, allowed):
    from flodl_mpi.cli.main import build_parser, config_from_args, settle_early
    from flodl_mpi.config import ConfigError

    toml = tmp_path / "run.toml"
    toml.write_text(line + "\n")
    expected = f"--config '{toml}': key '{key}': {shown}: must be {allowed}"
    for check in (settle_early, config_from_args):  # before MPI starts, and the ranks' own check later
        with pytest.raises(ConfigError) as info:
            check(build_parser().parse_args(["train", "--config", str(toml)]))
        assert str(info.value) == expected


def test_a_flag_names_the_flag_and_overrides_the_file(tmp_path):
    from flodl_mpi.cli.main import build_parser, config_from_args, settle_early
    from flodl_mpi.config import ConfigError

    toml = tmp_path / "run.toml"
    toml.write_text("epochs = 0\n")
    with pytest.raises(ConfigError, match=r"^--batch-size 0: must be an integer >= 1$"):
        settle_early(build_parser().parse_args(["train", "--batch-size", "0"]))
    # the flag's value is checked, not the file's it overrides
    with pytest.raises(ConfigError, match=r"^--epochs -1: must be an integer >= 1$"):
        settle_early(build_parser().parse_args(["train", "--config", str(toml), "--epochs", "-1"]))
    assert config_from_args(build_parser().parse_args(["train", "--config", str(toml), "--epochs", "2"])).epochs == 2


@pytest.mark.parametrize("case", ["file", "flag"])
def test_a_bad_value_is_refused_before_mpi_starts(tmp_path, case):
    """A world of 1 in a fork (was a 2-rank launch): see test_a_bad_config_file_is_refused_before_mpi_starts."""
    toml = tmp_path / "run.toml"
    toml.write_text('epochs = "three"\n')
    argv = ("--config", str(toml)) if case == "file" else ("--batch-size", "0")
    expected = {"file": f"flodl-mpi: error: --config '{toml}': key 'epochs': 'three' is a string: must be an "
                        "integer >= 1",
                "flag": "flodl-mpi: error: --batch-size 0: must be an integer >= 1"}[case]
    proc, elapsed = forked("train", *argv, "--run-dir", str(tmp_path / "r"), timeout=PROMPT_S)
    assert proc.returncode == EXIT_INPUT and elapsed < PROMPT_S
    assert error_lines(proc) == [expected]
    assert "rank(s) up" not in proc.stdout and "loading PyTorch" not in proc.stdout   # MPI never started
    assert not (tmp_path / "r").exists()


def test_bare_command_lists_the_subcommands():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "flodl_mpi"], capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == EXIT_INPUT and proc.stdout == ""
    assert proc.stderr.startswith("usage: flodl-mpi") and "{train,report,inspect,export,inject-failure}" in proc.stderr
    for name in ("train", "report", "inspect", "export", "inject-failure"):
        assert any(line.split()[:1] == [name] for line in proc.stderr.splitlines()), name


@pytest.mark.parametrize("entry", [("-m", "flodl_mpi", "inspect"), ("-m", "flodl_mpi.cli.inspect_cmd"),
                                   ("-m", "flodl_mpi", "report", "--no-plots")])
def test_a_reader_that_goes_away_ends_the_tools_quietly(tmp_path, entry):
    """``flodl-mpi inspect F | head -1``: SIGPIPE ends the process as it ends cat, no traceback."""
    import signal
    import subprocess
    import sys

    from tests._runs import write_synthetic

    run_dir = write_synthetic(tmp_path / "r")
    proc = subprocess.Popen([sys.executable, *entry, str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first line is written
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGPIPE and err == b""


def test_bad_omp_num_threads_is_our_one_line_before_torch_loads(tmp_path):
    proc = run_flodl(2, "train", "--run-dir", str(tmp_path / "r"), env={"OMP_NUM_THREADS": "abc"}, timeout=300)
    assert proc.returncode == EXIT_INPUT
    # Ours is the one line; Open MPI's launcher adds its "exited with non-zero status" block after it.
    ours = proc.stderr.split("-" * 20)[0].strip()
    assert ours == "flodl-mpi: error: OMP_NUM_THREADS='abc': must be a positive integer (or unset)", proc.stderr
    assert "libgomp" not in proc.stderr and "loading PyTorch" not in proc.stdout   # torch was never imported
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_train_keeps_training_when_its_reader_goes_away(tmp_path):
    """``flodl-mpi train | head -1`` in a world of 1: stdout falls silent, the run finishes, train.log has it all.

    A process of its own, not a fork: what it proves includes the interpreter's own exit (its last flush of a
    stdout whose reader is gone prints no BrokenPipeError), which a forked child leaving by ``os._exit`` skips."""
    import subprocess
    import sys

    from tests.conftest import launch_env

    proc = subprocess.Popen([sys.executable, "-m", "flodl_mpi", "train", "--epochs", "1", "--batch-size", "64",
                             "--run-dir", str(tmp_path / "r")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=launch_env({"OMP_NUM_THREADS": "1"}), text=True)  # one torch thread: 2 cores
    proc.stdout.readline()  # the first line, then the reader goes
    proc.stdout.close()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "Logging error" not in err and "BrokenPipeError" not in err
    assert (tmp_path / "r" / "train.log").read_text().splitlines()[-1].split(" ", 1)[1].startswith("done:")


@pytest.mark.parametrize("quiet", [(), ("-q",)])
def test_a_warning_is_printed_once(tmp_path, quiet):
    """Rank 0 prints the run's warnings; the other ranks' copies never reach the console (logging's last resort).

    Also (from tests/training/test_progress.py's pipe test, a launch no more): through the launcher's pipe
    at 2 ranks, rank 0's first line says the ranks are up, and no bar is drawn."""
    from flodl_mpi.training.data import write_digits

    digits = write_digits(tmp_path / "digits.h5")
    tiny = tmp_path / "tiny.h5"
    with h5py.File(digits, "r") as src, h5py.File(tiny, "w") as f:
        for name in ("train/x", "train/y"):
            f[name] = src[name][:3]  # 1 batch of 32 for 2 ranks: rank 1 never trains
        for name in ("test/x", "test/y"):
            f[name] = src[name][:]
    proc = run_flodl(2, "train", "--epochs", "1", "--data", str(tiny), "--run-dir", str(tmp_path / "r"), *quiet,
                     timeout=PROMPT_S)
    assert proc.returncode == 0, proc.stderr
    text = "warning: an epoch has 1 batch(es) of 32 for 2 ranks, so rank(s) 1..1 never train; lower --batch-size"
    assert (proc.stdout + proc.stderr).count(text) == 1, (proc.stdout, proc.stderr)
    assert re.search(rf"^\d\d:\d\d:\d\d {re.escape(text)}$", proc.stdout, re.MULTILINE)  # rank 0's line, on stdout
    assert (tmp_path / "r" / "train.log").read_text().count(text) == 1
    assert "\r" not in proc.stdout and "batch/s" not in proc.stdout   # a pipe: lines, no bar
    if not quiet:
        assert proc.stdout.splitlines()[0] == "flodl-mpi: 2 rank(s) up; loading PyTorch"
