"""The ``flodl-mpi`` command.

Run it under the mpiexec installed with mpi4py (one rank per GPU or CPU slot)::

    mpiexec -n 2 flodl-mpi train                       # workstation: built-in digits + MLP
    mpiexec -n 4 flodl-mpi train --data d.h5 --model mypkg.nets:make_net --epochs 30
    srun flodl-mpi train --config run.toml             # Slurm: see jobs/

Looking at a run needs no mpiexec (and starts no MPI)::

    flodl-mpi report runs/A [runs/B ...]               # summary, plots, A/B comparison
    flodl-mpi inspect runs/A/checkpoints/ckpt-e000010-r000230.h5
    flodl-mpi export runs/A model.pt                   # plain state dict

Checking a setup's failure path against a live run (kills a rank's process; no MPI)::

    flodl-mpi inject-failure runs/A --epoch 3 --rank 1 # kill -9 rank 1 once epoch 3 has ended

Exit status: 0 done (every epoch), 1 failed while training, 2 bad input, 3 a stalled
round, 4 stopped on request (checkpoint saved; run again with ``--resume``).

Start-up order matters: the stop handler first (a signal during a slow start-up
is kept, not fatal), then the launcher checks, which need no MPI, then MPI, then
torch. Importing this module imports neither ``mpi4py.MPI`` nor torch.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import time

from flodl_mpi import __version__
from flodl_mpi.config import (
    AMP_MODES,
    ASYNC_ADOPTS,
    AVERAGE_OPTIMIZER_STATE,
    DATA_LOADING,
    BEST_METRICS,
    DEVICES,
    HIERARCHICAL,
    LR_GAMMA_DEFAULT,
    LR_SCHEDULES,
    NODE_REDUCES,
    ON_NON_FINITE,
    ON_RANK_FAILURE,
    OPTIMIZER_WEIGHT_DECAY,
    OPTIMIZERS,
    OUTERS,
    OUTPUT_OPTIONS,
    PROGRESS,
    RESUME_AUTO,
    WIRES,
    ConfigError,
    TrainConfig,
    config_key_text,
    read_config_file,
)
from flodl_mpi.policy.defaults import ADOPTION_DEFAULTS, BALANCER_DEFAULTS
from flodl_mpi.policy.registry import help_text as policy_help
from flodl_mpi.policy.registry import names as policy_names
from flodl_mpi.errors import EXIT_INPUT, EXIT_STOPPED
from flodl_mpi.runtime.launcher import (
    launcher_rank,
    thread_request,
)
from flodl_mpi.cli.precheck import input_problem
from flodl_mpi.training.resume_target import early_refusal
from flodl_mpi.runtime.signals import StopRequest
from flodl_mpi.runtime.stale_shm import clear_before_mpi

__all__ = ["main", "build_parser"]


#: Sub-commands that start no MPI, each in its own module (``add_parser``, ``run``): the ones that
#: only read a run's files (they run on a login node without mpiexec), and inject-failure, which
#: reads them and kills a rank of the live run.
TOOLS = {"report": "flodl_mpi.cli.report", "inspect": "flodl_mpi.cli.inspect_cmd", "export": "flodl_mpi.cli.export",
         "inject-failure": "flodl_mpi.cli.inject_failure"}


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
    g.add_argument("--data", metavar="FILE.h5",
                   help="HDF5 file with the train and test datasets (default: the built-in digits, cached in "
                        "$FLODL_MPI_DATA_DIR or ~/.cache/flodl_mpi)")
    roles = {"train_x": "training features", "train_y": "training labels", "test_x": "test features",
             "test_y": "test labels"}
    for name, role in roles.items():
        g.add_argument(f"--{name.replace('_', '-')}", metavar="NAME",
                       help=f"name of the {role} dataset inside --data (default {getattr(d, name)})")
    g.add_argument("--model", metavar="MODULE:FACTORY",
                   help="function or class that builds the model, as module:name or path/to/file.py:name; it may "
                        "take input_shape and num_classes (default: the built-in MLP with BatchNorm)")
    g = t.add_argument_group("optimization")
    g.add_argument("--epochs", type=int, help=f"passes over the training set (default {d.epochs})")
    g.add_argument("--batch-size", type=int,
                   help="samples per batch per rank; a lone sample left at an epoch's end joins the batch before "
                        f"it (default {d.batch_size})")
    g.add_argument("--lr", type=float, help=f"each rank's optimizer's learning rate (default {d.lr:g})")
    g.add_argument("--optimizer", choices=OPTIMIZERS, help=f"each rank's optimizer (default {d.optimizer})")
    g.add_argument("--momentum", type=float, help=f"momentum of --optimizer sgd (default {d.momentum})")
    g.add_argument("--weight-decay", type=float,
                   help="the optimizer's weight decay (default: the optimizer's own, as torch.optim's: "
                        + ", ".join(f"{k} {v:g}" for k, v in OPTIMIZER_WEIGHT_DECAY.items())
                        + "; on a resume, the run's)")
    g.add_argument("--scale-lr", action="store_true", default=None,
                   help="linear scaling rule: each rank's learning rate x the world size (a round averages one "
                        "batch per rank, so the cohort takes one step per batch-size x world-size samples)")
    g.add_argument("--warmup-steps", type=int,
                   help="cohort steps (global steps) of a linear warm-up to the peak learning rate: from 0 to --lr, "
                        "or with --scale-lr from --lr to --lr x the world size (Goyal et al.); --lr-schedule decays "
                        f"after it (default {d.warmup_steps})")
    g.add_argument("--lr-schedule", choices=LR_SCHEDULES,
                   help="the learning rate's decay over the run's cohort steps after the warm-up, as torch.optim."
                        "lr_scheduler's: cosine (to 0, CosineAnnealingLR), linear (to 0, LinearLR), step (x --lr-gamma "
                        f"every --lr-step-size steps, StepLR); the same on every rank (default {d.lr_schedule})")
    g.add_argument("--lr-step-size", type=int, metavar="STEPS",
                   help="--lr-schedule step: cohort steps between decays (required by step)")
    g.add_argument("--lr-gamma", type=float,
                   help=f"--lr-schedule step: the factor per --lr-step-size steps, in (0, 1] (default {LR_GAMMA_DEFAULT})")
    g.add_argument("--amp", choices=AMP_MODES,
                   help="mixed precision: the forward pass and the evaluation under torch.autocast in bfloat16 or "
                        "float16 (fp16 scales the loss with a GradScaler; a step it skips carries no mass); "
                        f"parameters stay float32 (default {d.amp})")
    g.add_argument("--accumulate", type=int, metavar="K",
                   help="gradient accumulation: each optimizer step averages the gradients of K micro-batches of "
                        "--batch-size, so one rank's step covers batch-size x K samples and the batch plan, windows "
                        f"and mass count those steps (default {d.accumulate})")
    g.add_argument("--clip-grad-norm", type=float, metavar="NORM",
                   help="clip each rank's gradient L2 norm to NORM before its optimizer step (default: off)")
    g.add_argument("--drop-last", action="store_true", default=None,
                   help="drop each epoch's incomplete last batch (as PyTorch's DataLoader) instead of training on it")
    g.add_argument("--seed", type=int, help=f"seed of the data order and the model's initial values (default {d.seed})")
    g.add_argument("--data-loading", choices=DATA_LOADING,
                   help="memory: each rank reads --data's features whole at start; stream: each rank reads only its "
                        "batches, as it trains them (a background thread reads the next window's ahead; the same "
                        "values, bit for bit); auto: stream when the features as float32 exceed a quarter of the "
                        f"memory available per rank of the host (default {d.data_loading})"),
    g = t.add_argument_group("validation and the best model")
    g.add_argument("--val-fraction", type=float, metavar="F",
                   help="hold out this share of the training set, once, from --seed, as a validation set evaluated "
                        "every epoch (val_loss, val_accuracy); the test set is then evaluated at the end only "
                        "(default: none; a val/ group in --data is its own validation set, used instead)")
    g.add_argument("--test-every-epoch", action="store_true", default=None,
                   help="with a validation set: evaluate the test set every epoch too")
    g.add_argument("--keep-best", choices=BEST_METRICS, metavar="METRIC",
                   help=f"keep the checkpoint of the best epoch by METRIC ({', '.join(BEST_METRICS)}) in "
                        "checkpoints/best/, beside the newest --keep-checkpoints (needs --val-fraction or a val/ group)")
    g.add_argument("--early-stop", type=int, metavar="PATIENCE",
                   help="end the run after PATIENCE epochs without a better --keep-best metric (default val_loss); "
                        "needs --val-fraction or a val/ group")
    g = t.add_argument_group("averaging")
    g.add_argument("--policy", choices=policy_names(), help=policy_help(d.policy))  # the registry's entries
    g.add_argument("--window", type=int,
                   help="batches each rank trains between rounds; above 1 it implies --policy window")
    g.add_argument("--anchor", type=int,
                   help="cadence/async: batches of the slowest rank in the first window; faster ranks run "
                        "proportionally more, and the anchor grows with the round overhead (async: also shrinks to the "
                        f"shortest window that hides the round) (default {BALANCER_DEFAULTS['anchor']})")
    g.add_argument("--max-anchor", type=int,
                   help=f"cadence/async: the anchor never grows past this (default {BALANCER_DEFAULTS['max_anchor']})")
    g.add_argument("--overhead-target", type=float,
                   help="cadence/async: the anchor grows while a round takes more than this fraction of the "
                        f"slowest rank's window time (default {BALANCER_DEFAULTS['overhead_target']:g})")
    g.add_argument("--no-divergence-guard", dest="divergence_guard", action="store_false", default=None,
                   help="cadence/async: let the anchor grow whatever the divergence guard says (its verdicts are "
                        "still recorded)")
    g.add_argument("--replay-plan", metavar="RUN_DIR/metrics.h5",
                   help="cadence/async: follow the quotas and anchors another run recorded per round, instead of "
                        "the balancer's (which read this machine's speeds): the same command, data and seed then "
                        "give that run's windows exactly; refused unless its world size, policy and data size are "
                        "this run's")
    g.add_argument("--async-adopt", choices=ASYNC_ADOPTS,
                   help="async: how a rank adopts the consensus of a round it trained past, keeping its own "
                        "steps since the round's snapshot: delta takes the consensus in place of the snapshot; "
                        "easgd pulls the snapshot only --easgd-alpha of the way to it (EASGD's elastic pull: the "
                        "ranks keep part of their spread; measured level with delta: the docs' Benchmarks page, 'Async's accuracy') "
                        f"(default {ADOPTION_DEFAULTS['async_adopt']}; easgd when only --easgd-alpha is given)")
    g.add_argument("--easgd-alpha", type=float,
                   help="async with --async-adopt easgd: adopt each consensus as theta + alpha * (consensus - "
                        "theta_snapshot), alpha in (0, 1]; 1.0 is the delta adoption "
                        f"(default {ADOPTION_DEFAULTS['easgd_alpha']:g})")
    g.add_argument("--gamma", type=float,
                   help=f"mass exponent: a rank's weight in the average is its steps**gamma (default {d.gamma:g})")
    g.add_argument("--chunk-elems", type=int,
                   help=f"float32 elements per Allreduce piece; a tuning knob (default {d.chunk_elems})")
    g.add_argument("--node-reduce", choices=NODE_REDUCES,
                   help="how the ranks of one node sum their parameters: shm through one shared-memory window, "
                        "mpi (Allreduce), auto: shm when /dev/shm has room for it (and the world is on one node "
                        f"or --hierarchical allows), else mpi (default {d.node_reduce})")
    g.add_argument("--hierarchical", choices=HIERARCHICAL,
                   help="sum within each node first, then across the node leaders; auto: when the world spans "
                        f"several nodes and --node-reduce is shm (default {d.hierarchical})")
    g.add_argument("--bf16-wire", action="store_true", default=None,
                   help="parameters and float buffers travel as bfloat16 (sums and the divide in float64, "
                        "checkpoints float32); all ranks alike; the same as --wire bf16")
    g.add_argument("--wire", choices=WIRES,
                   help="what a round's frames carry: fp32 the parameters (summed in float64), bf16 the parameters "
                        "as bfloat16, bf16-delta / int8-delta the change since the last consensus, quantised "
                        "(int8: a scale per tensor agreed by a max over the ranks) with error feedback, gathered "
                        "over MPI (not with --node-reduce shm or --hierarchical on); sums and the divide in "
                        "float64, checkpoints float32 (default fp32, or bf16 with --bf16-wire)"),
    g.add_argument("--on-non-finite", choices=ON_NON_FINITE,
                   help="a rank whose loss or parameters are NaN/Inf: quarantine it for the round (mass 0, it "
                        "adopts the others' consensus; the job stops only when no rank is finite), or stop the "
                        f"job (default {d.on_non_finite})")
    g.add_argument("--on-rank-failure", choices=ON_RANK_FAILURE,
                   help="a rank dies (kill -9, a node lost): stop ends the job (exit 1; resume from the last "
                        "checkpoint); shrink goes on with the survivors (the round abandoned, the epoch's batches "
                        "re-split; needs Open MPI started with 'mpiexec --with-ft ulfm'; blocking policies; "
                        "docs/elastic.rst) (default: shrink where it can work, else stop)")
    g.add_argument("--outer", choices=OUTERS,
                   help="outer optimizer on each round's consensus: avg adopts it as it is; slowmo (SlowMo) and "
                        f"nesterov (DiLoCo) step from the previous global parameters with momentum (default {d.outer})")
    g.add_argument("--outer-lr", type=float,
                   help="the outer optimizer's learning rate (default 0.7)")
    g.add_argument("--outer-momentum", type=float,
                   help="the outer optimizer's momentum, in [0, 1) (default 0.5; the papers' 0.9 lost accuracy on "
                        "MNIST-1D, and a run with lr / (1 - momentum) of 5 or more is warned about: the docs' "
                        "'Adam and outer optimizers')")
    g.add_argument("--outer-reset-inner", action="store_true", default=None,
                   help="clear each rank's optimizer state after each outer step (DiLoCo-style restarts)")
    g.add_argument("--average-optimizer-state", choices=AVERAGE_OPTIMIZER_STATE,
                   help="average the optimizer's state with the parameters, with the same masses: off (each rank "
                        "keeps its own); mean (every floating state tensor shaped like its parameter); corrected "
                        "(as mean, but Adam's second moment is rebuilt from the mean gradient, as under "
                        "DistributedDataParallel, and does not travel); auto: corrected for Adam-family optimizers, "
                        "off otherwise; async: adopted by the params' rule, its correction decayed "
                        f"(default {d.average_optimizer_state})")
    g.add_argument("--stall-timeout", type=float,
                   help="seconds without progress on any rank (or without the ranks' heartbeats) before the "
                        "watchdog ends the job with exit 3; a rank waiting for a slower one that still trains is "
                        f"not stalled (default {d.stall_timeout:g})")
    g = t.add_argument_group("run")
    g.add_argument("--run-dir", metavar="DIR",
                   help="where the run writes config, metrics.h5, checkpoints and train.log; must be new or "
                        "empty unless --resume (default runs/<UTC time>)")
    g.add_argument("--resume", nargs="?", const=True, choices=(RESUME_AUTO,), default=None,
                   help="continue the run in --run-dir from its newest complete checkpoint; a --run-dir that "
                        "does not exist or holds no checkpoint is refused (exit 2, nothing touched). "
                        f"--resume {RESUME_AUTO}: continue it, or start it when it has none, saying so (a requeued "
                        f"job; in a config file: resume = \"{RESUME_AUTO}\")")
    g.add_argument("--checkpoint-every", type=int,
                   help=f"epochs between checkpoints; 0 saves only the last (default {d.checkpoint_every})")
    g.add_argument("--keep-checkpoints", type=int,
                   help=f"newest checkpoints kept; older ones are deleted (default {d.keep_checkpoints})")
    g.add_argument("--device", choices=DEVICES,
                   help="where each rank trains; auto: a GPU per local rank when CUDA is present, else the CPU "
                        f"(default {d.device})")
    g.add_argument("--eval-batch-size", type=int,
                   help=f"samples per batch when evaluating the test set (default {d.eval_batch_size})")
    g.add_argument("--threads", type=int,
                   help="torch threads per rank (default: OMP_NUM_THREADS if set, else SLURM_CPUS_PER_TASK, "
                        "else this rank's share of the CPUs it may run on)")
    g.add_argument("--config", metavar="FILE.toml",
                   help="TOML file of the options above and below (keys as the long options: batch-size = 64, "
                        "verbose = 1, quiet = true, progress = \"lines\"); flags override it")
    # Output flags default to None, so a config file's value applies unless the flag is given.
    g = t.add_argument_group("output")
    g.add_argument("-v", "--verbose", action="count", default=None,
                   help="more detail (per-rank lines each epoch); in a config file: verbose = 1")
    g.add_argument("-q", "--quiet", action="store_true", default=None,
                   help="warnings and errors only (train.log keeps all)")
    g.add_argument("--progress", choices=PROGRESS, default=None,
                   help="bar: a progress bar within each epoch; lines: one line per epoch; "
                        "auto: a bar when the output is a terminal (default)")
    for module in TOOLS.values():
        importlib.import_module(module).add_parser(sub)
    return parser


def unix_pipe() -> None:
    """Die quietly of SIGPIPE when the reader of stdout goes away (``flodl-mpi inspect F | head -1``),
    as Unix tools do, instead of a BrokenPipeError traceback. For the commands that only read a run:
    they hold nothing that a kill could leave half done (plots are renamed into place)."""
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)


def _run_tool(argv: list[str]) -> int:
    """``flodl-mpi report|inspect|export|inject-failure ...``: a plain argparse run, no MPI world."""
    parser = argparse.ArgumentParser(prog="flodl-mpi", allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {name: importlib.import_module(module) for name, module in TOOLS.items()}
    for module in modules.values():
        module.add_parser(sub)
    args = parser.parse_args(argv)
    return modules[args.command].run(args)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Config file values, overridden by the flags given on the command line.

    Pure (no MPI, no torch): `settle_early` runs it before MPI starts, so a bad
    value is refused there, with the same checks (:class:`TrainConfig`'s) as later.

    Raises:
        ConfigError: a bad value or file. A bad value that came from the file names
            the file and its key (``--config 'run.toml': key 'epochs': 'three': must
            be an integer >= 1``); one from a flag names the flag.
    """
    values = read_config_file(args.config) if args.config else {}
    from_file = set(values)
    for name in OUTPUT_OPTIONS:  # what rank 0 prints: settled by `settle_early`, not a training option
        values.pop(name, None)
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
    try:
        if values.get("optimizer", OPTIMIZERS[0]) not in OPTIMIZERS:  # "module:Class" is a Python API run's record
            allowed = f"one of {', '.join(OPTIMIZERS)}"
            raise ConfigError(f"--optimizer {values['optimizer']!r}: must be {allowed}", "optimizer",
                              values["optimizer"], allowed)
        return TrainConfig(**values)
    except ConfigError as exc:
        name = exc.option
        if name is None or name in flags or name not in from_file:
            raise
        raise ConfigError(f"{config_key_text(args.config, name)}: {exc.problem}", name, exc.value,
                          exc.allowed) from None


def settle_early(args: argparse.Namespace) -> None:
    """What must be known before MPI and torch start: the output options, the values, the thread request.

    Sets ``args.verbose``, ``args.quiet``, ``args.progress`` from the flags, else the
    config file, else the defaults (0, False, ``auto``). Checks every value of the
    file and the flags (`config_from_args`: the same checks the ranks make later), so
    a bad one is one line before MPI starts; so are a plain ``--resume`` with nothing
    to continue (`flodl_mpi.training.resume_target.early_refusal`, asked again once MPI is up),
    a missing data file or dataset, a malformed or unfindable ``--model``, a run dir
    that cannot be made (`flodl_mpi.cli.precheck.input_problem`). Checks ``OMP_NUM_THREADS``
    now, before torch is imported: its OpenMP runtime (libgomp) reads the variable at
    load time on every rank and prints a warning of its own for a bad value.

    Raises:
        ConfigError: an unreadable config file, a bad value in it or in a flag, a
            refused ``--resume``.
        ValueError: ``OMP_NUM_THREADS`` is not a positive integer (and ``--threads`` is not given);
            a problem `input_problem` found.
    """
    values = read_config_file(args.config) if args.config else {}
    for name, default in (("verbose", 0), ("quiet", False), ("progress", "auto")):
        if getattr(args, name, None) is None:
            setattr(args, name, values.get(name, default))
    cfg = config_from_args(args)  # every value, as every rank checks it again once MPI is up
    refusal = early_refusal(cfg.run_dir, cfg.resume)  # a plain --resume with nothing to continue
    if refusal is not None:
        raise ConfigError(refusal)
    thread_request(cfg.threads)
    problem = input_problem(cfg)  # the data file and names, the model spec, the run dir (issue 26 item 9)
    if problem is not None:
        raise ValueError(problem)


def _say_once(text: str) -> None:
    if launcher_rank() == 0:
        print(text, file=sys.stderr, flush=True)


#: Seconds a silent rank waits before it exits on a refusal made before MPI starts.
SPEAKER_GRACE_S = 2.0


def _refuse(text: str) -> int:
    """Refuse before MPI starts: the launcher's rank 0 says ``text``; every rank returns 2.

    The other ranks wait a moment first: Open MPI's launcher tears the job down at the
    first non-zero exit, which could kill rank 0 before its line is out (no collective
    orders the exits here, MPI is not running).
    """
    _say_once(text)
    if launcher_rank() != 0:
        time.sleep(SPEAKER_GRACE_S)
    return EXIT_INPUT


#: The clean-up before MPI starts under srun (flodl_mpi.runtime.stale_shm); the Slurm harness calls it by this name.
_clear_stale_shm = clear_before_mpi


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``flodl-mpi``; returns the exit status (see the module docstring)."""
    command_line = argv is None  # the process's own: its stdout is ours to end on
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in TOOLS:  # looking at a run: no MPI, no stop handling
        if command_line:
            unix_pipe()
        return _run_tool(argv)
    if not argv:  # what can I do here? The commands, on stderr, and the usage status
        build_parser().print_help(sys.stderr)
        return EXIT_INPUT
    stop = StopRequest()
    stop.install()  # first thing: before MPI starts and torch loads
    try:
        return _main(argv, stop)
    finally:
        stop.close()  # the status is decided; a late stop signal must not change it during the exit


def _main(argv: list[str] | None, stop: StopRequest) -> int:
    try:
        args = build_parser().parse_args(argv)
    except _UsageError as exc:
        return _refuse(str(exc))
    try:
        settle_early(args)
    except ValueError as exc:  # ConfigError included: one line, before MPI and torch start
        return _refuse(f"flodl-mpi: error: {exc}")
    from flodl_mpi.errors import InputError
    from flodl_mpi.runtime.startup import start_mpi

    try:  # the one start-up (flodl_mpi.runtime.startup): the checks that need no MPI, then MPI, then the world size
        MPI = start_mpi(warn=_say_once)
    except InputError as exc:  # a world of 1 where the launcher started more: every process is rank 0 of its own
        return _refuse(str(exc))
    stop.install()  # again, in case the MPI library set handlers of its own while starting
    from flodl_mpi.runtime.world import Watchdog, fail, install_excepthooks, start_world

    world = start_world(MPI.COMM_WORLD)
    install_excepthooks(world.rank, world.size)
    watchdog = Watchdog(world.comm, stall_timeout=600.0, thread_level=world.thread_level)
    watchdog.start()
    try:
        if world.rank == 0 and not args.quiet:
            print(f"flodl-mpi: {world.size} rank(s) up; loading PyTorch", flush=True)
        from flodl_mpi.training.run import run_train  # torch is imported here, after MPI is up

        done = run_train(args, world, watchdog, stop, config_from_args)
        watchdog.close()  # collective: every rank ends its heartbeat before MPI finalizes
        return 0 if done else EXIT_STOPPED
    except BaseException as exc:  # the one abort decision (flodl_mpi.runtime.world.fail; STYLE 14)
        fail(exc, world.rank, world.size, watchdog)  # aborts the job unless every rank raised it alike
        if world.rank == 0:  # a CohortError: leave together, one line
            print(f"flodl-mpi: error: {exc}", file=sys.stderr)
        watchdog.close()
        return exc.exit_code
