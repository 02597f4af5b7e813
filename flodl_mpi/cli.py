"""The ``flodl-mpi`` command.

Run it under the mpiexec installed with mpi4py (one rank per GPU or CPU slot)::

    mpiexec -n 2 flodl-mpi train                       # workstation: built-in digits + MLP
    mpiexec -n 4 flodl-mpi train --data d.h5 --model mypkg.nets:make_net --epochs 30
    srun flodl-mpi train --config run.toml             # Slurm: see jobs/

Exit status: 0 done (every epoch), 1 failed while training, 2 bad input, 3 a stalled
round, 4 stopped on request (checkpoint saved; run again with ``--resume``).

Start-up order matters: the stop handler first (a signal during a slow start-up
is kept, not fatal), then the launcher checks, which need no MPI, then MPI, then
torch. Importing this module imports neither ``mpi4py.MPI`` nor torch.
"""

from __future__ import annotations

import argparse
import sys
import traceback

from flodl_mpi import __version__
from flodl_mpi.config import DEVICES, OPTIMIZERS, POLICIES, TrainConfig, read_config_file
from flodl_mpi.errors import EXIT_ERROR, EXIT_INPUT, EXIT_STOPPED, CohortError
from flodl_mpi.launcher import check_world_size, foreign_launcher, launch_env, launcher_rank, mixed_install, mpi_library
from flodl_mpi.signals import StopRequest

__all__ = ["main", "build_parser"]


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so only rank 0 prints the one line."""

    def error(self, message: str):
        raise _UsageError(f"{self.prog}: error: {message}")

    def _print_message(self, message: str, file=None) -> None:
        if launcher_rank() == 0:  # MPI is not started yet: the launcher's rank
            super()._print_message(message, file)


def build_parser() -> argparse.ArgumentParser:
    """The ``flodl-mpi`` argument parser (defaults come from :class:`TrainConfig`)."""
    parser = _Parser(prog="flodl-mpi", allow_abbrev=False,
                     description="MPI-launched PyTorch training with work-weighted parameter averaging.")
    parser.add_argument("--version", action="version", version=f"flodl-mpi {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    # allow_abbrev=False below too: `--epoch 3` must not silently mean --epochs.
    t = sub.add_parser("train", help="train with work-weighted parameter averaging", allow_abbrev=False,
                       description="Train one replica per rank; a bridge thread averages parameters.")
    d = TrainConfig()
    g = t.add_argument_group("data and model")
    g.add_argument("--data", metavar="FILE.h5", help="HDF5 file with train/test datasets (default: built-in digits)")
    for name in ("train_x", "train_y", "test_x", "test_y"):
        g.add_argument(f"--{name.replace('_', '-')}", metavar="NAME", help=f"dataset name in --data (default {getattr(d, name)})")
    g.add_argument("--model", metavar="MODULE:FACTORY", help="model factory (default: built-in MLP)")
    g = t.add_argument_group("optimization")
    g.add_argument("--epochs", type=int, help=f"default {d.epochs}")
    g.add_argument("--batch-size", type=int, help=f"samples per batch per rank (default {d.batch_size})")
    g.add_argument("--lr", type=float, help=f"learning rate (default {d.lr:g})")
    g.add_argument("--optimizer", choices=OPTIMIZERS, help=f"default {d.optimizer}")
    g.add_argument("--momentum", type=float, help=f"sgd momentum (default {d.momentum})")
    g.add_argument("--weight-decay", type=float, help=f"default {d.weight_decay}")
    g.add_argument("--seed", type=int, help=f"data order and init (default {d.seed})")
    g = t.add_argument_group("averaging")
    g.add_argument("--policy", choices=POLICIES, help="sync: a round after every batch; window: every --window batches")
    g.add_argument("--window", type=int, help="batches per rank between rounds (implies --policy window)")
    g.add_argument("--gamma", type=float, help=f"mass exponent: rank weight = steps**gamma (default {d.gamma:g})")
    g.add_argument("--chunk-elems", type=int, help=f"float32 elements per Allreduce piece (default {d.chunk_elems})")
    g.add_argument("--stall-timeout", type=float, help=f"seconds before a stalled round aborts the job (default {d.stall_timeout:g})")
    g = t.add_argument_group("run")
    g.add_argument("--run-dir", metavar="DIR", help="output directory (default runs/<UTC time>)")
    g.add_argument("--resume", action="store_true", default=None,
                   help="continue the run in --run-dir from its newest complete checkpoint "
                        "(or start it, if it has none)")
    g.add_argument("--checkpoint-every", type=int, help=f"epochs between checkpoints, 0 = last only (default {d.checkpoint_every})")
    g.add_argument("--keep-checkpoints", type=int, help=f"default {d.keep_checkpoints}")
    g.add_argument("--device", choices=DEVICES, help="auto: CUDA when present, else CPU")
    g.add_argument("--eval-batch-size", type=int, help=f"default {d.eval_batch_size}")
    g.add_argument("--threads", type=int,
                   help="torch threads per rank (default: OMP_NUM_THREADS if set, else SLURM_CPUS_PER_TASK, "
                        "else this rank's share of the CPUs it may run on)")
    g.add_argument("--config", metavar="FILE.toml", help="TOML file of the options above; flags override it")
    g.add_argument("--inject-fault", metavar="KIND@RANK:ROUND", help=argparse.SUPPRESS)
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Config file values, overridden by the flags given on the command line.

    Raises:
        ConfigError: a bad value or file.
    """
    values = read_config_file(args.config) if args.config else {}
    flags = {name: getattr(args, name) for name in TrainConfig.field_names() if getattr(args, name, None) is not None}
    # A flag overrides the file, and so does what the flag implies: --policy sync
    # means a window of 1; a window K > 1 means --policy window unless a policy
    # was named where the window was (a file saying both is taken at its word).
    if flags.get("policy") == "sync" and "window" not in flags:
        values.pop("window", None)
    window_from_flag = "window" in flags
    values.update(flags)
    if values.get("window", 1) != 1 and "policy" not in flags and (window_from_flag or "policy" not in values):
        values["policy"] = "window"
    return TrainConfig(**values)


def _say_once(text: str) -> None:
    if launcher_rank() == 0:
        print(text, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``flodl-mpi``; returns the exit status (see the module docstring)."""
    stop = StopRequest()
    stop.install()  # first thing: before MPI starts and torch loads
    try:
        args = build_parser().parse_args(argv)
    except _UsageError as exc:
        _say_once(str(exc))
        return EXIT_INPUT
    # Before MPI starts: a launcher of another MPI makes MPI's own start-up abort
    # (or start N worlds of 1), so it is recognised from its environment first.
    library = mpi_library()
    refusal = foreign_launcher(launch_env(), library)
    if refusal:
        _say_once(f"flodl-mpi: error: {refusal}")
        return EXIT_INPUT
    mixed = mixed_install()
    if mixed:
        _say_once(f"flodl-mpi: warning: {mixed}")
    from mpi4py import MPI

    if not MPI.Is_initialized():  # `python -m mpi4py` started it already
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    stop.install()  # again, in case the MPI library set handlers of its own while starting
    refusal = check_world_size(MPI.COMM_WORLD.size, library)
    if refusal:  # every process is rank 0 of its own world: the launcher's rank 0 says it
        _say_once(f"flodl-mpi: error: {refusal}")
        return EXIT_INPUT
    from flodl_mpi.world import Watchdog, abort, install_excepthooks, start_world

    world = start_world()
    install_excepthooks(world.rank)
    watchdog = Watchdog(world.rank, stall_timeout=600.0)
    watchdog.start()
    try:
        from flodl_mpi.train import run_train  # torch is imported here, after MPI is up

        done = run_train(args, world, watchdog, stop)
        return 0 if done else EXIT_STOPPED
    except CohortError as exc:
        # Every rank raised this at the same point: leave together, one line.
        watchdog.expect_exit()
        if world.rank == 0:
            print(f"flodl-mpi: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except BaseException as exc:  # the one place that decides to abort (STYLE 14)
        print(f"flodl-mpi: rank {world.rank}: error: {type(exc).__name__}: {exc}; aborting the job",
              file=sys.stderr)
        traceback.print_exc()
        abort(EXIT_ERROR)

