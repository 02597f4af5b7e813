"""The process's state across the Python API's runs (flodl_mpi.runtime.session.SessionState), in one process.

Was six module globals of session.py; the launched runs that prove the stop signals'
exit statuses are in tests/api/test_api_faults.py (item 2) and tests/api/test_api_stop_resume.py.
"""

import signal

import pytest

from flodl_mpi.errors import CohortError
from flodl_mpi.runtime.session import Session, SessionState, _stop_before_run
from flodl_mpi.runtime.signals import StopRequest

SIGNALS = StopRequest.SIGNALS


@pytest.fixture
def handlers():
    """The script's own handlers (a distinct function per signal), put back after the test."""
    before = {sig: signal.getsignal(sig) for sig in SIGNALS}
    own = {}
    for sig in SIGNALS:
        def handler(signum, frame):  # never called
            raise AssertionError(signum)
        own[sig] = handler
        signal.signal(sig, handler)
    yield own
    for sig, handler in before.items():
        signal.signal(sig, handler)


class FakeWatchdog:
    def __init__(self):
        self.closed = 0

    def close(self):
        self.closed += 1


def test_a_run_takes_the_stop_signals_and_gives_the_scripts_back(handlers):
    state = SessionState()
    stop = state.stop_request()
    assert all(signal.getsignal(sig) == stop._handle for sig in SIGNALS)
    assert state.stop_request() is stop  # a second run open at once shares the request
    state.release_stop(stop)
    assert state.stop is None
    assert {sig: signal.getsignal(sig) for sig in SIGNALS} == handlers


def test_after_a_stop_the_signals_stay_ignored(handlers):
    state = SessionState()
    stop = state.stop_request()
    stop.requested = True  # a signal came: exit status 4 is decided
    state.release_stop(stop)
    assert all(signal.getsignal(sig) == signal.SIG_IGN for sig in SIGNALS)


def test_the_import_handler_is_not_what_comes_back(handlers):
    """``import flodl_mpi`` under a launcher set `_stop_before_run`; after the last run the script's own return."""
    state = SessionState()
    state.install_stop_before_run()
    state.install_stop_before_run()  # again after MPI started: the script's handler stays the one kept
    assert all(signal.getsignal(sig) is _stop_before_run for sig in SIGNALS)
    assert state.original == handlers
    stop = state.stop_request()
    state.release_stop(stop)
    assert {sig: signal.getsignal(sig) for sig in SIGNALS} == handlers


def test_a_foreign_stop_request_releases_nothing(handlers):
    state = SessionState()
    state.stop_request()
    state.release_stop(StopRequest("resume=True"))  # not the open one
    assert state.stop is not None and signal.getsignal(signal.SIGTERM) == state.stop._handle
    state.release_stop(state.stop)


def test_sessions_close_once_and_the_last_one_is_known():
    state = SessionState()
    a, b = Session(None, FakeWatchdog()), Session(None, FakeWatchdog())
    state.add(a)
    state.add(b)
    assert state.remove(a) == (True, False)
    assert state.remove(a) == (False, False) and a.closed
    assert state.remove(b) == (True, True) and state.open == []


@pytest.mark.parametrize("size, exc, together", [
    (2, ValueError("one rank"), False), (1, ValueError("alone"), True), (4, CohortError("x"), True)])
def test_the_api_takes_the_one_decision(size, exc, together):
    from types import SimpleNamespace

    from flodl_mpi.runtime.session import leaves_together

    assert leaves_together(Session(SimpleNamespace(size=size, rank=0), FakeWatchdog()), exc) is together
