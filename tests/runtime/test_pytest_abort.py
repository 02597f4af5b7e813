"""A rank that fails inside a user's pytest-mpi test: its error reaches the terminal.

flodl_mpi aborts the job when one rank fails in an ``Averager`` block (never a hang).
Under pytest the error line went into pytest's capture and died with the process:
the session ended with exit status 1 and no error, no test name. `world.abort` now
writes what the test had written, under a line naming the rank and the test
(`flodl_mpi.runtime.pytest_capture`).
"""

import subprocess
import sys
import textwrap
import time

from tests.conftest import launch_argv, launch_env

USER_TESTS = textwrap.dedent('''
    import pytest, torch, flodl_mpi
    from torch import nn

    def train(avg, model, opt, fail_rank=None):
        for i in range(6):
            opt.zero_grad()
            loss = model(torch.ones(8, 4)).pow(2).mean()
            loss.backward()
            opt.step()
            avg.step(loss, samples=8)
            if avg.rank == fail_rank and i == 2:
                print(f"marker-printed-by-rank-{avg.rank}-before-the-failure")
                assert False, "user assertion on one rank"

    @pytest.mark.mpi(min_size=2)
    def test_a_passes():
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with flodl_mpi.Averager(model, optimizer=opt) as avg:
            train(avg, model, opt)

    @pytest.mark.mpi(min_size=2)
    def test_b_fails_on_rank_1():
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with flodl_mpi.Averager(model, optimizer=opt) as avg:
            train(avg, model, opt, fail_rank=1)
''')


def test_a_failing_rank_in_a_pytest_mpi_session_shows_its_error_and_the_test(tmp_path):
    (tmp_path / "test_user.py").write_text(USER_TESTS)
    argv = launch_argv(2, sys.executable, "-m", "mpi4py", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                       "--with-mpi", "test_user.py")
    started = time.monotonic()
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
                          env=launch_env({"PYTHONUNBUFFERED": "1"}))
    took = time.monotonic() - started
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert took < 240  # ends, never hangs (a generous bound on a loaded machine)
    # The heading, the rank's own error line (the path that aborts: session.leave_on_error), and the
    # test's own output before the failure, all of which pytest's capture held.
    assert "flodl-mpi: rank 1 aborts the job in pytest test test_user.py::test_b_fails_on_rank_1 (call)" in out, \
        out[-3000:]
    assert "flodl-mpi: rank 1: error: AssertionError: user assertion on one rank" in out, out[-3000:]
    assert "marker-printed-by-rank-1-before-the-failure" in out, out[-3000:]
