"""The MPI world for code that imports flodl_mpi: started on first use, a world of 1 without a launcher.

Invariant: whatever starts the script (``python script.py``, ``mpiexec -n N
python script.py``, ``srun``), the same code runs; without a launcher MPI starts
as a singleton (a world of 1) and averaging is the identity. The checks the CLI
makes before and after MPI starts (another MPI's launcher, a world of 1 where
the launcher started more) are made here too, and an uncaught exception on any
rank, in any thread, aborts the whole job (:func:`flodl_mpi.runtime.world.install_excepthooks`)
instead of leaving the other ranks waiting in a round.

Under a launcher, ``import flodl_mpi`` starts MPI and those hooks at once
(:func:`start_at_import`), so an error on one rank anywhere after the import
aborts the job; MPI's start-up itself is bounded (:data:`START_TIMEOUT_VAR`), so
a rank that ended before starting MPI leaves no peer waiting in ``MPI_Init``.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from dataclasses import dataclass

from flodl_mpi.errors import EXIT_ERROR, EXIT_INPUT, CohortError, InputError
from flodl_mpi.runtime.launcher import check_world_size, foreign_launcher, launch_env, mixed_install, mpi_library

__all__ = ["DEFAULT_START_TIMEOUT_S", "START_TIMEOUT_VAR", "Session", "leave_on_error", "open_session",
           "start_at_import", "start_timeout"]

#: Environment variable: seconds a launched rank waits in MPI's start-up for the others.
START_TIMEOUT_VAR = "FLODL_MPI_START_TIMEOUT"
#: Its default. Every rank starts MPI as it imports flodl_mpi, so the ranks arrive
#: within their imports' spread of each other; past this, a peer is taken for gone.
DEFAULT_START_TIMEOUT_S = 120.0

_hooks_installed = False
_open: list[Session] = []
_lock = threading.Lock()


def start_timeout(environ=None) -> float:
    """Seconds a launched rank waits in MPI's start-up (``FLODL_MPI_START_TIMEOUT``, default 120).

    Raises:
        InputError: the variable is set but not a number of seconds > 0.
    """
    text = (os.environ if environ is None else environ).get(START_TIMEOUT_VAR, "").strip()
    if not text:
        return DEFAULT_START_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise InputError(f"flodl-mpi: error: {START_TIMEOUT_VAR}={text!r}: must be a number of seconds > 0")
    return value


#: The start-up bound's watcher: a separate process, since MPI_Init holds the GIL (no Python
#: thread runs while the main thread is inside it; measured with mpi4py 4 and MPICH 4).
_WATCHER = """
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
pid, end = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    time.sleep(0.2)
    if os.getppid() != pid:
        sys.exit(0)
os.write(2, sys.argv[3].encode())
os.kill(pid, signal.SIGKILL)
"""


class _StartBound:
    """Ends this rank if MPI's start-up has not returned within the start timeout.

    Why: MPI_Init waits for every rank the launcher started, and MPICH's Hydra
    does not end the job when a rank exits *before* it started MPI (measured:
    rank 0 waits in MPI_Init forever after rank 1 raised at its first line).
    MPI_Init holds the GIL, so the bound is a small watcher process: at the
    deadline it prints one line and kills this rank (SIGKILL: nothing else ends
    a process inside MPI_Init); :meth:`done` ends the watcher.
    """

    def __init__(self, timeout: float, rank: int) -> None:
        import subprocess

        text = (f"flodl-mpi: rank {rank}: error: MPI did not start within {timeout:g} s: another rank ended "
                "before it started MPI (its error is above) or never reached `import flodl_mpi`; ending this rank "
                f"({START_TIMEOUT_VAR}=SECONDS waits longer)\n")
        self._watcher = subprocess.Popen([sys.executable, "-S", "-c", _WATCHER, str(os.getpid()), repr(timeout), text],
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)

    def done(self) -> None:
        self._watcher.kill()
        self._watcher.wait()


def _start_mpi():
    """Start MPI (THREAD_MULTIPLE) unless it runs already; refuse another MPI's launcher first.

    Under a launcher that started more than one rank, the start-up is bounded by
    :func:`start_timeout`: past it this rank prints one line and exits with status 1.

    Raises:
        InputError: started by the launcher of another MPI, or a world of 1 where
            the launcher started more ranks (one line, as the CLI's refusal), or a
            bad ``FLODL_MPI_START_TIMEOUT``.
    """
    import mpi4py

    if "mpi4py.MPI" not in sys.modules or not _initialized():
        library = mpi_library()
        refusal = foreign_launcher(launch_env(), library)
        if refusal:
            raise InputError(f"flodl-mpi: error: {refusal}")
        mixed = mixed_install()
        if mixed:
            print(f"flodl-mpi: warning: {mixed}", file=sys.stderr)
        if "mpi4py.MPI" not in sys.modules:
            # Under srun, MPICH shared memory a dead earlier step left under this step's
            # name would make MPI_Init fail: the CLI's clean-up (flodl_mpi.runtime.stale_shm).
            from flodl_mpi.runtime.stale_shm import clear_before_mpi

            clear_before_mpi(library)
        mpi4py.rc.thread_level = "multiple"
    env = launch_env()
    bound = _StartBound(start_timeout(), env.rank) if env.launcher is not None and env.size > 1 else None
    try:
        from mpi4py import MPI

        if not MPI.Is_initialized():  # mpi4py.rc.initialize was False
            MPI.Init_thread(MPI.THREAD_MULTIPLE)
    finally:
        if bound is not None:
            bound.done()
    refusal = check_world_size(MPI.COMM_WORLD.size, mpi_library())
    if refusal:
        raise InputError(f"flodl-mpi: error: {refusal}")
    return MPI


def _initialized() -> bool:
    from mpi4py import MPI

    return MPI.Is_initialized()


@dataclass
class Session:
    """One rank's place in the job and its stall watchdog, for the Python API.

    Attributes:
        world: :class:`flodl_mpi.runtime.world.World` (rank, size, local rank, thread level).
        watchdog: the started :class:`flodl_mpi.runtime.world.Watchdog`.
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
        with _lock:
            if self.closed:
                return
            self.closed = True
            if self in _open:
                _open.remove(self)
            last = not _open
        self.watchdog.close()
        if last:
            _release_stop(self.stop)


#: The stop request of the open sessions, and the handlers it replaced.
_stop = None
_previous: dict = {}
#: The script's stop-signal handlers before ``import flodl_mpi`` set `_stop_before_run` (under a launcher).
_original: dict = {}


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


def _install_stop_before_run() -> None:
    """Under a launcher, from the import until the first run opens: stop signals end the job with status 4."""
    import signal

    from flodl_mpi.runtime.signals import StopRequest

    if threading.current_thread() is not threading.main_thread():
        return
    for sig in StopRequest.SIGNALS:
        current = signal.getsignal(sig)
        if current is not _stop_before_run:
            _original[sig] = current
        signal.signal(sig, _stop_before_run)


def _stop_request():
    """The process's stop request (SIGUSR1, SIGTERM, SIGINT set a flag the rounds carry), installed.

    As the CLI's (:mod:`flodl_mpi.runtime.signals`): installed before MPI starts and
    again after it (MPI may set handlers of its own); only from the main thread.
    """
    global _stop
    import signal

    from flodl_mpi.runtime.signals import StopRequest

    if threading.current_thread() is not threading.main_thread():
        return _stop or StopRequest("resume=True")
    if _stop is None:
        _stop = StopRequest("resume=True")
        _previous.clear()
        # the script's own handlers come back after the last run (not the import's `_stop_before_run`)
        _previous.update({sig: _original.get(sig) if signal.getsignal(sig) is _stop_before_run
                          else signal.getsignal(sig) for sig in StopRequest.SIGNALS})
    _stop.install()
    return _stop


def _release_stop(stop) -> None:
    """After the last run: a stop ignores later signals (status 4 is decided), else the old handlers return."""
    global _stop
    import signal

    if stop is None or stop is not _stop or threading.current_thread() is not threading.main_thread():
        return
    _stop = None
    if stop.requested:
        stop.close()
        return
    for sig, handler in _previous.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def open_session(comm=None, stall_timeout: float = 600.0) -> Session:
    """Start MPI if needed and describe this rank; start a stall watchdog.

    Collective over ``comm`` (default ``MPI.COMM_WORLD``): every rank calls it.

    Args:
        comm: an ``mpi4py`` intracommunicator of the ranks that train together,
            or None for the world (a world of 1 under plain ``python``).
        stall_timeout: seconds, > 0: no progress on any rank for this long ends
            the job with exit status 3 (:class:`flodl_mpi.runtime.world.Watchdog`).

    Raises:
        InputError: another MPI's launcher, or a world of 1 where the launcher started more.
        ValueError: ``stall_timeout`` not > 0.
    """
    if not (isinstance(stall_timeout, (int, float)) and stall_timeout > 0):
        raise ValueError(f"stall_timeout must be a number of seconds > 0, got {stall_timeout!r}")
    stop = _stop_request()  # before MPI starts: a signal during a slow start-up is kept
    MPI = _start_mpi()
    stop.install()  # again: the MPI library may have set handlers of its own while starting
    from flodl_mpi.runtime.world import Watchdog, start_world

    world = start_world(MPI.COMM_WORLD if comm is None else comm)
    _install_hooks(MPI.COMM_WORLD.rank)
    watchdog = Watchdog(world.comm, stall_timeout=float(stall_timeout), thread_level=world.thread_level)
    watchdog.start()
    session = Session(world, watchdog, stop)
    with _lock:
        _open.append(session)
    return session


def _install_hooks(rank: int) -> None:
    """Once per process: uncaught exceptions abort the world (:mod:`flodl_mpi.runtime.world`), a
    :class:`CohortError` ends every rank alike (:func:`_cohort_hook`)."""
    global _hooks_installed
    if _hooks_installed:
        return
    from flodl_mpi.runtime.world import install_excepthooks

    install_excepthooks(rank)
    sys.excepthook = _cohort_hook(sys.excepthook, rank)
    _hooks_installed = True


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
    if "mpi4py.MPI" in sys.modules and _initialized():
        return
    _install_stop_before_run()  # before MPI starts: a signal during a slow start-up is kept, then exits 4
    try:
        MPI = _start_mpi()
    except InputError as exc:
        if env.rank == 0:
            print(exc, file=sys.stderr, flush=True)
        raise SystemExit(EXIT_INPUT) from None
    _install_stop_before_run()  # again: the MPI library may have set handlers of its own while starting
    _install_hooks(MPI.COMM_WORLD.rank)


def _cohort_hook(plain, rank: int):
    """An uncaught :class:`CohortError` (raised on every rank alike) ends the script as the CLI does:
    one line from rank 0, exit status ``exc.exit_code`` (2 for bad input) on every rank, no
    abort and no traceback. Anything else goes to ``plain`` (world's hook: print, abort, 1)."""

    def hook(exc_type, exc, tb) -> None:
        if not issubclass(exc_type, CohortError):
            plain(exc_type, exc, tb)
            return
        if rank == 0:
            print(f"flodl-mpi: error: {exc}", file=sys.stderr, flush=True)
        _close_open_sessions()
        from mpi4py import MPI

        sys.stdout.flush()
        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Finalize()  # every rank raised the same error at the same point: they leave together
        os._exit(exc.exit_code)

    return hook


@atexit.register
def _close_open_sessions() -> None:
    """A script that never closed its averager: end the heartbeats before MPI finalizes."""
    for session in _open:
        session.close()


def _choices() -> dict[str, tuple[str, ...]]:
    """The options whose value is one of a few words, by config name."""
    from flodl_mpi import config as c
    from flodl_mpi.policy.registry import names as policy_names

    return {"policy": policy_names(), "optimizer": c.OPTIMIZERS, "device": c.DEVICES, "on_non_finite": c.ON_NON_FINITE,
            "outer": c.OUTERS, "node_reduce": c.NODE_REDUCES, "hierarchical": c.HIERARCHICAL,
            "average_optimizer_state": c.AVERAGE_OPTIMIZER_STATE, "async_adopt": c.ASYNC_ADOPTS,
            "resume": (c.RESUME_AUTO,)}  # --resume auto: resume='auto' (a plain --resume: resume=True)


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
    text = re.sub(r"(?<![\w-])--([a-z][a-z0-9-]*)(?:( (?=['\"\d(]))| ([a-z][a-z0-9-]*\b))?", _api_word, str(exc))
    new = type(exc)(text)
    new.__cause__, new.__traceback__ = exc.__cause__, exc.__traceback__
    return new


def leave_on_error(session: Session, exc: BaseException) -> None:
    """The one decision on an error in the Python API (STYLE 14): leave together or abort.

    A :class:`CohortError` was raised on every rank at the same point: the ranks
    close their watchdogs together and the error propagates (rank 0's line is the
    message). A world of 1 has no peers to hang: the error propagates. Anything
    else on a rank of a larger world aborts the whole job now (exit status 1)
    with the rank and the error printed, never a hang.
    """
    from flodl_mpi.runtime.world import abort

    if isinstance(exc, CohortError) or session.world.size == 1:
        session.watchdog.expect_exit()
        session.close()
        return
    import traceback

    print(f"flodl-mpi: rank {session.world.rank}: error: {type(exc).__name__}: {exc}; aborting the job",
          file=sys.stderr)
    traceback.print_exception(type(exc), exc, exc.__traceback__)
    abort(EXIT_ERROR)
