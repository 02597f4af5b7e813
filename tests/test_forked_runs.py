"""The suite's forked runs (``tests/conftest.py``: ``fork_flodl``, ``fork_python``): a world of 1 in a child of
the pytest process, which the tests whose point needs no peer use instead of a launcher (5-9 CPU seconds of
start-up less per run). What they must give is what the launched process gives: its exit status, its two
streams, its environment; and never a hang."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flodl_mpi.errors import EXIT_INPUT
from tests.conftest import fork_flodl, fork_python, run_flodl


def test_a_refusal_forked_is_the_launched_refusal(tmp_path):
    """The same one line on stderr, nothing on stdout, the same exit status as ``mpiexec -n 1 flodl-mpi``."""
    args = ("train", "--run-dir", str(tmp_path / "r"), "--data", str(tmp_path / "missing.h5"))
    forked, launched = fork_flodl(*args), run_flodl(1, *args, timeout=300)
    assert forked.returncode == launched.returncode == EXIT_INPUT
    want = f"flodl-mpi: error: --data {str(tmp_path / 'missing.h5')!r}: no such file\n"
    assert forked.stderr == launched.stderr == want
    assert forked.stdout == launched.stdout == ""
    assert not (tmp_path / "r").exists()


def test_a_forked_run_trains_and_writes_its_run_dir(tmp_path):
    proc = fork_flodl("train", "--run-dir", str(tmp_path / "r"), "--epochs", "1")
    assert proc.returncode == 0, proc.stderr
    # 1437 digits samples at batch 32 on one rank: ceil(1437 / 32) = 45 batches, a round after each
    assert "rounds 45" in proc.stdout and "torch threads: 1 per rank (OMP_NUM_THREADS=1)" in proc.stdout
    assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir()) == ["ckpt-e000001-r000045.h5"]


def test_a_forked_script_gets_its_argv_environment_streams_and_exit_status(tmp_path):
    script = tmp_path / "s.py"
    (tmp_path / "helper_mod.py").write_text("VALUE = 'from the script folder'\n")
    script.write_text("import os, sys\nimport helper_mod\n"
                      "print(sys.argv[1:], os.environ['FLODL_TEST_X'], os.environ['OMP_NUM_THREADS'], helper_mod.VALUE)\n"
                      "print('to stderr', file=sys.stderr)\nsys.exit(3)\n")
    proc = fork_python(script, "a", "b", env={"FLODL_TEST_X": "x1"})
    assert proc.returncode == 3
    assert proc.stdout == "['a', 'b'] x1 1 from the script folder\n" and proc.stderr == "to stderr\n"
    assert "FLODL_TEST_X" not in os.environ  # the child's environment was the child's


def test_an_uncaught_error_in_a_forked_script_goes_to_its_excepthook_as_under_python(tmp_path):
    """As ``python SCRIPT``: the traceback and status 1, or the script's own ``sys.excepthook`` (flodl_mpi's turns a
    refusal into one line and exit 2), whose own exit status stands."""
    plain, hooked = tmp_path / "plain.py", tmp_path / "hooked.py"
    plain.write_text("raise RuntimeError('boom in the script')\n")
    hooked.write_text("import os, sys\n"
                      "def hook(kind, exc, tb):\n    print('HOOK', kind.__name__, exc, flush=True)\n    os._exit(5)\n"
                      "sys.excepthook = hook\nraise ValueError('refused')\n")
    for script, code in ((plain, 1), (hooked, 5)):
        forked = fork_python(script)
        real = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=False)
        assert forked.returncode == real.returncode == code
        assert forked.stdout == real.stdout
    assert fork_python(plain).stderr.endswith("RuntimeError: boom in the script\n")
    assert fork_python(hooked).stdout == "HOOK ValueError refused\n"


def test_a_forked_child_past_its_timeout_is_killed_with_what_it_started(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import subprocess, sys, time\n"
                      "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                      f"open({str(tmp_path / 'pid')!r}, 'w').write(str(p.pid))\n"
                      "print('started', flush=True)\ntime.sleep(60)\n")
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as err:
        fork_python(script, timeout=3)
    assert time.monotonic() - t0 < 20
    assert b"started" in err.value.output
    grandchild = int((tmp_path / "pid").read_text())
    for _ in range(100):  # killed with the group; reaped by init
        try:
            if Path(f"/proc/{grandchild}/stat").read_text().split()[2] == "Z":
                break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the child's own child {grandchild} outlived the timeout")


def test_a_forked_child_starts_from_a_fresh_interpreters_logging_and_sigpipe(tmp_path, monkeypatch):
    """What an in-process test left in this process (a handler on flodl_mpi's logger, SIGPIPE's default action)
    is not the child's: its run logs to its own stdout."""
    import io
    import logging
    import signal

    stale = logging.StreamHandler(io.StringIO())
    logging.getLogger("flodl_mpi").addHandler(stale)
    previous = signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        script = tmp_path / "s.py"
        script.write_text("import logging, signal\n"
                          "print(logging.getLogger('flodl_mpi').handlers, signal.getsignal(signal.SIGPIPE))\n")
        assert fork_python(script).stdout == f"[] {int(signal.SIG_IGN)}\n"  # as a fresh python prints it
    finally:
        logging.getLogger("flodl_mpi").removeHandler(stale)
        signal.signal(signal.SIGPIPE, previous)


def test_a_forked_child_computes_after_the_parent_did_and_warns_as_python_does(tmp_path):
    """torch work in this process first (GNU OpenMP's pool does not survive a fork: a child of a parent that ran
    a parallel region hung in its first one, tests/conftest.py's one_torch_thread), then a child whose warnings
    are printed as ``python SCRIPT`` prints them (not raised by pytest's ``filterwarnings = error``)."""
    import torch

    a = torch.randn(1500, 1500)
    assert float((a @ a).abs().sum()) > 0
    script = tmp_path / "s.py"
    script.write_text("import warnings\nimport torch\n"
                      "warnings.warn('a user warning')\nwarnings.warn('deprecated here', DeprecationWarning)\n"
                      "m = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.BatchNorm1d(512))\n"
                      "a = torch.randn(1500, 1500)\n"
                      "print(tuple(m(torch.randn(256, 512)).shape), float((a @ a).abs().sum()) > 0, torch.get_num_threads())\n")
    forked = fork_python(script, timeout=120)
    real = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert forked.returncode == real.returncode == 0, forked.stderr
    assert forked.stdout == real.stdout == "(256, 512) True 1\n"
    assert forked.stderr == real.stderr and "UserWarning: a user warning" in forked.stderr
