"""The one abort decision (flodl_mpi.runtime.world.decide / fail), in one process, with a fake communicator.

The launched runs that prove it end a real job (every rank, one line, exit status)
are in tests/cli/test_cli.py (an injected error: exit 1), tests/api/test_averager.py
and tests/runtime/test_pytest_abort.py (the API's abort), tests/outputs/test_run_dir_full.py
(a plain error: one line, no traceback).
"""

import sys
import threading

import pytest

from flodl_mpi.errors import EXIT_ERROR, CohortError, InputError
from flodl_mpi.runtime import pytest_capture, world
from flodl_mpi.runtime.world import ABORT, TOGETHER, abort_line, decide, fail


class Aborted(Exception):
    """What the fake communicator's Abort raises instead of ending the process."""


class FakeComm:
    def __init__(self):
        self.aborted = []

    def Abort(self, code):  # noqa: N802 (mpi4py's name)
        self.aborted.append(code)
        raise Aborted(code)


class FakeWatchdog:
    def __init__(self):
        self.leaving = 0

    def expect_exit(self):
        self.leaving += 1


class Plain(RuntimeError):
    plain = True


@pytest.fixture(autouse=True)
def _no_capture_release(monkeypatch):
    """abort() hands pytest's capture to the real streams before MPI_Abort: not here, the test goes on."""
    monkeypatch.setattr(pytest_capture, "release", lambda rank=None: False)


@pytest.mark.parametrize("exc, size, alone_leaves, in_thread, want", [
    (CohortError("bad"), 4, False, False, TOGETHER),      # raised alike on every rank: leave together
    (InputError("bad --epochs"), 2, False, False, TOGETHER),  # InputError is a CohortError
    (CohortError("bad"), 4, False, True, ABORT),          # in a thread: never raised alike
    (ValueError("mine"), 2, False, False, ABORT),         # one rank's error: its peers would hang
    (ValueError("mine"), 1, True, False, TOGETHER),       # a world of 1 under the API: it propagates
    (ValueError("mine"), 1, False, False, ABORT),         # ... but not under the CLI or a hook
    (KeyboardInterrupt(), 2, True, False, ABORT),
])
def test_decide(exc, size, alone_leaves, in_thread, want):
    assert decide(exc, size, alone_leaves=alone_leaves, in_thread=in_thread) == want


def test_the_abort_line():
    assert abort_line(ValueError("x"), 3) == "flodl-mpi: rank 3: error: ValueError: x; aborting the job"
    assert abort_line(Plain("disk full"), 0) == "flodl-mpi: rank 0: error: disk full; aborting the job"
    assert (abort_line(KeyError("k"), 1, thread="flodl-bridge")
            == "flodl-mpi: rank 1: error in thread 'flodl-bridge': KeyError: 'k'; aborting the job")


def test_leaving_together_tells_the_watchdog_and_aborts_nothing(capsys):
    comm, watchdog = FakeComm(), FakeWatchdog()
    fail(CohortError("every rank"), 0, 2, watchdog, comm=comm)
    assert comm.aborted == [] and watchdog.leaving == 1
    assert capsys.readouterr().err == ""  # the caller says rank 0's line


def test_a_rank_local_error_prints_one_line_and_the_traceback_then_aborts_with_1(capsys):
    comm, watchdog = FakeComm(), FakeWatchdog()
    try:
        raise RuntimeError("boom")
    except RuntimeError as exc:
        with pytest.raises(Aborted):
            fail(exc, 1, 2, watchdog, comm=comm)
    assert comm.aborted == [EXIT_ERROR] and watchdog.leaving == 0
    err = capsys.readouterr().err
    assert err.splitlines()[0] == "flodl-mpi: rank 1: error: RuntimeError: boom; aborting the job"
    assert "Traceback (most recent call last)" in err and 'raise RuntimeError("boom")' in err


def test_a_plain_error_is_its_line_alone(capsys):
    comm = FakeComm()
    with pytest.raises(Aborted):
        fail(Plain("run dir r: No space left on device"), 0, 2, comm=comm)
    assert capsys.readouterr().err == "flodl-mpi: rank 0: error: run dir r: No space left on device; aborting the job\n"
    assert comm.aborted == [EXIT_ERROR]


def test_the_thread_hook_goes_through_the_decision(monkeypatch, capsys):
    """install_excepthooks: an error in a thread is an abort, named with its thread; SystemExit ends the thread only."""
    comm = FakeComm()
    monkeypatch.setattr(world.MPI, "COMM_WORLD", comm)
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    world.install_excepthooks(0, 2)
    caught = []

    def run(exc):
        try:
            raise exc
        except BaseException as raised:  # what threading does with an uncaught exception
            try:
                threading.excepthook(threading.ExceptHookArgs((type(raised), raised, raised.__traceback__,
                                                               threading.current_thread())))
            except Aborted as aborted:
                caught.append(aborted)

    for exc in (SystemExit(0), CohortError("alike")):
        t = threading.Thread(target=run, args=(exc,), name="worker-x")
        t.start()
        t.join()
    assert comm.aborted == [EXIT_ERROR] and len(caught) == 1  # SystemExit: nothing; the CohortError: an abort
    assert ("flodl-mpi: rank 0: error in thread 'worker-x': CohortError: alike; aborting the job"
            in capsys.readouterr().err)


def test_the_main_hook_leaves_together_on_a_cohort_error(monkeypatch, capsys):
    """Was session._cohort_hook: rank 0's line, the sessions closed, MPI finalized, exit status exc.exit_code."""
    comm = FakeComm()
    exits, left = [], []
    monkeypatch.setattr(world.MPI, "COMM_WORLD", comm)
    monkeypatch.setattr(world.MPI, "Is_initialized", lambda: False)
    monkeypatch.setattr(world.os, "_exit", exits.append)
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    world.install_excepthooks(0, 2, on_leave=lambda: left.append(True))
    sys.excepthook(InputError, InputError("--epochs 0: must be an integer >= 1"), None)
    assert exits == [2] and left == [True] and comm.aborted == []
    assert capsys.readouterr().err == "flodl-mpi: error: --epochs 0: must be an integer >= 1\n"
    with pytest.raises(Aborted):
        sys.excepthook(ValueError, ValueError("one rank"), None)
    assert comm.aborted == [EXIT_ERROR]
