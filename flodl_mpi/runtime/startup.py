"""The one MPI start-up: for ``flodl-mpi`` (:mod:`flodl_mpi.cli.main`) and for ``import flodl_mpi`` (:mod:`flodl_mpi.runtime.session`).

Invariant: a rank starts MPI only through :func:`start_mpi`, which refuses what
would make MPI's own start-up fail or mislead (another MPI's launcher, a bad
``FLODL_MPI_START_TIMEOUT``, a world of 1 where the launcher started more)
with one :class:`InputError`, the same words for every caller; each caller
says it its own way (the CLI: the launcher's rank 0, exit 2). The start-up is
bounded (:data:`START_TIMEOUT_VAR`), so a rank that ended before starting MPI
leaves no peer waiting in ``MPI_Init``. Importing this module imports neither
``mpi4py.MPI`` nor torch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

from flodl_mpi.errors import InputError
from flodl_mpi.runtime.launcher import check_world_size, foreign_launcher, launch_env, mixed_install, mpi_library

__all__ = ["ASYNC_FINALIZE_VAR", "DEFAULT_START_TIMEOUT_S", "START_TIMEOUT_VAR", "StartBound", "fault_tolerant_finalize",
           "mpi_running", "start_mpi", "start_timeout"]

#: Environment variable: seconds a launched rank waits in MPI's start-up for the others.
START_TIMEOUT_VAR = "FLODL_MPI_START_TIMEOUT"
#: Its default. Every rank starts MPI as it imports flodl_mpi, so the ranks arrive
#: within their imports' spread of each other; past this, a peer is taken for gone.
DEFAULT_START_TIMEOUT_S = 120.0


#: Open MPI's MCA variable (in the environment before ``MPI_Init``): ``MPI_Finalize`` skips its closing PMIx fence.
ASYNC_FINALIZE_VAR = "OMPI_MCA_async_mpi_finalize"


def fault_tolerant_finalize(environ=None) -> bool:
    """Under Open MPI's fault tolerance, let ``MPI_Finalize`` return after a peer died; call before ``MPI_Init``.

    Why: Open MPI 5.0's ``MPI_Finalize`` under ``mpiexec --with-ft ulfm`` (which sets
    ``OMPI_MCA_mpi_ft_enable=1`` in every rank) first shrinks ``MPI_COMM_WORLD`` and runs
    a synchronous ring barrier over the survivors (ULFM's own flush of past traffic),
    then a PMIx fence over every process the job started, the dead ones included. After
    a kill -9 of one of three ranks that fence sometimes never completes: the survivors
    of a finished ``--on-rank-failure shrink`` run spin in ``ompi_mpi_finalize`` forever
    (tests/elastic/shrink_then_exit.py, 4 hangs in 30 launches without this; none in 30
    with it: docs/elastic.rst). With fault tolerance on, this sets
    ``OMPI_MCA_async_mpi_finalize=1`` (Open MPI's "do not perform a barrier at the
    beginning of MPI_Finalize"): the survivors' ring barrier still runs, the fence does
    not. A value the user set is kept; without fault tolerance nothing is changed.

    Args:
        environ: the environment to read and change (default ``os.environ``).

    Returns:
        Whether the variable was set here.
    """
    env = os.environ if environ is None else environ
    if env.get("OMPI_MCA_mpi_ft_enable") != "1" or ASYNC_FINALIZE_VAR in env:
        return False
    env[ASYNC_FINALIZE_VAR] = "1"
    return True


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


class StartBound:
    """Ends this rank if MPI's start-up has not returned within the start timeout.

    Why: MPI_Init waits for every rank the launcher started, and MPICH's Hydra
    does not end the job when a rank exits *before* it started MPI (measured:
    rank 0 waits in MPI_Init forever after rank 1 raised at its first line).
    MPI_Init holds the GIL, so the bound is a small watcher process: at the
    deadline it prints one line and kills this rank (SIGKILL: nothing else ends
    a process inside MPI_Init); :meth:`done` ends the watcher.

    Args:
        timeout: seconds, > 0.
        rank: the launcher's rank of this process, for the line.
    """

    def __init__(self, timeout: float, rank: int) -> None:
        text = (f"flodl-mpi: rank {rank}: error: MPI did not start within {timeout:g} s: another rank ended "
                "before it started MPI (its error is above) or never reached `import flodl_mpi`; ending this rank "
                f"({START_TIMEOUT_VAR}=SECONDS waits longer)\n")
        self._watcher = subprocess.Popen([sys.executable, "-S", "-c", _WATCHER, str(os.getpid()), repr(timeout), text],
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)

    def done(self) -> None:
        """End the watcher (MPI started, or failed to)."""
        self._watcher.kill()
        self._watcher.wait()


def mpi_running() -> bool:
    """MPI is initialized in this process already (``python -m mpi4py``, or the script started it)."""
    if "mpi4py.MPI" not in sys.modules:
        return False
    from mpi4py import MPI

    return MPI.Is_initialized()


def _warn(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def start_mpi(warn: Callable[[str], None] = _warn):
    """Start MPI (``THREAD_MULTIPLE``) unless it runs already, after the checks that need no MPI; returns ``mpi4py.MPI``.

    In order: another MPI's launcher is refused (its start-up would abort, or start N
    worlds of 1); an install that mixes two MPIs is warned about (``warn``, one line);
    ``FLODL_MPI_START_TIMEOUT`` is read; under ``srun``, MPICH shared memory a dead
    earlier step left under this step's name is removed
    (:func:`flodl_mpi.runtime.stale_shm.clear_before_mpi`); under Open MPI's fault tolerance
    ``MPI_Finalize`` is told to skip its closing fence (:func:`fault_tolerant_finalize`); MPI starts, bounded by
    :func:`start_timeout` under a launcher that started more than one rank (past it this
    rank prints one line and is killed); a world of 1 where the launcher started more is
    refused. When MPI runs already, only the world-size check is made.

    Args:
        warn: says a warning line (default: print it to stderr); the CLI passes one that
            speaks from the launcher's rank 0 only.

    Returns:
        The ``mpi4py.MPI`` module, MPI initialized.

    Raises:
        InputError: one line, ``flodl-mpi: error: ...``: another MPI's launcher, a bad
            ``FLODL_MPI_START_TIMEOUT``, or a world of 1 where the launcher started more.
    """
    library = mpi_library()
    if not mpi_running():
        refusal = foreign_launcher(launch_env(), library)
        if refusal:
            raise InputError(f"flodl-mpi: error: {refusal}")
        mixed = mixed_install()
        if mixed:
            warn(f"flodl-mpi: warning: {mixed}")
        timeout = start_timeout()
        from flodl_mpi.runtime.stale_shm import clear_before_mpi

        clear_before_mpi(library)  # only before MPI runs: a running MPI's segments are live
        fault_tolerant_finalize()  # read by MPI_Init: after a peer's death MPI_Finalize must still return
        import mpi4py

        mpi4py.rc.thread_level = "multiple"
        env = launch_env()
        bound = StartBound(timeout, env.rank) if env.launcher is not None and env.size > 1 else None
        try:
            from mpi4py import MPI  # starts MPI (mpi4py.rc.initialize), inside the bound

            if not MPI.Is_initialized():  # mpi4py.rc.initialize was False
                MPI.Init_thread(MPI.THREAD_MULTIPLE)
        finally:
            if bound is not None:
                bound.done()
    from mpi4py import MPI

    refusal = check_world_size(MPI.COMM_WORLD.size, library)
    if refusal:
        raise InputError(f"flodl-mpi: error: {refusal}")
    return MPI
