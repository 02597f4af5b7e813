"""Shared test helpers: starting ``flodl-mpi`` under ``mpiexec`` as a user would, under either MPI.

One helper knows what each launcher needs (:func:`launch_command`, :func:`launch_env`):
Open MPI's ``mpiexec`` refuses more ranks than cores without ``--oversubscribe``
and refuses root without its two ``OMPI_ALLOW_RUN_AS_ROOT*`` variables; MPICH's
Hydra needs neither. Every child launcher starts from a clean environment: no
``PMI_*`` / ``PMIX_*`` / ``OMPI_*`` left over from a launcher that started this
process (``tests/run.sh`` runs pytest itself under ``mpiexec``).

The serial pytest process never initialises MPI: importing ``mpi4py.MPI`` there
only loads the library (``mpi4py.rc.initialize = False``, set in
:func:`pytest_configure`); the tests that need MPI are marked ``mpi`` and run
under ``mpiexec ... --with-mpi``, where importing it starts MPI as usual.

Which tests start processes, and how many launchers a session started: ``tests/_launches.py``
(registered by :func:`pytest_sessionstart`; the ``launch`` and ``quick`` markers).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import mpi4py
import pytest

from tests import _launches


#: This process runs the multi-rank tests (``--with-mpi``, set by :func:`pytest_configure`).
_WITH_MPI = False


def pytest_configure(config):
    """A serial run (no ``--with-mpi``): importing ``mpi4py.MPI`` loads the library but must not start MPI; and
    torch computes on one thread in this process (:func:`one_torch_thread`)."""
    global _WITH_MPI
    _WITH_MPI = bool(config.getoption("--with-mpi", default=False))
    if not _WITH_MPI and "mpi4py.MPI" not in sys.modules:
        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
    if not _WITH_MPI:
        one_torch_thread()


def one_torch_thread() -> None:
    """torch's intra-op work on this process's thread alone (``torch.set_num_threads(1)``), for the serial pytest
    process and each child forked from it (:func:`_forked`, the ``in_fork`` tests).

    Why: torch's CPU build runs its intra-op work on GNU OpenMP's thread pool, which does not survive a fork:
    a child whose parent has run a parallel region hangs in its first one (seen in the serial stage,
    2026-12-02: forked runs stuck in ``batch_norm`` and ``Linear.forward``). With one thread no pool is
    made in the parent, and a child asked for one thread enters none. A forked run therefore trains on one
    thread; a test of more threads launches its ranks (``run_flodl``). It also keeps each of the two xdist
    workers to about one core on this 2-core machine, as each rank of a 2-rank launch has.
    """
    import torch

    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Under ``--with-mpi``, a multi-rank test that runs past its timeout (setup.cfg: 600 s) ends its rank.

    pytest-timeout's default method (SIGALRM) raises in Python code only, and a rank waiting in an
    MPI collective is in C: it would wait on. The thread method dumps the stacks and exits the
    process (``os._exit(1)``), and the launcher then ends every rank. A test's own timeout marker
    is kept.
    """
    if not _WITH_MPI:
        return
    for item in items:
        if item.get_closest_marker("mpi") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(method="thread"))


def pytest_runtest_logreport(report):
    """Under ``--with-mpi`` on 2+ ranks, a test that fails (or errs) on this rank ends every rank: MPI_Abort.

    Why: the other ranks may be waiting for this one in a collective of the same test (an
    ``allgather``, the in-place reduce's shared-memory gather) that this rank will never enter.
    It would go on to the next test, whose first collective waits for them: a hang. ``python -m
    mpi4py`` aborts the world only when a rank's pytest *exits* non-zero (``-x``, or the end of
    the session), which then never comes. So this rank writes its report here, to stderr (a
    first line naming the rank and the test, then pytest's traceback and captured output;
    ``tests/run.sh`` shows every rank's), and aborts. A multi-rank run therefore stops at its
    first failing test, as with ``-x``. An expected failure (xfail) is not a failure here.
    """
    if not (_WITH_MPI and report.failed):
        return
    from mpi4py import MPI

    if not MPI.Is_initialized() or MPI.Is_finalized() or MPI.COMM_WORLD.size < 2:
        return
    world = MPI.COMM_WORLD
    sys.stdout.flush()
    text = [f"\n== rank {world.rank} of {world.size}: {report.nodeid} failed ({report.when}); aborting every rank "
            "(the others may be waiting for this one in a collective)\n", report.longreprtext, "\n"]
    for title, content in report.sections:
        text += [f"-- {title} --\n", content, "\n"]
    sys.stderr.write("".join(text))
    sys.stderr.flush()
    # Written is not yet shown: the launcher's proxy forwards the rank's pipe, and an abort that comes at
    # once can end the job before it did (MPICH's Hydra: once in a CI run, the report was lost). A moment
    # for it to pass the lines on; a failing run only.
    time.sleep(0.5)
    world.Abort(1)

MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")

#: Variables a launcher sets in the processes it starts; a child launcher must not inherit them.
LAUNCHER_VARS_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "HYDI_", "HYDRA_", "PRTE_", "OPAL_", "MPI_LOCAL", "SLURM_")


@functools.cache
def launcher_kind(mpiexec: str | None = None) -> str:
    """``"openmpi"`` or ``"hydra"`` (MPICH), from ``mpiexec --version``."""
    out = subprocess.run([mpiexec or MPIEXEC, "--version"], capture_output=True, text=True, timeout=60, check=False,
                         env=launch_env(kind="unknown")).stdout
    return "openmpi" if "open mpi" in out.lower() or "open-mpi" in out.lower() else "hydra"


def launch_env(extra: dict | None = None, kind: str | None = None) -> dict:
    """A clean environment for a child launcher: this one's, less any launcher's leftovers, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARS_PREFIXES)}
    kind = kind or launcher_kind()
    if kind == "openmpi" and os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.update(extra or {})
    return env


def launch_argv(n: int, *argv: str) -> list[str]:
    """``mpiexec [what this launcher needs] -n N ARGV``."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    _launches.LAUNCHES.record(n)
    flags = ["--oversubscribe"] if launcher_kind() == "openmpi" else []
    return [MPIEXEC, *flags, "-n", str(n), *argv]


#: ``flodl-mpi`` with test hooks (fault injection and the like): tests/hooked_flodl.py.
HOOKED = str(Path(__file__).parent / "hooked_flodl.py")


def launch_command(n: int, *args: str, hooks: tuple[str, ...] = ()) -> list[str]:
    """``mpiexec [what this launcher needs] -n N python -m flodl_mpi ARGS``; with ``hooks``
    (tests/hooked_flodl.py's options, e.g. ``("--fault", "bridge@1:3")``), through that wrapper."""
    if hooks:
        return launch_argv(n, sys.executable, HOOKED, *hooks, "--", *args)
    return launch_argv(n, sys.executable, "-m", "flodl_mpi", *args)


def run_flodl(n: int, *args: str, timeout: float = 240.0, env: dict | None = None,
              hooks: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run ``flodl-mpi ARGS`` on N ranks with a hard timeout; returns the finished process (``hooks``:
    as :func:`launch_command`)."""
    return subprocess.run(launch_command(n, *args, hooks=hooks), capture_output=True, text=True, timeout=timeout,
                          check=False, env=launch_env(env))


def mpi_started_here() -> bool:
    """Whether MPI was started in this process (importing ``mpi4py.MPI`` alone does not start it here)."""
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and mpi.Is_initialized()


@pytest.fixture(autouse=True)
def _serial_process_never_starts_mpi(request):
    """In the serial stage, a test that starts MPI in the pytest process fails (at its teardown) unless it is
    marked ``in_fork`` (:func:`pytest_pyfunc_call` runs it in a forked child): MPI once started here would stay
    for every later test of the process, and the forked runs (:func:`fork_flodl`, :func:`fork_python`) of
    later tests would inherit it (its network library's threads and descriptors: a child that starts MPI
    again hangs or crashes; seen in the serial stage, 2026-12-02)."""
    started_before = mpi_started_here()
    yield
    if not _WITH_MPI and not started_before and mpi_started_here():
        pytest.fail("this test started MPI in the serial pytest process: mark it @pytest.mark.in_fork",
                    pytrace=False)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A test marked ``in_fork`` (serial stage) runs its body in a forked child of this process, its fixtures made
    here; a failure there fails it here with the child's traceback; past the test's timeout (pytest-timeout's,
    else 600 s) the child is killed. The child's output goes to this test's captured output."""
    if _WITH_MPI or pyfuncitem.get_closest_marker("in_fork") is None:
        return None
    import signal
    import time
    import traceback

    marker = pyfuncitem.get_closest_marker("timeout")
    timeout = float(marker.args[0]) if marker and marker.args else 600.0
    body = pyfuncitem.obj
    funcargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    read, write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: the test's body, then out without returning into pytest
        os.close(read)
        report = b""
        try:
            one_torch_thread()
            body(**funcargs)
        except BaseException:
            report = ("".join(traceback.format_exc())).encode() or b"failed"
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os.write(write, report or b"\0")
            os._exit(0)
    os.close(write)
    chunks, end, status = [], time.monotonic() + timeout, None
    os.set_blocking(read, False)
    try:
        while True:
            with contextlib.suppress(BlockingIOError):
                chunk = os.read(read, 65536)
                if not chunk:
                    break
                chunks.append(chunk)
                continue
            if time.monotonic() > end:
                pytest.fail(f"the forked test ran past {timeout:.0f} s: killed", pytrace=False)
            time.sleep(0.02)
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(read)
        if status is None:  # past its time, or pytest-timeout's alarm here: the child goes too
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    report = b"".join(chunks)
    if report != b"\0":
        pytest.fail(report.decode(errors="replace") if report else
                    f"the forked test's child ended with {os.waitstatus_to_exitcode(status)} before reporting",
                    pytrace=False)
    return True


def _warm_torch() -> None:
    """Import what every rank imports before its first step (torch, and the ``torch._dynamo`` that the first
    optimizer's construction imports: together about 4.5 CPU seconds a process on this machine), once per
    pytest process, so that a forked child (:func:`fork_flodl`, :func:`fork_python`) starts with them loaded."""
    import torch

    import flodl_mpi.training.run  # noqa: F401  (the CLI's training path, torch included)

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # imports torch._dynamo


#: The warning filters pytest puts before a test's own (setup.cfg's ``filterwarnings = error`` and its
#: deprecation defaults): a forked child removes them.
_PYTEST_WARNING_FILTERS = (("error", None, Warning, None, 0), ("always", None, DeprecationWarning, None, 0),
                           ("always", None, PendingDeprecationWarning, None, 0))


def _forked(label: list[str], child, timeout: float, env: dict | None) -> subprocess.CompletedProcess:
    """Run ``child()`` (returns an exit status) in a forked child of this process; the finished process.

    The child gets ``launch_env(env)`` as its environment, with ``OMP_NUM_THREADS=1`` unless ``env`` sets
    it (one torch thread, as each rank of a 2-rank run has on this 2-core machine), stdin from /dev/null,
    stdout and stderr to files read back as text, the default handlers of the stop signals, SIGPIPE ignored,
    no logging handlers and Python's default warning filters (a fresh interpreter's, whatever in-process tests
    and pytest's ``filterwarnings = error`` set), one torch thread, and leaves with
    ``os._exit`` after finalizing MPI if it started it (as a script's exit does, through mpi4py's atexit):
    nothing of pytest runs in it. It leads a process group of its own; past ``timeout`` that group is
    killed and ``subprocess.TimeoutExpired`` raised (with what the child printed).
    """
    import contextlib
    import importlib
    import signal
    import tempfile
    import time

    if mpi_started_here():
        raise RuntimeError("MPI runs in this pytest process (a test started it in-process): a forked child "
                           "cannot start its own; mark that test @pytest.mark.forked")
    _warm_torch()
    _launches.LAUNCHES.record(1)
    environ = launch_env({"OMP_NUM_THREADS": "1", **(env or {})})
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 1
            try:
                os.setpgid(0, 0)  # its own process group: a timeout kills what it started too
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGALRM):
                    signal.signal(sig, signal.SIG_DFL)
                os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                sys.stdin = open(0, closefd=False)
                sys.stdout = open(1, "w", closefd=False)
                sys.stderr = open(2, "w", closefd=False)
                os.environ.clear()
                os.environ.update(environ)
                # pytest's capture (inherited) is not this process's: an abort here must not hand the streams
                # back to pytest's terminal (flodl_mpi.runtime.pytest_capture finds it through this module)
                sys.modules.pop("_pytest.capture", None)
                # a fresh interpreter's state, whatever in-process tests left here: Python ignores SIGPIPE at
                # start-up; no logging handler on the root (pytest's) or on flodl_mpi's logger
                signal.signal(signal.SIGPIPE, signal.SIG_IGN)
                one_torch_thread()
                import logging
                import warnings

                # warnings as a fresh interpreter has them, not as pytest's check of the running test: printed (not
                # recorded: reloading the module restores its printing), and without pytest's filters ("error")
                importlib.reload(warnings)
                warnings.filters[:] = [f for f in warnings.filters if f not in _PYTEST_WARNING_FILTERS]

                for name, level in (("", logging.WARNING), ("flodl_mpi", logging.NOTSET)):
                    logger = logging.getLogger(name)
                    logger.handlers.clear()
                    logger.setLevel(level)
                    logger.propagate = True
                code = child()
                from mpi4py import MPI

                if MPI.Is_initialized() and not MPI.Is_finalized():
                    MPI.Finalize()
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                if not isinstance(exc.code, (int, type(None))):
                    print(exc.code, file=sys.stderr)
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        end = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > end:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                out.seek(0)
                err.seek(0)
                raise subprocess.TimeoutExpired(label, timeout, out.read(), err.read())
            time.sleep(0.02)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(label, os.waitstatus_to_exitcode(status),
                                           out.read().decode(errors="replace"), err.read().decode(errors="replace"))


def fork_flodl(*args: str, timeout: float = 240.0, env: dict | None = None,
               hooks: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``flodl-mpi ARGS`` at a world of 1, in a forked child of this pytest process; the finished process.

    What it runs is the entry point itself (:func:`flodl_mpi.cli.main.main` with ARGS, as the ``flodl-mpi``
    script calls it; the child starts MPI as a singleton, as ``flodl-mpi train`` without a launcher does);
    ``hooks``: tests/hooked_flodl.py's options, installed in the child; the child's environment and streams:
    :func:`_forked` (one torch thread: :func:`one_torch_thread`). What it saves is the start-up: the child has torch loaded already, where a launcher's
    rank imports it first; a 1-epoch digits run costs about 0.6 CPU seconds, where ``run_flodl(1, ...)``
    costs about 5 more (measured here, 2026-12-02).

    For a test whose point needs no peer: a refusal's line and exit code, what a run writes, a resume. What
    depends on several ranks, on the launcher or on the rank being its own process (signals sent to it by
    pid, DataLoader workers that re-import ``__main__``) keeps :func:`run_flodl`. Hooks registered in this
    process (the ``run_hook`` / ``inject_fault`` fixtures) are the child's too.
    """
    def child() -> int:
        from flodl_mpi.cli.main import main
        from tests.hooked_flodl import install_hooks

        rest, at_exit = install_hooks([*hooks, "--", *args]) if hooks else (list(args), [])
        code = main(rest)
        for fn in at_exit:
            fn()
        return code

    return _forked(["fork_flodl", *args], child, timeout, env)


def fork_python(script: str | os.PathLike, *argv: str, timeout: float = 240.0, env: dict | None = None,
                cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGV`` at a world of 1, in a forked child of this pytest process; the finished process.

    The script runs as ``__main__`` (:func:`runpy.run_path`, ``sys.argv = [SCRIPT, *ARGV]``, its folder first
    on ``sys.path``, in ``cwd`` if given), as ``python SCRIPT`` runs it, but with torch and flodl_mpi loaded already: ``import
    flodl_mpi`` in it finds the package imported (its ``_start_if_launched`` ran in this process, where no
    launcher started it) and ``fit`` / ``Averager`` start MPI as a singleton, as under plain ``python``.
    An uncaught exception goes to ``sys.excepthook`` (flodl_mpi's, where it installed one: a refusal is one
    line and exit 2), then status 1, as the interpreter does.
    The child's environment and streams: :func:`_forked`. For the tests of ``fit`` and ``Averager`` whose
    point needs no peer (see :func:`fork_flodl`); a script that needs its own ``__main__`` re-imported (a
    DataLoader with spawned workers) keeps ``subprocess``.
    """
    import runpy

    path = Path(script).resolve()

    def child() -> int:
        if cwd is not None:
            os.chdir(cwd)
        sys.argv = [str(script), *argv]
        sys.path.insert(0, str(path.parent))
        try:
            runpy.run_path(str(path), run_name="__main__")
        except SystemExit:
            raise
        except BaseException:  # uncaught: the interpreter's way, through sys.excepthook (flodl_mpi's, once installed)
            sys.excepthook(*sys.exc_info())
            return 1
        return 0

    return _forked(["fork_python", str(script), *argv], child, timeout, env)


def start_flodl(n: int, *args: str, env: dict | None = None, hooks: tuple[str, ...] = ()) -> subprocess.Popen:
    """Start ``flodl-mpi ARGS`` on N ranks in the background (stdout and stderr piped, text)."""
    return subprocess.Popen(launch_command(n, *args, hooks=hooks), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=launch_env(env))


@pytest.fixture
def run_hook():
    """Register callables on the product's hook points (:mod:`flodl_mpi.runtime.hooks`) for one test:
    ``run_hook(point, fn)``; every one is removed after the test."""
    from flodl_mpi.runtime import hooks

    removers = []
    yield lambda point, fn: removers.append(hooks.register(point, fn))
    for remove in removers:
        remove()


@pytest.fixture
def inject_fault():
    """Inject a fault (``KIND@RANK:ROUND``, tests/faults.py) in this process for one test: ``inject_fault(spec)``;
    removed after the test."""
    from tests.faults import install, parse_fault

    removers = []
    yield lambda spec: removers.append(install(parse_fault(spec)))
    for remove in removers:
        remove()


def rank_pids(launcher: subprocess.Popen, marker: str) -> list[int]:
    """The pids of the ranks a launcher started, found by a string unique to their command line."""
    out = subprocess.run(["pgrep", "-f", "--", marker], capture_output=True, text=True, check=False).stdout.split()
    return [int(p) for p in out if int(p) != launcher.pid and "mpiexec" not in _cmdline(int(p))
            and "prterun" not in _cmdline(int(p))]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def flip_data_byte(path, group: str, name: str) -> None:
    """Flip one byte inside a checkpoint dataset's stored data (not its header), so its
    Fletcher-32 checksum fails; ``name`` is the state-dict name (escaped as stored)."""
    import h5py

    from flodl_mpi.outputs.checkpoint import escape_name

    with h5py.File(path, "r") as f:
        ds = f[group][escape_name(name)]
        offset = ds.id.get_chunk_info(0).byte_offset if ds.chunks else ds.id.get_offset()
    with open(path, "r+b") as fh:
        fh.seek(offset + 5)
        byte = fh.read(1)
        fh.seek(offset + 5)
        fh.write(bytes([byte[0] ^ 0xFF]))


def pytest_sessionstart(session):
    """The ``launch`` marker and the launchers' count (``tests/_launches.py``), for every run of the suite."""
    if not session.config.pluginmanager.is_registered(_launches):
        session.config.pluginmanager.register(_launches, "flodl-launches")
