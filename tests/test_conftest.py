"""The multi-rank test run itself (``tests/conftest.py``): a test failing on one rank ends every rank promptly.

Before, a rank whose test failed went on to the next test while the other ranks waited for it
in a collective of the failed one: the run hung (seen at 5 ranks in
``tests/transport/test_node_reduce.py``). These tests start a small pytest run under
``mpiexec`` with this suite's ``conftest`` as a plugin, as ``tests/run.sh`` runs the
multi-rank stages.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import launch_argv, launch_env

REPO = Path(__file__).resolve().parents[1]

CHILD = '''
import pytest
from mpi4py import MPI

pytestmark = pytest.mark.mpi


@pytest.mark.xfail(strict=True, reason="an expected failure ends nothing")
def test_expected_failure():
    MPI.COMM_WORLD.Barrier()
    assert False


def test_one_rank_fails_while_the_others_wait_in_a_collective():
    comm = MPI.COMM_WORLD.Dup()
    if comm.rank == comm.size - 1:
        raise AssertionError("only the last rank fails, before the allgather")
    comm.allgather(comm.rank)


def test_one_rank_skips_a_collective():
    comm = MPI.COMM_WORLD.Dup()
    if comm.rank != comm.size - 1:  # the last rank passes and goes on; the others wait for it
        comm.allgather(comm.rank)


def test_the_next_test():
    MPI.COMM_WORLD.Barrier()
'''


def run_child(tmp_path, n: int, *args: str, timeout: float = 120.0) -> tuple[int, str, float]:
    """``mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi -p tests.conftest ARGS`` on :data:`CHILD`;
    returns (exit status, stdout and stderr, seconds). Fails the test if it runs past ``timeout``
    (its whole process group is then killed: no rank is left behind)."""
    (tmp_path / "test_child.py").write_text(CHILD)
    argv = launch_argv(n, sys.executable, "-m", "mpi4py", "-m", "pytest", "-q", "--with-mpi", "-m", "mpi",
                       "-p", "tests.conftest", "-p", "no:cacheprovider", "--color=no", "test_child.py", *args)
    env = launch_env({"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)})
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the {n}-rank run hung (killed after {timeout:.0f} s):\n{out}")
    return proc.returncode, out, time.monotonic() - t0


@pytest.mark.parametrize("n", [2, 3])
def test_a_test_failing_on_one_rank_aborts_every_rank(tmp_path, n):
    rc, out, _ = run_child(tmp_path, n, "-k", "not skips_a_collective")
    assert rc != 0, out
    failing = (f"== rank {n - 1} of {n}: test_child.py::test_one_rank_fails_while_the_others_wait_in_a_collective "
               "failed (call); aborting every rank")
    assert failing in out, out
    assert "AssertionError: only the last rank fails, before the allgather" in out, out
    assert "test_expected_failure failed" not in out, out


def test_a_passing_multi_rank_run_is_not_aborted(tmp_path):
    rc, out, _ = run_child(tmp_path, 2, "-k", "expected_failure or next_test")
    assert rc == 0, out
    assert re.search(r"1 passed, \d+ deselected, 1 xfailed", out) and "aborting" not in out, out


def test_a_multi_rank_test_past_its_timeout_ends_every_rank(tmp_path):
    # No rank fails: one skips a collective, so every rank waits (in MPI's C code, where
    # pytest-timeout's SIGALRM would never be seen); its thread method ends the ranks.
    rc, out, _ = run_child(tmp_path, 2, "-k", "skips_a_collective or next_test", "--timeout", "5")
    assert rc != 0, out
    assert "Timeout" in out and "test_one_rank_skips_a_collective" in out, out
