"""MPI start-up and the one place that decides to abort (STYLE 14, 16, 17).

Responsibilities: settle the thread level once; find the local rank; turn
setup errors on any rank into one agreed error on every rank; and make sure no
failure ever hangs the job — uncaught exceptions in any thread and stalled
rounds end the whole world with a non-zero exit.
"""

from __future__ import annotations

import faulthandler
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from mpi4py import MPI

from flodl_mpi.errors import EXIT_ERROR, EXIT_STALL, CohortError, InputError

__all__ = ["World", "start_world", "agree", "abort", "Watchdog"]

T = TypeVar("T")


@dataclass
class World:
    """This rank's place in the job.

    Attributes:
        comm: ``MPI.COMM_WORLD``.
        rank, size: world rank and world size.
        local_rank, local_size: rank and size among the ranks of this host.
        host: this host's name.
        thread_level: the level MPI provided (``MPI.THREAD_*``).
        threaded_bridge: whether the bridge may run in its own thread
            (needs ``THREAD_SERIALIZED`` or better; only the bridge calls MPI
            while training runs, so SERIALIZED is enough).
    """

    comm: MPI.Comm
    rank: int
    size: int
    local_rank: int
    local_size: int
    host: str
    thread_level: int
    threaded_bridge: bool


def start_world(comm: MPI.Comm | None = None) -> World:
    """Describe this rank and settle the thread level; call once, before training.

    The launcher checks (another MPI's launcher, a world of 1 where the launcher
    started more) run before, in :mod:`flodl_mpi.launcher`.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local_rank, local_size = local.rank, local.size
    local.Free()
    level = MPI.Query_thread()
    threaded = level >= MPI.THREAD_SERIALIZED
    if not threaded and comm.rank == 0:
        print("flodl-mpi: MPI provides less than THREAD_SERIALIZED; rounds run inline on the training thread",
              file=sys.stderr)
    return World(comm, comm.rank, comm.size, local_rank, local_size, socket.gethostname(), level, threaded)


def agree(comm: MPI.Comm, what: str, fn: Callable[[], T], watchdog: "Watchdog | None" = None,
          name_ranks: bool = True) -> T:
    """Run a setup step on every rank and fail on every rank if it failed on any.

    Collective: every rank calls it with the same ``what``, in the same order.
    Setup runs before the bridge starts, so the main thread may call MPI here.

    Args:
        comm: the world.
        what: the step's name, for messages.
        fn: the step.
        watchdog: times the wait for the other ranks like a round, so a rank
            that hangs in its setup step ends the job instead of hanging it.
        name_ranks: prefix the failing ranks when not every rank failed; False
            for a step only one rank does (its rank says nothing).

    Returns:
        ``fn()``'s result on this rank.

    Raises:
        InputError: some rank's step raised a ``ValueError`` or ``OSError`` (bad
            input); the message is that rank's one line, prefixed with the
            failing ranks unless every rank failed alike.
        CohortError: some rank's step raised anything else.
    """
    result, error = None, None
    try:
        result = fn()
    except (ValueError, OSError) as exc:
        error = ("input", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    except Exception as exc:  # a bug on one rank must not hang the others
        error = ("bug", f"{what}: {type(exc).__name__}: {exc}")
    if watchdog is not None:
        watchdog.round_started(f"setup step {what!r}")
    errors = comm.allgather(error)
    if watchdog is not None:
        watchdog.round_finished()
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not failed:
        return result
    messages = sorted({e[1] for _, e in failed})
    if len(messages) == 1 and len(failed) == len(errors):
        text = messages[0]
    elif len(messages) == 1 and not name_ranks:
        text = messages[0]
    elif len(messages) == 1:
        text = f"rank(s) {', '.join(str(r) for r, _ in failed)}: {messages[0]}"
    else:
        text = "; ".join(f"rank {r}: {e[1]}" for r, e in failed)
    if all(e[0] == "input" for _, e in failed):
        raise InputError(text)
    raise CohortError(text)


def abort(code: int = EXIT_ERROR) -> None:
    """End the whole job now: flush, then ``MPI_Abort`` on the world (never returns)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # nothing left to tell: we are aborting either way
            pass
    # The launcher forwards our output through pipes and stops reading once the
    # abort reaches it: give it a moment to pass on the lines just written.
    time.sleep(0.5)
    MPI.COMM_WORLD.Abort(code)
    os._exit(code)  # Abort does not return; belt and braces


def install_excepthooks(rank: int) -> None:
    """An uncaught exception in any thread prints with its rank and aborts the world."""

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:
            return
        name = args.thread.name if args.thread else "?"
        print(f"flodl-mpi: rank {rank}: uncaught exception in thread {name!r}:", file=sys.stderr)
        traceback.print_exception(args.exc_type, args.exc_value, args.exc_traceback)
        abort(EXIT_ERROR)

    def main_hook(exc_type, exc, tb) -> None:
        print(f"flodl-mpi: rank {rank}: uncaught exception:", file=sys.stderr)
        traceback.print_exception(exc_type, exc, tb)
        abort(EXIT_ERROR)

    threading.excepthook = thread_hook
    sys.excepthook = main_hook


class Watchdog:
    """Ends the job when a round stalls or a failed rank does not exit.

    A round in flight for more than ``stall_timeout`` seconds, or a rank still
    running ``exit_grace`` seconds after :meth:`failed` or :meth:`expect_exit`,
    dumps every thread's stack to stderr and aborts the world (exit status 3 for
    a stall). It ends the process with the world abort, never by raising in its
    own thread (STYLE 16).

    Args:
        rank: for messages.
        stall_timeout: seconds, > 0.
        exit_grace: seconds a failing rank gets to abort by itself, > 0.
    """

    def __init__(self, rank: int, stall_timeout: float, exit_grace: float = 20.0) -> None:
        if not stall_timeout > 0 or not exit_grace > 0:
            raise ValueError(f"stall_timeout and exit_grace must be > 0, got {stall_timeout!r}, {exit_grace!r}")
        self.rank = rank
        self.stall_timeout = float(stall_timeout)
        self.exit_grace = float(exit_grace)
        self._round_since: float | None = None
        self._what = "a round"
        self._exit_by: float | None = None
        self._thread = threading.Thread(target=self._loop, name="flodl-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def round_started(self, what: str = "a round") -> None:
        """A collective wait began; ``what`` names it in the message if it stalls."""
        self._what = what
        self._round_since = time.monotonic()

    def round_finished(self) -> None:
        self._round_since = None

    def failed(self) -> None:
        """A round failed: the rank must be gone within ``exit_grace`` seconds."""
        self._round_since = None
        self.expect_exit()

    def expect_exit(self) -> None:
        if self._exit_by is None:
            self._exit_by = time.monotonic() + self.exit_grace

    def _loop(self) -> None:
        while True:  # a daemon thread: it ends with the process
            time.sleep(0.5)
            now = time.monotonic()
            since = self._round_since
            if since is not None and now - since > self.stall_timeout:
                self._fire(EXIT_STALL, f"{self._what} made no progress for {now - since:.0f} s "
                           f"(stall timeout {self.stall_timeout:g} s; a peer may be hung or dead)")
            if self._exit_by is not None and now > self._exit_by:
                self._fire(EXIT_ERROR, f"the rank did not exit within {self.exit_grace:g} s of an error")

    def _fire(self, code: int, why: str) -> None:
        print(f"flodl-mpi: rank {self.rank}: watchdog: {why}; stacks follow, then the job is aborted",
              file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        abort(code)
