"""flodl_mpi.fit's bad input as a user meets it: one line from rank 0, exit status 2, on 1 and 2 ranks.

At 1 rank the script runs in a forked child of the pytest process (tests/conftest.py's fork_python: ``python SCRIPT``
with torch loaded, an uncaught exception to the hook flodl_mpi installs); at 2 it launches (every rank
refuses, one line in all, and the launcher's exit status)."""

import subprocess
import sys
import textwrap
import time

import pytest

from tests.conftest import launch_argv, launch_env, fork_python

pytestmark = pytest.mark.slow

BAD_STEP = textwrap.dedent("""
    import flodl_mpi
    run = flodl_mpi.fit(train_step=lambda model, batch: "not a loss", epochs=1)
    run.wait()
    print("not reached", flush=True)
""")

BAD_OPTION = textwrap.dedent("""
    import flodl_mpi
    flodl_mpi.fit(batch_size=0)
""")


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("script, line", [
    (BAD_STEP, ("flodl-mpi: error: the train step or eval_fn fails on a batch of 29 sample(s): TypeError: "
                "train_step must return the batch's loss as a one-element tensor that requires grad")),
    (BAD_OPTION, "flodl-mpi: error: batch_size=0: must be an integer >= 1"),
], ids=["step", "option"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, ranks, script, line):
    path = tmp_path / "bad.py"
    path.write_text(script)
    argv = [sys.executable, str(path)]
    t0 = time.monotonic()
    if ranks == 1:
        proc = fork_python(path, timeout=400)
    else:
        proc = subprocess.run(launch_argv(ranks, *argv), capture_output=True, text=True, timeout=400,
                              env=launch_env(), check=False)
    assert time.monotonic() - t0 < 300  # generous: a loaded machine
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("flodl-mpi: error:") == 1 and line in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "not reached" not in proc.stdout
