"""``jobs/workstation.sh --restarts N`` under the MPI of this environment (MPICH's Hydra or Open MPI, no
ULFM): a run whose ranks ``flodl-mpi inject-failure`` kills three times finishes, bit-identical to one
never interrupted; a launch refused as bad input (exit 2) is not restarted.

The uninterrupted run is the session's run A (tests/_runs.py: 5 epochs at 2 ranks, the defaults), trained
once for the report, export and resume tests too; the restarted run asks for A's torch threads, so both
compute alike on any machine.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import numpy as np

from flodl_mpi.outputs.checkpoint import read_newest
from flodl_mpi.outputs.metrics import read_table
from tests._runs import RUN_A_EPOCHS, session_run_a
from tests.conftest import launch_env, launcher_kind
from tests.injector import TimedLines, kill_times, start_injector

SCRIPT = Path(__file__).parents[2] / "jobs" / "workstation.sh"
#: The seed of the injector's --rank random: ranks 0, 1, 0 (rank 0, the writer, killed twice).
SEED = 4
#: Seconds from a kill to the launcher's end that the test allows: Hydra ends the others at once, Open
#: MPI's prterun after its SIGTERM to them (measured well under 1 s each, 2026-12-03).
KILL_TO_END_S = 15.0


def _env() -> dict:
    env = launch_env()
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # this environment's mpiexec and flodl-mpi
    return env


def _launch_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("workstation.sh: launch ")]


def test_the_restart_loop_finishes_a_run_through_three_kills(tmp_path, tmp_path_factory):
    reference = session_run_a(tmp_path_factory)
    threads = re.search(r"torch threads: (\d+) per rank", (reference / "train.log").read_text())
    assert threads, "run A's train.log names no torch threads per rank"
    run_dir = tmp_path / "restarted"
    env = _env()
    # Started with the run: it waits for the run dir and each launch's ranks; the k-th kill (from 0)
    # comes once epoch 1 + k has ended in the launch then running (so each launch gets further).
    injector = start_injector(run_dir, "--epoch", "1", "--every", "1", "--times", "3", "--rank", "random",
                              "--seed", str(SEED), "--timeout", "240", env=env)
    t0 = time.monotonic()
    job = TimedLines(["bash", str(SCRIPT), "2", "--restarts", "3", "--run-dir", str(run_dir), "--epochs",
                      str(RUN_A_EPOCHS), "--threads", threads.group(1), "-q"], env=env)
    status = job.wait(timeout=300)
    wall = time.monotonic() - t0
    assert injector.wait(timeout=30) == 0, injector.text()
    stderr = job.text("err")
    assert status == 0, stderr[-4000:]

    # -- each kill was made, to the ranks the seed chose, and ended its launch promptly
    kills = injector.text("out").splitlines()
    assert [re.search(r"rank (\d) ", k).group(1) for k in kills] == ["0", "1", "0"], kills
    killed = 137 if launcher_kind() == "openmpi" else 9  # Open MPI: 128 + 9; Hydra: the signal's number
    lines = _launch_lines(stderr)
    assert lines == [
        *(f"workstation.sh: launch {k} ended with status {killed} (a rank was killed by signal 9): restart {k} of 3, "
          f"2 rank(s), from the last checkpoint in {run_dir} (--resume auto)" for k in (1, 2, 3)),
        "workstation.sh: launch 4 ended with status 0 (done) after 3 restart(s)",
    ], stderr[-4000:]
    ended = job.times_of("workstation.sh: launch ")
    for k, (kill, end) in enumerate(zip(kill_times(injector), ended)):
        assert 0 <= end - kill < KILL_TO_END_S, f"launch {k + 1} ended {end - kill:.1f} s after its kill"
    assert wall < 200, f"the restart loop took {wall:.0f} s"
    log = (run_dir / "train.log").read_text()
    assert len(re.findall(r"workstation\.sh: launch \d ended with status \d+ \(a rank was killed", log)) == 3

    # -- the run is whole: every epoch once, its final weights bit-identical to the uninterrupted run's
    epochs = read_table(run_dir / "metrics.h5", "epochs")
    np.testing.assert_array_equal(epochs["epoch"], np.arange(1, RUN_A_EPOCHS + 1))
    assert len(read_table(run_dir / "metrics.h5", "rounds")["round"]) == \
        len(read_table(reference / "metrics.h5", "rounds")["round"])
    ours, _ = read_newest(run_dir / "checkpoints", ranks=None)
    theirs, _ = read_newest(reference / "checkpoints", ranks=None)
    assert ours.meta["epoch"] == theirs.meta["epoch"] == RUN_A_EPOCHS
    assert list(ours.params) == list(theirs.params) and list(ours.buffers) == list(theirs.buffers)
    for name in ours.params:
        np.testing.assert_array_equal(ours.params[name], theirs.params[name], err_msg=name)
    for name in ours.buffers:
        np.testing.assert_array_equal(ours.buffers[name], theirs.buffers[name], err_msg=name)


def test_bad_input_is_not_restarted(tmp_path):
    run_dir = tmp_path / "bad"
    t0 = time.monotonic()
    job = TimedLines(["bash", str(SCRIPT), "2", "--restarts", "3", "--run-dir", str(run_dir), "--batch-size", "0"],
                     env=_env())
    status = job.wait(timeout=120)
    wall = time.monotonic() - t0
    stderr = job.text("err")
    assert status == 2, stderr
    assert "flodl-mpi: error: --batch-size 0: must be an integer >= 1" in stderr
    assert _launch_lines(stderr) == ["workstation.sh: launch 1 ended with status 2 (bad input): not restarted, the "
                                     "same input would fail again"]
    assert not run_dir.exists()  # nothing created for a run whose input is bad
    assert wall < 60
