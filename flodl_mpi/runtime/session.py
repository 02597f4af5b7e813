"""The MPI world for code that imports flodl_mpi: started on first use, a world of 1 without a launcher.

Invariant: whatever starts the script (``python script.py``, ``mpiexec -n N
python script.py``, ``srun``), the same code runs; without a launcher MPI starts
as a singleton (a world of 1) and averaging is the identity. MPI starts through
the CLI's start-up (:func:`flodl_mpi.runtime.startup.start_mpi`: the same checks
before and after), and an uncaught exception on any
rank, in any thread, aborts the whole job (:func:`flodl_mpi.runtime.world.install_excepthooks`)
instead of leaving the other ranks waiting in a round.

Under a launcher, ``import flodl_mpi`` starts MPI and those hooks at once
(:func:`start_at_import`), so an error on one rank anywhere after the import
aborts the job; MPI's start-up itself is bounded (:data:`START_TIMEOUT_VAR`), so
a rank that ended before starting MPI leaves no peer waiting in ``MPI_Init``.
The process's state across runs (open sessions, stop-signal handlers, hooks) is
one object, :class:`SessionState`, owned here.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from dataclasses import dataclass

from flodl_mpi.errors import EXIT_INPUT, CohortError, InputError
from flodl_mpi.runtime.launcher import launch_env
from flodl_mpi.runtime.startup import DEFAULT_START_TIMEOUT_S, START_TIMEOUT_VAR, mpi_running, start_mpi, start_timeout

__all__ = ["DEFAULT_START_TIMEOUT_S", "START_TIMEOUT_VAR", "Session", "SessionState", "leave_on_error", "leaves_together",
           "open_session", "start_at_import", "start_timeout"]


@dataclass
class Session:
    """One rank's place in the job and its stall watchdog, for the Python API.

    Attributes:
        world: :class:`flodl_mpi.runtime.world.World` (rank, size, local rank, thread level).
        watchdog: the started :class:`flodl_mpi.runtime.world.Watchdog`.
        stop: the process's stop request (:class:`flodl_mpi.runtime.signals.StopRequest`) while it is open.
    """

    world: object
    watchdog: object
    stop: object = None
    closed: bool = False

    def close(self) -> None:
        """End the watchdog's heartbeat. Collective: every rank calls it (idempotent).

        The last open session gives the stop signals back to the script's own
        handlers; after a stop (exit status 4 decided) they are ignored instead.
        """
        was_open, last = _state.remove(self)
        if not was_open:
            return
        self.watchdog.close()
        if last:
            _state.release_stop(self.stop)


def _stop_before_run(signum, frame) -> None:
    """A stop signal after ``import flodl_mpi`` started MPI, before the first run opened: exit status 4 now.

    Why now, not at the run's first round: nothing is trained yet, so nothing can
    be saved or lost (the last checkpoint, if any, stays the one to resume), and
    the script's own setup (data loading) before ``fit`` or ``Averager`` may
    outlast a preemption's grace period; a job killed then would end with 137, not
    the 4 its job script requeues on. The launchers signal every rank alike, so
    every rank leaves here. Raises :class:`flodl_mpi.Stopped` (``SystemExit(4)``:
    no traceback; MPI finalizes at exit); later stop signals are ignored.
    """
    import signal

    from flodl_mpi.errors import Stopped
    from flodl_mpi.runtime.launcher import launcher_rank
    from flodl_mpi.runtime.signals import StopRequest

    for sig in StopRequest.SIGNALS:  # exit status 4 is decided: a second signal changes nothing
        signal.signal(sig, signal.SIG_IGN)
    name = signal.Signals(signum).name
    if launcher_rank() == 0:
        try:  # os.write, not print: a handler may run in the middle of a print
            os.write(2, f"flodl-mpi: {name} before the run opened (flodl_mpi.fit or Averager): nothing trained, "
                        "nothing to save; exit status 4 (run the same script again to go on; with resume=True "
                        "it continues from the last checkpoint)\n".encode())
        except OSError:
            pass
    raise Stopped(name, 0)


class SessionState:
    """The process's state across the Python API's runs: its open sessions, its stop signals, its hooks.

    One instance per process, owned by this module (``_state``); every change to
    the stop-signal handlers an API run makes goes through it. Signal handlers are
    only set from the main thread (Python's rule); from another thread the methods
    leave them as they are.

    Attributes:
        open: the sessions not yet closed, oldest first (guarded by ``lock``).
        lock: guards ``open``.
        stop: the stop request of the open sessions (``StopRequest``), or None while none is open.
        previous: the handlers ``stop`` replaced, by signal: they come back after the last run
            (the script's own, not the import's `_stop_before_run`).
        original: the script's handlers before ``import flodl_mpi`` set `_stop_before_run`, by signal.
        hooks_installed: the exception hooks are installed (once per process).
    """

    def __init__(self) -> None:
        self.open: list[Session] = []
        self.lock = threading.Lock()
        self.stop = None
        self.previous: dict = {}
        self.original: dict = {}
        self.hooks_installed = False

    # ---- sessions ----------------------------------------------------------------

    def add(self, session: Session) -> None:
        """``session`` is open."""
        with self.lock:
            self.open.append(session)

    def remove(self, session: Session) -> tuple[bool, bool]:
        """Mark ``session`` closed and forget it; returns (it was open, it was the last open one)."""
        with self.lock:
            if session.closed:
                return False, False
            session.closed = True
            if session in self.open:
                self.open.remove(session)
            return True, not self.open

    # ---- stop signals ------------------------------------------------------------

    def install_stop_before_run(self) -> None:
        """From the import until the first run opens: stop signals end the job with status 4 (`_stop_before_run`)."""
        import signal

        from flodl_mpi.runtime.signals import StopRequest

        if threading.current_thread() is not threading.main_thread():
            return
        for sig in StopRequest.SIGNALS:
            current = signal.getsignal(sig)
            if current is not _stop_before_run:
                self.original[sig] = current
            signal.signal(sig, _stop_before_run)

    def stop_request(self):
        """The process's stop request (SIGUSR1, SIGTERM, SIGINT set a flag the rounds carry), installed.

        As the CLI's (:mod:`flodl_mpi.runtime.signals`): installed before MPI starts and
        again after it (MPI may set handlers of its own); only from the main thread
        (from another, the open one, or a new one not installed).
        """
        import signal

        from flodl_mpi.runtime.signals import StopRequest

        if threading.current_thread() is not threading.main_thread():
            return self.stop or StopRequest("resume=True")
        if self.stop is None:
            self.stop = StopRequest("resume=True")
            self.previous.clear()
            self.previous.update({sig: self.original.get(sig) if signal.getsignal(sig) is _stop_before_run
                                  else signal.getsignal(sig) for sig in StopRequest.SIGNALS})
        self.stop.install()
        return self.stop

    def release_stop(self, stop) -> None:
        """After the last run: a stop ignores later signals (status 4 is decided), else the old handlers return."""
        import signal

        if stop is None or stop is not self.stop or threading.current_thread() is not threading.main_thread():
            return
        self.stop = None
        if stop.requested:
            stop.close()
            return
        for sig, handler in self.previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

    # ---- exception hooks ---------------------------------------------------------

    def install_hooks(self, rank: int) -> None:
        """Once per process: an uncaught exception goes to the one abort decision
        (:func:`flodl_mpi.runtime.world.install_excepthooks`); when the ranks leave together
        (a :class:`CohortError`), the open sessions are closed first."""
        if self.hooks_installed:
            return
        from flodl_mpi.runtime.world import install_excepthooks

        install_excepthooks(rank, on_leave=self.close_all)
        self.hooks_installed = True

    def close_all(self) -> None:
        """A script that never closed its averager: end the heartbeats before MPI finalizes."""
        for session in list(self.open):
            session.close()


#: The process's one `SessionState`.
_state = SessionState()
atexit.register(_state.close_all)


def open_session(comm=None, stall_timeout: float = 600.0) -> Session:
    """Start MPI if needed and describe this rank; start a stall watchdog.

    Collective over ``comm`` (default ``MPI.COMM_WORLD``): every rank calls it.

    Args:
        comm: an ``mpi4py`` intracommunicator of the ranks that train together,
            or None for the world (a world of 1 under plain ``python``).
        stall_timeout: seconds, > 0: no progress on any rank for this long ends
            the job with exit status 3 (:class:`flodl_mpi.runtime.world.Watchdog`).

    Raises:
        InputError: another MPI's launcher, or a world of 1 where the launcher started more
            (:func:`flodl_mpi.runtime.startup.start_mpi`).
        ValueError: ``stall_timeout`` not > 0.
    """
    if not (isinstance(stall_timeout, (int, float)) and stall_timeout > 0):
        raise ValueError(f"stall_timeout must be a number of seconds > 0, got {stall_timeout!r}")
    stop = _state.stop_request()  # before MPI starts: a signal during a slow start-up is kept
    MPI = start_mpi()
    stop.install()  # again: the MPI library may have set handlers of its own while starting
    from flodl_mpi.runtime.world import Watchdog, start_world

    world = start_world(MPI.COMM_WORLD if comm is None else comm)
    _state.install_hooks(MPI.COMM_WORLD.rank)
    watchdog = Watchdog(world.comm, stall_timeout=float(stall_timeout), thread_level=world.thread_level)
    watchdog.start()
    session = Session(world, watchdog, stop)
    _state.add(session)
    return session


def _cli_process() -> bool:
    """This process runs ``flodl-mpi`` (the CLI starts MPI itself, after its stop handler and checks)."""
    if sys.argv and os.path.basename(sys.argv[0]) == "flodl-mpi":
        return True
    argv = list(getattr(sys, "orig_argv", []))
    return "-m" in argv and argv.index("-m") + 1 < len(argv) and argv[argv.index("-m") + 1] == "flodl_mpi"


def _worker_process() -> bool:
    """A multiprocessing child (a DataLoader worker started with "spawn" imports the script
    again, inheriting the launcher's variables): not a rank, it must not start MPI."""
    if getattr(sys.modules.get("__main__"), "__name__", "") == "__mp_main__":  # spawn's re-import of the script
        return True
    mp = sys.modules.get("multiprocessing")
    return mp is not None and (mp.parent_process() is not None or getattr(mp.current_process(), "_inheriting", False))


def start_at_import() -> None:
    """Under a launcher, start MPI and the exception hooks now (called by ``import flodl_mpi``).

    Why at import: MPI_Init and every collective wait for all the ranks. Started
    lazily (at the first :class:`~flodl_mpi.Averager` or :func:`~flodl_mpi.fit`), a
    rank that fails in the user's code before that point leaves its peers waiting
    in MPI_Init or in their first collective forever. Started here, such an error
    reaches the world's exception hook and aborts the job (exit status 1), and a
    rank that failed before even importing flodl_mpi is caught by the start-up
    bound (:func:`start_timeout`). A stop signal (SIGUSR1, SIGTERM, Ctrl-C) from
    here until the first run opens ends the job with exit status 4 and one line
    (`_stop_before_run`: nothing is trained yet, so nothing is lost); once a run
    is open, it stops after a round with its checkpoint (:mod:`flodl_mpi.runtime.signals`).

    Nothing is done without a launcher (plain ``python``: a world of 1, started on
    first use), under the CLI (it starts MPI itself), in a multiprocessing child
    (a DataLoader worker: not a rank), or when MPI runs already
    (``python -m mpi4py``, or the script started it: its starter owns the error
    handling; the hooks come with the first Averager or fit). A refusal (another
    MPI's launcher, a world of 1 where the launcher started more, a bad
    ``FLODL_MPI_START_TIMEOUT``) is one line from the launcher's rank 0 and exit status 2.
    """
    env = launch_env()
    if env.launcher is None or _cli_process() or _worker_process():
        return
    if mpi_running():
        return
    _state.install_stop_before_run()  # before MPI starts: a signal during a slow start-up is kept, then exits 4
    try:
        MPI = start_mpi()
    except InputError as exc:
        if env.rank == 0:
            print(exc, file=sys.stderr, flush=True)
        raise SystemExit(EXIT_INPUT) from None
    _state.install_stop_before_run()  # again: the MPI library may have set handlers of its own while starting
    _state.install_hooks(MPI.COMM_WORLD.rank)


def _choices() -> dict[str, tuple[str, ...]]:
    """The options whose value is one of a few words, by config name."""
    from flodl_mpi import config as c
    from flodl_mpi.policy.registry import names as policy_names

    return {"policy": policy_names(), "optimizer": c.OPTIMIZERS, "device": c.DEVICES, "on_non_finite": c.ON_NON_FINITE,
            "outer": c.OUTERS, "node_reduce": c.NODE_REDUCES, "hierarchical": c.HIERARCHICAL,
            "average_optimizer_state": c.AVERAGE_OPTIMIZER_STATE, "async_adopt": c.ASYNC_ADOPTS,
            "wire": c.WIRES, "resume": (c.RESUME_AUTO,)}  # --resume auto: resume='auto' (a plain --resume: resume=True)


def _api_word(match) -> str:
    from flodl_mpi.config import TrainConfig

    name, word = match.group(1).replace("-", "_"), match.group(3)
    if word is not None and word in _choices().get(name, ()):  # --on-non-finite stop: on_non_finite='stop'
        return f"{name}={word!r}"
    if isinstance(getattr(TrainConfig(), name, None), bool) and not match.group(2):  # "--resume 2": resume=2
        text = f"{name}=True"
    else:
        text = f"{name}=" if match.group(2) else name
    return text if word is None else f"{text} {word}"


def api_words(exc: BaseException) -> BaseException:
    """``exc`` in the Python API's words: a :class:`CohortError` whose message names the
    CLI's flags (``--run-dir 'x'``, ``--resume``, ``--on-non-finite stop``) comes back as
    the same class naming the keywords (``run_dir='x'``, ``resume=True``,
    ``on_non_finite='stop'``); anything else is returned as it is."""
    import re

    if not isinstance(exc, CohortError) or "--" not in str(exc):
        return exc
    # a flag, then either a value (quoted, a number, a parenthesis or an upper-case metavar such as ``F``: the
    # keyword takes ``=``) or a lower-case word (a choice's value, or the prose that follows)
    text = re.sub(r"(?<![\w-])--([a-z][a-z0-9-]*)(?:( (?=['\"\d(]|[A-Z]+\b))| ([a-z][a-z0-9-]*\b))?", _api_word,
                  str(exc))
    new = type(exc)(text)
    new.__cause__, new.__traceback__ = exc.__cause__, exc.__traceback__
    return new


def leaves_together(session: Session, exc: BaseException) -> bool:
    """Whether the ranks of ``session`` leave together after ``exc`` (else :func:`leave_on_error` aborts the job).

    The one abort decision (:func:`flodl_mpi.runtime.world.decide`) as the Python API takes it:
    a :class:`CohortError`, or any error in a world of 1. A front end asks it to tidy up
    (close its bridge and writer) before :func:`leave_on_error`.
    """
    from flodl_mpi.runtime.world import TOGETHER, decide

    return decide(exc, session.world.size, alone_leaves=True) == TOGETHER


def leave_on_error(session: Session, exc: BaseException) -> None:
    """An error in the Python API: the one abort decision (:func:`flodl_mpi.runtime.world.fail`), then leave.

    A :class:`CohortError` was raised on every rank at the same point: the ranks
    close their watchdogs together and the error propagates (rank 0's line is the
    message). A world of 1 has no peers to hang: the error propagates. Anything
    else on a rank of a larger world aborts the whole job now (exit status 1)
    with the rank and the error printed, never a hang.
    """
    from flodl_mpi.runtime.world import fail

    fail(exc, session.world.rank, session.world.size, session.watchdog, alone_leaves=True)
    session.close()  # the ranks leave together (fail returned)
