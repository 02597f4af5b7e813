"""The MPI world for code that imports flodl_mpi: started on first use, a world of 1 without a launcher.

Invariant: whatever starts the script (``python script.py``, ``mpiexec -n N
python script.py``, ``srun``), the same code runs; without a launcher MPI starts
as a singleton (a world of 1) and averaging is the identity. The checks the CLI
makes before and after MPI starts (another MPI's launcher, a world of 1 where
the launcher started more) are made here too, and an uncaught exception on any
rank, in any thread, aborts the whole job (:func:`flodl_mpi.world.install_excepthooks`)
instead of leaving the other ranks waiting in a round.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from dataclasses import dataclass

from flodl_mpi.errors import EXIT_ERROR, CohortError, InputError
from flodl_mpi.launcher import check_world_size, foreign_launcher, launch_env, mixed_install, mpi_library

__all__ = ["Session", "leave_on_error", "open_session"]

_hooks_installed = False
_open: list[Session] = []
_lock = threading.Lock()


def _start_mpi():
    """Start MPI (THREAD_MULTIPLE) unless it runs already; refuse another MPI's launcher first.

    Raises:
        InputError: started by the launcher of another MPI, or a world of 1 where
            the launcher started more ranks (one line, as the CLI's refusal).
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
            # name would make MPI_Init fail: the CLI's clean-up (flodl_mpi.stale_shm).
            from flodl_mpi.stale_shm import clear_before_mpi

            clear_before_mpi(library)
        mpi4py.rc.thread_level = "multiple"
    from mpi4py import MPI

    if not MPI.Is_initialized():  # mpi4py.rc.initialize was False
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
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
        world: :class:`flodl_mpi.world.World` (rank, size, local rank, thread level).
        watchdog: the started :class:`flodl_mpi.world.Watchdog`.
    """

    world: object
    watchdog: object
    closed: bool = False

    def close(self) -> None:
        """End the watchdog's heartbeat. Collective: every rank calls it (idempotent)."""
        with _lock:
            if self.closed:
                return
            self.closed = True
            if self in _open:
                _open.remove(self)
        self.watchdog.close()


def open_session(comm=None, stall_timeout: float = 600.0) -> Session:
    """Start MPI if needed and describe this rank; start a stall watchdog.

    Collective over ``comm`` (default ``MPI.COMM_WORLD``): every rank calls it.

    Args:
        comm: an ``mpi4py`` intracommunicator of the ranks that train together,
            or None for the world (a world of 1 under plain ``python``).
        stall_timeout: seconds, > 0: no progress on any rank for this long ends
            the job with exit status 3 (:class:`flodl_mpi.world.Watchdog`).

    Raises:
        InputError: another MPI's launcher, or a world of 1 where the launcher started more.
        ValueError: ``stall_timeout`` not > 0.
    """
    global _hooks_installed
    if not (isinstance(stall_timeout, (int, float)) and stall_timeout > 0):
        raise ValueError(f"stall_timeout must be a number of seconds > 0, got {stall_timeout!r}")
    MPI = _start_mpi()
    from flodl_mpi.world import Watchdog, install_excepthooks, start_world

    world = start_world(MPI.COMM_WORLD if comm is None else comm)
    if not _hooks_installed:
        install_excepthooks(MPI.COMM_WORLD.rank)
        sys.excepthook = _cohort_hook(sys.excepthook, MPI.COMM_WORLD.rank)
        _hooks_installed = True
    watchdog = Watchdog(world.comm, stall_timeout=float(stall_timeout), thread_level=world.thread_level)
    watchdog.start()
    session = Session(world, watchdog)
    with _lock:
        _open.append(session)
    return session


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


def leave_on_error(session: Session, exc: BaseException) -> None:
    """The one decision on an error in the Python API (STYLE 14): leave together or abort.

    A :class:`CohortError` was raised on every rank at the same point: the ranks
    close their watchdogs together and the error propagates (rank 0's line is the
    message). A world of 1 has no peers to hang: the error propagates. Anything
    else on a rank of a larger world aborts the whole job now (exit status 1)
    with the rank and the error printed, never a hang.
    """
    from flodl_mpi.world import abort

    if isinstance(exc, CohortError) or session.world.size == 1:
        session.watchdog.expect_exit()
        session.close()
        return
    import traceback

    print(f"flodl-mpi: rank {session.world.rank}: error: {type(exc).__name__}: {exc}; aborting the job",
          file=sys.stderr)
    traceback.print_exception(type(exc), exc, exc.__traceback__)
    abort(EXIT_ERROR)
