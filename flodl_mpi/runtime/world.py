"""The world, agreed setup steps, the one abort decision (:func:`decide`, acted on by :func:`fail`), the watchdog (STYLE 14, 16, 17).

Responsibilities: settle the thread level once; find the local rank; turn
setup errors on any rank into one agreed error on every rank; and make sure no
failure ever hangs the job — uncaught exceptions in any thread and stalled
rounds end the whole world with a non-zero exit.
"""

from __future__ import annotations

import contextlib
import dataclasses
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

import numpy as np
from mpi4py import MPI

from flodl_mpi.errors import EXIT_ERROR, EXIT_STALL, CohortError, InputError

__all__ = ["World", "start_world", "agree", "decide", "fail", "abort", "abort_line", "install_excepthooks",
           "TOGETHER", "ABORT", "Watchdog", "stall_verdict",
           "overdue_verdict", "heartbeat_period", "stall_slack", "BEAT_DTYPE"]

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
    started more) run before, in :mod:`flodl_mpi.runtime.launcher`.
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
        watchdog: told that the step began and when this rank's part is done
            and it waits for the others (progress), so a rank that hangs in its
            setup step ends the job instead of hanging it. A step is one piece
            of progress: one rank's part running longer than the stall timeout
            while another rank waits for it is a stall.
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
    step = f"setup step {what!r}"
    if watchdog is not None:
        watchdog.begin(step)
    result, error = None, None
    try:
        result = fn()
    except (ValueError, OSError) as exc:
        error = ("input", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    except Exception as exc:  # a bug on one rank must not hang the others
        # (an error whose message says it all, e.g. a full disk's WriterError: that line alone)
        error = ("bug", str(exc) if getattr(exc, "plain", False) else f"{what}: {type(exc).__name__}: {exc}")
    if watchdog is not None:
        watchdog.round_started(step)  # progress: this rank's part is done
    errors = comm.allgather(error)
    if watchdog is not None:
        watchdog.round_finished()
        watchdog.begin(f"setup after {step}")
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


#: :func:`decide`'s verdicts: the ranks leave together (the caller closes collectively), or this rank aborts the job.
TOGETHER, ABORT = "together", "abort"


def decide(exc: BaseException, world_size: int, *, alone_leaves: bool = False, in_thread: bool = False) -> str:
    """The one abort decision (STYLE 14): may the ranks leave together after ``exc``, or must the job abort?

    Pure: the same answer for the same error on every rank. :data:`TOGETHER` for a
    :class:`CohortError` raised in the main thread (raised on every rank alike, at the
    same point: the ranks leave together, one line, its exit code), and for any error
    in a world of 1 when ``alone_leaves`` (no peer can hang: the Python API lets it
    propagate to the script). :data:`ABORT` for anything else, on this rank alone: the
    peers would wait for it in their next collective forever.

    Args:
        exc: the error.
        world_size: ranks in the world.
        alone_leaves: a world of 1 leaves without an abort (the Python API's choice).
        in_thread: raised in a thread other than the main one: never raised alike.
    """
    if in_thread:
        return ABORT
    if isinstance(exc, CohortError) or (alone_leaves and world_size == 1):
        return TOGETHER
    return ABORT


def abort_line(exc: BaseException, rank: int, thread: str | None = None) -> str:
    """The one line a rank prints before it aborts the job on ``exc`` (no newline).

    ``flodl-mpi: rank R: error: Type: message; aborting the job``; an error whose
    message says it all (``exc.plain``, a full disk's) without its type; one from a
    thread other than the main one names it (``error in thread 'name'``).
    """
    where = "error" if thread is None else f"error in thread {thread!r}"
    what = str(exc) if getattr(exc, "plain", False) else f"{type(exc).__name__}: {exc}"
    return f"flodl-mpi: rank {rank}: {where}: {what}; aborting the job"


def fail(exc: BaseException, rank: int, world_size: int, watchdog: "Watchdog | None" = None, *,
         alone_leaves: bool = False, thread: str | None = None, comm: MPI.Comm | None = None) -> None:
    """Act on :func:`decide` for ``exc``: every error path of the CLI, the API and the exception hooks calls it.

    :data:`TOGETHER`: the watchdog (if any) is told this rank is leaving and this returns;
    the caller then leaves with every rank (closes its watchdog, says rank 0's line or
    re-raises). :data:`ABORT`: prints :func:`abort_line`, then the traceback (not for an
    error whose message says it all), and aborts the job with exit status 1 (:func:`abort`;
    never returns).

    Args:
        exc: the error.
        rank, world_size: this rank's place.
        watchdog: the rank's :class:`Watchdog`, or None.
        alone_leaves, thread: as :func:`decide` (``thread``: the thread's name, or None for the main one).
        comm: the communicator to abort (default ``MPI.COMM_WORLD``).
    """
    if decide(exc, world_size, alone_leaves=alone_leaves, in_thread=thread is not None) == TOGETHER:
        if watchdog is not None:
            watchdog.expect_exit()
        return
    plain = getattr(exc, "plain", False)
    print(abort_line(exc, rank, thread), file=sys.stderr, flush=plain)
    if not plain:
        traceback.print_exception(type(exc), exc, exc.__traceback__)
    abort(EXIT_ERROR, comm)


def abort(code: int = EXIT_ERROR, comm: MPI.Comm | None = None) -> None:
    """End the whole job now: flush, then ``MPI_Abort`` on the world (never returns).

    Under pytest, what the running test wrote, the error just printed included, goes
    to the real streams first (:mod:`flodl_mpi.runtime.pytest_capture`): pytest's capture
    would otherwise die with the process, unreported.

    Args:
        code: the job's exit status.
        comm: the communicator to abort (default ``MPI.COMM_WORLD``; a test passes a fake).
    """
    from flodl_mpi.runtime import pytest_capture

    pytest_capture.release(MPI.COMM_WORLD.Get_rank() if MPI.Is_initialized() else None)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # nothing left to tell: we are aborting either way
            pass
    # The launcher forwards our output through pipes and stops reading once the
    # abort reaches it: give it a moment to pass on the lines just written.
    time.sleep(0.5)
    (MPI.COMM_WORLD if comm is None else comm).Abort(code)
    os._exit(code)  # Abort does not return; belt and braces


def install_excepthooks(rank: int, world_size: int | None = None, on_leave: Callable[[], None] | None = None) -> None:
    """An uncaught exception, in any thread, goes to :func:`fail`: the job aborts, or the ranks leave together.

    In a thread: :func:`abort_line` naming the thread, the traceback, ``MPI_Abort``
    (whose launcher prints its own line); a ``SystemExit`` there ends the thread only.
    In the main thread: a :class:`CohortError` (raised on every rank alike) ends the
    script as the CLI does: one line from rank 0, ``on_leave()`` (the API closes its
    sessions), MPI finalized, exit status ``exc.exit_code`` on every rank, no abort and
    no traceback; anything else aborts as in a thread.

    Args:
        rank: this rank.
        world_size: the world's size (default ``MPI.COMM_WORLD``'s).
        on_leave: called before MPI finalizes when the ranks leave together.
    """
    size = MPI.COMM_WORLD.Get_size() if world_size is None else world_size

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:
            return
        exc = args.exc_value if args.exc_value is not None else args.exc_type()
        fail(exc, rank, size, thread=args.thread.name if args.thread else "?")

    def main_hook(exc_type, exc, tb) -> None:
        if exc is None:
            exc = exc_type()
        if exc.__traceback__ is None:
            exc = exc.with_traceback(tb)
        fail(exc, rank, size)
        # the ranks leave together (a CohortError, raised on every rank at the same point)
        if rank == 0:
            print(f"flodl-mpi: error: {exc}", file=sys.stderr, flush=True)
        if on_leave is not None:
            on_leave()
        sys.stdout.flush()
        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Finalize()  # every rank raised the same error at the same point: they leave together
        os._exit(getattr(exc, "exit_code", EXIT_ERROR))

    threading.excepthook = thread_hook
    sys.excepthook = main_hook


# --------------------------------------------------------------------------- stall watchdog
#
# Progress is cohort-wide. Each rank notes its own progress (a batch trained, its
# part of a round or setup step done, a round or setup step finished) and what it
# is doing; the watchdog threads exchange these as heartbeats on their own
# communicator. A rank waiting for a slower peer that still trains is not
# stalled: the cohort stalls only when some rank waits in a collective and no
# rank made progress for the stall timeout, or when a heartbeat exchange itself
# does not complete for that long (a rank frozen, or gone without the launcher
# noticing).

#: Longest interval between two heartbeat exchanges, seconds.
HEARTBEAT_MAX_S = 2.0
#: How often a waiting watchdog thread tests its request, seconds (STYLE 20).
_POLL_S = 0.05
#: Longest wait, seconds, for the other ranks' stack dumps before the abort.
_DUMP_WAIT_S = 5.0
#: Longest wait, seconds, for the verdict's line to reach the run's log before the abort
#: (a hung file system must not hold the exit).
_NOTE_WAIT_S = 2.0
_TEXT_BYTES = 200

#: One rank's heartbeat, as exchanged (a fixed-size record sent as bytes):
#: ``age`` seconds since the rank's last progress when it sent the beat;
#: ``timeout`` its stall timeout, seconds; ``waiting`` 1 while it waits in a
#: collective for the others; ``exiting`` 1 once it is leaving (see
#: :meth:`Watchdog.close`); ``doing`` what it is doing and its last progress
#: (UTF-8, truncated).
BEAT_DTYPE = np.dtype([("age", "f8"), ("timeout", "f8"), ("waiting", "u1"), ("exiting", "u1"),
                       ("doing", f"S{_TEXT_BYTES}")])


def heartbeat_period(stall_timeout: float) -> float:
    """Seconds between heartbeat exchanges: a tenth of the stall timeout, at most ``HEARTBEAT_MAX_S``."""
    return min(stall_timeout / 10.0, HEARTBEAT_MAX_S)


def stall_slack(stall_timeout: float) -> float:
    """Seconds past the stall timeout by which the watchdog fires at the latest (heartbeats on).

    Two heartbeat periods (the exchange that sees the timeout crossed is posted
    at most one period later, and the ranks post up to a period apart) and one
    second for polling and message latency. Loaded machines add their delays.
    """
    return 2.0 * heartbeat_period(stall_timeout) + 1.0


def _text(beat) -> str:
    return bytes(beat["doing"]).decode("utf-8", errors="replace")


def _name_ranks(ranks: list[int], limit: int = 8) -> str:
    shown = ", ".join(str(r) for r in ranks[:limit])
    more = f" and {len(ranks) - limit} more" if len(ranks) > limit else ""
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}{more}"


def stall_verdict(beats: np.ndarray) -> str | None:
    """Whether the cohort stalled, decided from one heartbeat exchange alone.

    A pure function of the gathered beats, so every rank decides alike from the
    same exchange. The cohort stalled when some rank waits in a collective and
    no rank made progress for the stall timeout (the largest of the ranks'
    timeouts: the agreed one once every rank has read the config). A slow rank
    that still makes progress keeps everyone alive however long the others wait
    for it. Work that runs long on every rank at once (a cold import, a first
    compile, a long evaluation) with no rank waiting is not a stall: a rank
    that hangs is caught once a peer waits for it, as every peer soon does.

    Args:
        beats: ``BEAT_DTYPE`` array of shape (W,); row r is rank r's beat.

    Returns:
        None while no rank waits, or some rank made progress within the timeout; else one line
        naming the ranks that made no progress while not waiting for the others
        (all ranks if every one waits in a collective), what each was doing, and
        the ranks that waited.
    """
    timeout = float(beats["timeout"].max())
    ages = beats["age"]
    if not bool(beats["waiting"].any()) or not bool((ages > timeout).all()):
        return None
    ranks = list(range(len(beats)))
    working = [r for r in ranks if not beats["waiting"][r]]
    head = f"no rank made progress for {float(ages.min()):.1f} s (stall timeout {timeout:g} s)"
    if not working:
        stuck = "; ".join(f"rank {r} {_text(beats[r])}" for r in ranks[:8])
        return f"{head}; every rank waits in a collective: {stuck}"
    stuck = "; ".join(f"rank {r} {_text(beats[r])}, no progress for {ages[r]:.1f} s" for r in working[:8])
    waiting = [r for r in ranks if beats["waiting"][r]]
    others = f"; {_name_ranks(waiting)} waited for it" if waiting else ""
    return f"{head}: {stuck}{others}"


def overdue_verdict(pending_s: float, timeout: float, me: int, last: np.ndarray | None,
                    last_age_s: float) -> str | None:
    """Whether a heartbeat exchange has been pending too long (a rank frozen or gone).

    Args:
        pending_s: seconds since this rank posted the exchange that has not completed.
        timeout: this rank's stall timeout, seconds.
        me: this rank (alive, so never blamed).
        last: the beats of the last exchange that completed (``BEAT_DTYPE``, (W,)), or None.
        last_age_s: seconds since that exchange completed.

    Returns:
        None while ``pending_s <= timeout``; else one line naming the likely
        ranks: the other ranks that were working, not waiting, at the last
        completed exchange (a rank that froze stopped its work and its
        heartbeat together), else every other rank, with what each was doing.
    """
    if pending_s <= timeout:
        return None
    head = (f"the watchdogs' heartbeat exchange has not completed for {pending_s:.1f} s (stall timeout "
            f"{timeout:g} s): a rank is frozen (stopped, swapped out) or gone without the launcher noticing")
    if last is None:
        return f"{head}; no exchange had completed yet"
    others = [r for r in range(len(last)) if r != me]
    working = [r for r in others if not last["waiting"][r]]
    suspects = working or others
    what = "; ".join(f"rank {r} {_text(last[r])}" for r in suspects[:8])
    which = "likely" if len(suspects) == 1 else "one of"
    return f"{head}; {which} {_name_ranks(suspects)}, at the last exchange {last_age_s:.1f} s ago: {what}"


@dataclass(frozen=True)
class _Activity:
    progress_at: float          # time.monotonic() of the rank's last progress
    last: str                   # what that progress was
    working_on: str | None      # what the rank does when not waiting
    waiting_in: str | None      # the collective it waits in, or None
    wait_since: float | None    # when that wait began


class Watchdog:
    """Ends the job when the cohort makes no progress, or a failed rank does not exit.

    Each rank tells its watchdog what it does (:meth:`begin`), when it makes
    progress (:meth:`progress`: a batch trained; :meth:`round_started`: its part
    done, it now waits for the others in a collective; :meth:`round_finished`:
    the round or setup step finished). The watchdog threads exchange heartbeats on their
    own duplicate of the world communicator every :func:`heartbeat_period`
    seconds (a non-blocking Allgather completed with Test and short sleeps) and
    fire when

    - some rank waits in a collective and no rank made progress for
      ``stall_timeout`` seconds (:func:`stall_verdict`; e.g. one rank hung in
      its training step or setup step while the others wait for it), or
    - a heartbeat exchange has not completed for ``stall_timeout`` seconds
      (:func:`overdue_verdict`; a rank frozen or gone), or
    - the rank still runs ``exit_grace`` seconds after :meth:`failed` or
      :meth:`expect_exit`.

    A stall fires within ``stall_timeout + stall_slack(stall_timeout)`` seconds
    of the cohort's last progress (on an unloaded machine); a frozen rank within
    as long of its last heartbeat. Firing prints the
    verdict, naming the ranks that made no progress and what they were doing,
    dumps every thread's stack (on every rank, for a cohort stall) and aborts
    the world: exit status 3 for a stall, 1 for a rank that did not exit. It
    ends the process with the world abort, never by raising in its own thread
    (STYLE 16). Before the abort, the rank that has a :attr:`log_path` (rank 0,
    once the run's ``train.log`` exists) appends the verdict to it (waiting at
    most ``_NOTE_WAIT_S`` seconds for the file system). A rank that is frozen
    (SIGSTOP) or holds the interpreter lock in a hung native call cannot do so:
    its watchdog thread cannot run either.

    Needs ``MPI.THREAD_MULTIPLE`` (the heartbeat runs beside the bridge's and the
    setup's collectives, on another communicator). With less, rank 0 says so
    once and each watchdog times only its own rank's waits in collectives
    (a rank waiting longer than ``stall_timeout`` for a slower one is then taken
    for stalled).

    Collective contract: :meth:`start` and :meth:`close` are called by every
    rank, in the same order relative to the other collectives on ``comm``. The
    watchdog threads run the same sequence of heartbeat exchanges on every rank
    and stop after the first exchange in which every rank is exiting, so no
    request is left pending when MPI finalizes.

    Args:
        comm: the world (duplicated in :meth:`start`; never used directly).
        stall_timeout: seconds, > 0. May be changed later (every rank alike).
        exit_grace: seconds a failing rank gets to abort by itself, > 0.
        thread_level: the MPI thread level provided (default ``MPI.Query_thread()``).

    Example::

        watchdog = Watchdog(MPI.COMM_WORLD, stall_timeout=600.0)
        watchdog.start()
        cfg = agree(comm, "config", read_config, watchdog)   # setup steps
        watchdog.begin("training")
        for batch in batches:
            train_step(batch)
            watchdog.progress("a batch")
        watchdog.close()  # every rank; on a rank-local error, abort() instead
    """

    def __init__(self, comm: MPI.Comm, stall_timeout: float, exit_grace: float = 20.0,
                 thread_level: int | None = None) -> None:
        if not stall_timeout > 0 or not exit_grace > 0:
            raise ValueError(f"stall_timeout and exit_grace must be > 0, got {stall_timeout!r}, {exit_grace!r}")
        self.comm = comm
        self.rank = comm.rank
        self.stall_timeout = float(stall_timeout)
        self.exit_grace = float(exit_grace)
        level = MPI.Query_thread() if thread_level is None else thread_level
        #: Whether heartbeats run (MPI gives THREAD_MULTIPLE); else the local clock.
        self.heartbeats = level >= MPI.THREAD_MULTIPLE
        self._lock = threading.Lock()
        self._act = _Activity(time.monotonic(), "start", "start-up", None, None)
        self._exit_by: float | None = None
        self._closing = False
        self._hb_comm: MPI.Comm | None = None
        #: ``--on-rank-failure shrink``: a heartbeat exchange that fails because a peer died ends the
        #: thread quietly (the survivors shrink, then :meth:`rebind`), not the job.
        self.elastic = False
        self._rebinding = False
        self._thread = threading.Thread(target=self._run, name="flodl-watchdog", daemon=True)
        #: The run's log (``train.log``, rank 0's): firing appends ``HH:MM:SS run failed: [rank R: ]watchdog:
        #: <verdict>`` (the line printed) to it before the abort. None: nothing written (the other ranks;
        #: setup before the run dir exists).
        self.log_path: str | os.PathLike | None = None

    # ---- what the rank tells its watchdog (any thread; cheap) -------------------

    def begin(self, what: str) -> None:
        """This rank now works on ``what`` (e.g. ``"setup step 'data'"``, ``"training"``); not progress."""
        with self._lock:
            self._act = dataclasses.replace(self._act, working_on=what)

    def progress(self, done: str = "a batch") -> None:
        """This rank made progress just now: ``done`` finished (e.g. ``"batch 3 of epoch 1"``)."""
        now = time.monotonic()
        with self._lock:
            self._act = dataclasses.replace(self._act, progress_at=now, last=done)

    def round_started(self, what: str = "a round") -> None:
        """This rank's part is done (progress) and it waits for the others in ``what`` (named in messages)."""
        now = time.monotonic()
        with self._lock:
            self._act = dataclasses.replace(self._act, progress_at=now, last=f"reached {what}", waiting_in=what,
                                            wait_since=now)

    def round_finished(self) -> None:
        """The collective wait ended: the round (or setup step) is progress."""
        now = time.monotonic()
        with self._lock:
            act = self._act
            self._act = dataclasses.replace(act, progress_at=now, last=f"{act.waiting_in or 'a round'} finished",
                                            waiting_in=None, wait_since=None)

    def failed(self) -> None:
        """A round failed: the rank must be gone within ``exit_grace`` seconds."""
        with self._lock:
            self._act = dataclasses.replace(self._act, waiting_in=None, wait_since=None)
        self.expect_exit()

    def expect_exit(self) -> None:
        """The rank is leaving on an error: it must be gone within ``exit_grace`` seconds."""
        if self._exit_by is None:
            self._exit_by = time.monotonic() + self.exit_grace

    # ---- life cycle ----------------------------------------------------------------

    def start(self) -> None:
        """Start the watchdog thread. Collective (duplicates ``comm``); call once, before setup."""
        if self.heartbeats:
            self._hb_comm = self.comm.Dup()
        elif self.rank == 0:
            print("flodl-mpi: MPI provides less than THREAD_MULTIPLE: the stall watchdog times each rank's own "
                  "waits (a rank waiting longer than --stall-timeout for a slower one is taken for stalled)",
                  file=sys.stderr, flush=True)
        self._thread.start()

    def rebind(self, comm: MPI.Comm) -> None:
        """Go on over ``comm``, the survivors' world after a shrink (``--on-rank-failure shrink``; collective there).

        Revokes the heartbeats' old communicator (the thread's pending exchange fails
        at once and the thread ends, :attr:`elastic` being set), waits for the thread,
        then starts a new one on a duplicate of ``comm``. The rank's activity is kept.
        """
        from flodl_mpi.runtime.elastic import revoke  # (ULFM's calls: only an elastic run gets here)

        self._rebinding = True
        revoke(self._hb_comm)
        if self._thread.is_alive():
            self._thread.join()
        self._rebinding = False
        self.comm, self.rank = comm, comm.rank
        self._hb_comm = comm.Dup() if self.heartbeats else None
        self._thread = threading.Thread(target=self._run, name="flodl-watchdog", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the watchdog before the rank exits. Collective: every rank calls it when it leaves.

        A rank that leaves alone, on its own error, aborts the world instead.
        Blocks until every rank's watchdog has seen every rank exiting (one or
        two heartbeat exchanges once the last rank calls it); while it waits,
        the watchdog still fires if the others make no progress.
        """
        self.round_started("the exit")  # a rank still at work (a final save, say) is the one named
        self._closing = True
        if self._thread.is_alive():
            self._thread.join()

    # ---- the watchdog thread ------------------------------------------------------------

    def _beat(self, now: float) -> np.ndarray:
        act = self._act
        if act.waiting_in is not None:
            doing = f"waiting for the others in {act.waiting_in}"
        else:
            doing = f"working on {act.working_on}" if act.working_on else "working"
        text = f"{doing} (last progress: {act.last})".encode()[:_TEXT_BYTES]
        return np.array([(now - act.progress_at, self.stall_timeout, act.waiting_in is not None, self._closing,
                          text)], dtype=BEAT_DTYPE)

    def _run(self) -> None:
        if self._hb_comm is None:
            self._run_local()
        else:
            self._run_heartbeats(self._hb_comm)

    def _run_local(self) -> None:
        while not self._closing:
            time.sleep(0.5)
            now = time.monotonic()
            self._check_exit(now)
            act = self._act
            if act.wait_since is not None and now - act.wait_since > self.stall_timeout:
                self._fire(EXIT_STALL, f"{act.waiting_in} made no progress for {now - act.wait_since:.0f} s "
                           f"(stall timeout {self.stall_timeout:g} s; a peer may be hung or dead)")

    def _run_heartbeats(self, comm: MPI.Comm) -> None:
        recv = np.zeros(comm.size, dtype=BEAT_DTYPE)
        last, last_done = None, 0.0
        while True:
            # -- post this rank's beat; the exchange completes once every rank posted its own
            posted = time.monotonic()
            send = self._beat(posted)
            try:
                request = comm.Iallgather([send.view(np.uint8), MPI.BYTE], [recv.view(np.uint8), MPI.BYTE])
                while not request.Test():
                    self._wait_beat(posted, last, last_done)
            except MPI.Exception as exc:
                from flodl_mpi.runtime.elastic import is_rank_failure

                if self.elastic and is_rank_failure(exc):
                    return  # a peer died: the survivors shrink and rebind() starts a new thread
                raise
            beats, last_done = recv.copy(), time.monotonic()
            # -- decide from the gathered beats only: every rank decides alike
            if bool(beats["exiting"].all()):
                break
            why = stall_verdict(beats)
            if why is not None:
                self._fire_cohort(comm, why)
            last = beats
            # -- wait for the next beat (at once when leaving: close() is waiting)
            due = posted + heartbeat_period(float(beats["timeout"].max()))
            while not self._closing and not self._rebinding and (now := time.monotonic()) < due:
                self._check_exit(now)
                time.sleep(min(_POLL_S, due - now))
        comm.Free()

    def _wait_beat(self, posted: float, last: np.ndarray | None, last_done: float) -> None:
        """One poll while a heartbeat exchange is pending: fire when it is overdue, else sleep a little."""
        now = time.monotonic()
        self._check_exit(now)
        why = overdue_verdict(now - posted, self.stall_timeout, self.rank, last, now - last_done)
        if why is not None:
            self._fire(EXIT_STALL, why)
        time.sleep(_POLL_S)

    def _check_exit(self, now: float) -> None:
        if self._exit_by is not None and now > self._exit_by:
            self._fire(EXIT_ERROR, f"the rank did not exit within {self.exit_grace:g} s of an error")

    def _note(self, verdict: str) -> None:
        """Append ``verdict`` (as printed) to :attr:`log_path`, if set; waits at most ``_NOTE_WAIT_S`` seconds.

        The append runs in a daemon thread: a file system that hangs delays the
        abort by the wait, never more (the abort ends the thread with the process).
        An ``OSError`` is ignored: stderr has the verdict.
        """
        path = self.log_path
        if path is None:
            return
        line = f"{time.strftime('%H:%M:%S')} run failed: {verdict}\n"

        def append() -> None:
            with contextlib.suppress(OSError), open(path, "a") as fh:
                fh.write(line)

        writer = threading.Thread(target=append, name="flodl-watchdog-note", daemon=True)
        writer.start()
        writer.join(_NOTE_WAIT_S)

    def _fire(self, code: int, why: str) -> None:
        """This rank alone decided: say why, dump its stacks, abort the world."""
        print(f"flodl-mpi: rank {self.rank}: watchdog: {why}; stacks follow, then the job is aborted",
              file=sys.stderr, flush=True)
        self._note(f"rank {self.rank}: watchdog: {why}")
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        abort(code)

    def _fire_cohort(self, comm: MPI.Comm, why: str) -> None:
        """Every rank decided alike: rank 0 says why, every rank dumps its stacks, then the abort."""
        if self.rank == 0:
            print(f"flodl-mpi: watchdog: {why}; every rank's stacks follow, then the job is aborted",
                  file=sys.stderr, flush=True)
        self._note(f"watchdog: {why}")
        print(f"flodl-mpi: rank {self.rank}: watchdog: this rank's stacks:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        # Let the other ranks dump theirs before the abort ends them (bounded: a
        # rank may be frozen).
        request = comm.Ibarrier()
        deadline = time.monotonic() + _DUMP_WAIT_S
        while not request.Test() and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        abort(EXIT_STALL)
