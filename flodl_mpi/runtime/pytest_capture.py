"""An aborting rank's last words reach the terminal when it runs under pytest.

When a rank fails inside a test (an exception in an ``Averager`` block, a stall the
watchdog catches), flodl_mpi prints the error and ends the whole job with
``MPI_Abort`` (:func:`flodl_mpi.runtime.world.abort`): never a hang. Under pytest that text
goes into pytest's capture of the running test, and ``MPI_Abort`` ends the process
before pytest reports it: the job ends with exit status 1 and nothing to read. So,
before aborting, :func:`release` stops pytest's capture and writes what the test
wrote so far (the error and its traceback included) to the real stdout and stderr,
under one line naming the rank and the test (``PYTEST_CURRENT_TEST``).

pytest keeps no global handle on its capture: the running ``CaptureManager`` is
found among the live objects (``gc.get_objects``), only on this way out and only
when pytest is loaded. Nothing here is registered with pytest or changes a test
session that does not abort.
"""

from __future__ import annotations

import gc
import os
import sys

__all__ = ["release"]


def _capture_manager():
    capture = sys.modules.get("_pytest.capture")
    if capture is None:
        return None
    kind = getattr(capture, "CaptureManager", None)
    if kind is None:
        return None
    return next((obj for obj in gc.get_objects() if isinstance(obj, kind)), None)


def release(rank: int | None = None) -> bool:
    """Stop pytest's capture and write what the running test wrote to the real streams.

    Args:
        rank: the aborting rank, for the heading line (None: not named).

    Returns: True if pytest was capturing and its text was written out, else False
    (not under pytest, or run with ``-s`` / ``--capture=no``). Never raises: it runs
    on the way to ``MPI_Abort``.
    """
    try:
        capman = _capture_manager()
        if capman is None or not capman.is_globally_capturing():
            return False
        # A test's capsys/capfd fixture holds the text written while it was active.
        fixture = getattr(capman, "_capture_fixture", None)
        fixture_out, fixture_err = ("", "")
        if fixture is not None:
            fixture_out, fixture_err = fixture.readouterr()
        capman.suspend(in_=True)
        out, err = capman.read_global_capture()
    except Exception:  # a pytest whose capture works otherwise: nothing more can be done on the way out
        return False
    test = os.environ.get("PYTEST_CURRENT_TEST", "(between tests)")
    who = f"rank {rank}" if rank is not None else "this process"
    heading = f"flodl-mpi: {who} aborts the job in pytest test {test}; what the test wrote before it:\n"
    try:
        sys.stdout.write(out + fixture_out)
        sys.stdout.flush()
        sys.stderr.write(heading + err + fixture_err)  # one write: ranks share the launcher's stderr
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed or broken stream (ValueError: I/O on a closed file): the abort goes on
        return False
    return True
