"""``flodl-mpi inject-failure RUN_DIR``: kill -9 a rank of the run training in RUN_DIR, at a moment you choose.

For checking a setup's failure path (the exit status, what is saved, a restart loop
such as ``jobs/workstation.sh --restarts N``) against a live job. It starts no MPI
and touches no file of the run: it reads ``RUN_DIR/ranks.json``, each launch's
ranks (:mod:`flodl_mpi.runtime.live_ranks`), ``metrics.h5`` (an SWMR reader, as
``flodl-mpi report``) and the checkpoint directory's listing, and sends SIGKILL to
one rank's process on this host.

Moments (one of): ``--round N``: once metrics.h5 holds round N (rounds count from 0;
its rows come in blocks up to 0.5 s late, so the kill lands at round N or somewhat
after); ``--epoch N``: once epoch N's row is written (the end of epoch N, when its
checkpoint is being saved); ``--stage setup``: as soon as a launch's ranks are up
(they wrote ranks.json, before the first round); ``--stage checkpoint``: while a
checkpoint is being written (its temporary file exists; a write faster than the poll
may be missed, the next one is taken); ``--after S``: S seconds after a launch's
ranks were up. With ``--times K`` it kills K times, one launch each: after a kill it
waits for the next launch (a restart) and kills it at the next moment
(``--round``/``--epoch``: N + ``--every`` x kills so far; the others: the same moment
of each launch).

It may be started with the run: it waits for RUN_DIR and for each launch's ranks.
Exit status: 0 every kill made; 1 the run finished (train.log's ``done:``) or
``--timeout`` passed first (saying how many kills were made); 2 bad input (RUN_DIR
is a file, a rank the launch does not have, a rank on another host).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import socket
import sys
import time
from pathlib import Path

import h5py

from flodl_mpi.errors import EXIT_ERROR, EXIT_INPUT
from flodl_mpi.runtime.live_ranks import Launch, read_launch

__all__ = ["STAGES", "POLL_S", "add_parser", "run", "moment_reached"]

STAGES = ("setup", "checkpoint")
#: Seconds between looks at the run dir.
POLL_S = 0.02


def _at_least_zero(parse, what: str):
    """An argparse ``type``: ``parse(text)`` (``int`` or ``float``), refused unless >= 0 (NaN too) with the
    line ``must be WHAT, got 'TEXT'``."""

    def check(text: str):
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if not value >= 0:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value

    return check


_count = _at_least_zero(int, "an integer >= 0")
_seconds = _at_least_zero(float, "a number of seconds >= 0")
_rank = _at_least_zero(int, "a rank (an integer >= 0) or 'random'")


def _rank_choice(text: str) -> int | str:
    return text if text == "random" else _rank(text)


def add_parser(sub) -> argparse.ArgumentParser:
    """Register ``inject-failure`` on the ``flodl-mpi`` sub-parsers."""
    p = sub.add_parser(
        "inject-failure",
        allow_abbrev=False,
        help="kill -9 a rank of a live run at a round, an epoch, a stage or a time (to test a setup)",
        description="Kill -9 a chosen or a random rank of the run training in RUN_DIR (ranks on this "
        "host), once or at each of several launches (a restart loop). Exit status 0 every "
        "kill made, 1 the run finished or --timeout passed first, 2 bad input.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's directory (its --run-dir)")
    when = p.add_mutually_exclusive_group(required=True)
    when.add_argument(
        "--round",
        type=_count,
        metavar="N",
        help="once metrics.h5 holds round N (from 0; its rows come up to 0.5 s late)",
    )
    when.add_argument("--epoch", type=_count, metavar="N", help="once epoch N (from 1) has ended")
    when.add_argument(
        "--stage",
        choices=STAGES,
        help="setup: as soon as a launch's ranks are up; checkpoint: while a checkpoint is written",
    )
    when.add_argument("--after", type=_seconds, metavar="SECONDS", help="this long after a launch's ranks are up")
    p.add_argument(
        "--rank",
        type=_rank_choice,
        default="random",
        help="the rank to kill, or random (default: random, among the launch's ranks on this host)",
    )
    p.add_argument(
        "--times",
        type=_count,
        default=1,
        help="kills in all, one per launch: after each, wait for the next launch (default 1)",
    )
    p.add_argument(
        "--every",
        type=_count,
        default=0,
        metavar="N",
        help="with --round or --epoch: the k-th kill (from 0) comes at N + k x this (default 0)",
    )
    p.add_argument("--seed", type=int, help="seed of --rank random (default: a fresh one)")
    p.add_argument(
        "--timeout", type=_seconds, default=600.0, help="give up after this many seconds, exit status 1 (default 600)"
    )
    return p


def _progress(run_dir: Path, table: str, column: str) -> int:
    """The last value of ``table/column`` in run_dir/metrics.h5, read as an SWMR reader; -1 without rows or file."""
    try:
        with h5py.File(run_dir / "metrics.h5", "r", swmr=True) as f:
            ds = f[table][column]
            return int(ds[-1]) if len(ds) else -1
    except (OSError, KeyError, BlockingIOError):  # not there yet, rebuilt by a resume, locked while created
        return -1


def _writing_checkpoint(run_dir: Path) -> bool:
    try:
        return any(".tmp-" in e.name for e in os.scandir(run_dir / "checkpoints"))
    except OSError:
        return False


def moment_reached(args: argparse.Namespace, run_dir: Path, launch: Launch, kills: int) -> bool:
    """Whether the moment of kill number ``kills`` (from 0) has come in ``launch`` (its ranks up).

    ``args``: the parsed options (``round``, ``epoch``, ``stage``, ``after``, ``every``).
    """
    if args.round is not None:
        return _progress(run_dir, "rounds", "round") >= args.round + kills * args.every
    if args.epoch is not None:
        return _progress(run_dir, "epochs", "epoch") >= args.epoch + kills * args.every
    if args.stage == "setup":
        return True
    if args.stage == "checkpoint":
        return _writing_checkpoint(run_dir)
    return time.time() - launch.written >= args.after


def _finished(run_dir: Path) -> bool:
    """train.log's last line says the run is done (nothing more will be launched to kill)."""
    try:
        lines = (run_dir / "train.log").read_text(errors="replace").splitlines()
    except OSError:
        return False
    return bool(lines) and re.match(r"(\S+ )?(done|nothing to do):", lines[-1]) is not None


def _victim(args: argparse.Namespace, launch: Launch, rng: random.Random):
    """The rank to kill in ``launch``, or a refusal (str)."""
    if args.rank == "random":
        local = launch.alive()
        return rng.choice(local) if local else None
    if args.rank >= launch.world_size:
        return f"--rank {args.rank}: the run has {launch.world_size} rank(s)"
    target = launch.ranks[args.rank]
    if target.host != socket.gethostname():
        return f"--rank {args.rank} runs on host {target.host}, not this one: run inject-failure there"
    return target if target.alive() else None


def run(args: argparse.Namespace) -> int:
    """``flodl-mpi inject-failure``; returns the exit status."""
    if args.every and args.round is None and args.epoch is None:
        print("flodl-mpi inject-failure: error: --every applies to --round and --epoch", file=sys.stderr)
        return EXIT_INPUT
    run_dir = Path(args.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        print(f"flodl-mpi inject-failure: error: {args.run_dir}: not a directory", file=sys.stderr)
        return EXIT_INPUT
    if not run_dir.exists():  # started with the run: its rank 0 makes it
        print(f"flodl-mpi inject-failure: waiting for {args.run_dir} (not there yet)", file=sys.stderr, flush=True)
    rng = random.Random(args.seed)
    deadline = time.monotonic() + args.timeout
    killed: set[str] = set()  # launches already killed: the next kill waits for a new one
    kills = 0
    while kills < args.times:
        launch = read_launch(run_dir)
        if launch is not None and launch.launch not in killed and launch.alive():
            if moment_reached(args, run_dir, launch, kills):
                victim = _victim(args, launch, rng)
                if isinstance(victim, str):
                    print(f"flodl-mpi inject-failure: error: {victim}", file=sys.stderr)
                    return EXIT_INPUT
                if victim is not None:
                    os.kill(victim.pid, signal.SIGKILL)
                    killed.add(launch.launch)
                    kills += 1
                    where = _where(run_dir)
                    print(
                        f"flodl-mpi inject-failure: kill {kills} of {args.times}: SIGKILL to rank {victim.rank} "
                        f"(pid {victim.pid}) of {launch.world_size} at {where}",
                        flush=True,
                    )
                    continue
        elif launch is None or not launch.alive():
            if _finished(run_dir):
                print(
                    f"flodl-mpi inject-failure: the run finished (train.log: done) after {kills} of {args.times} "
                    "kill(s)",
                    file=sys.stderr,
                )
                return EXIT_ERROR
        if time.monotonic() > deadline:
            print(
                f"flodl-mpi inject-failure: --timeout {args.timeout:g} s passed after {kills} of {args.times} kill(s)",
                file=sys.stderr,
            )
            return EXIT_ERROR
        time.sleep(POLL_S)
    return 0


def _where(run_dir: Path) -> str:
    """Where the run was, as metrics.h5 shows it: ``round R (epoch E done)``."""
    r, e = _progress(run_dir, "rounds", "round"), _progress(run_dir, "epochs", "epoch")
    return f"round {r} (epochs done: {max(e, 0)}) as metrics.h5 shows"
