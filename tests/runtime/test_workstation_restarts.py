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
import pytest

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
    injector = start_injector(
        run_dir,
        "--epoch",
        "1",
        "--every",
        "1",
        "--times",
        "3",
        "--rank",
        "random",
        "--seed",
        str(SEED),
        "--timeout",
        "240",
        env=env,
    )
    t0 = time.monotonic()
    job = TimedLines(
        [
            "bash",
            str(SCRIPT),
            "2",
            "--restarts",
            "3",
            "--run-dir",
            str(run_dir),
            "--epochs",
            str(RUN_A_EPOCHS),
            "--threads",
            threads.group(1),
            "-q",
        ],
        env=env,
    )
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
        *(
            f"workstation.sh: launch {k} ended with status {killed} (a rank was killed by signal 9): restart {k} of 3, "
            f"2 rank(s), from the last checkpoint in {run_dir} (--resume auto)"
            for k in (1, 2, 3)
        ),
        "workstation.sh: launch 4 ended with status 0 (done) after 3 restart(s)",
    ], stderr[-4000:]
    ended = job.times_of("workstation.sh: launch ")
    for k, (kill, end) in enumerate(zip(kill_times(injector), ended)):
        print(f"kill {k + 1}: the launcher ended {end - kill:.2f} s after it")  # shown with pytest -s
        assert 0 <= end - kill < KILL_TO_END_S, f"launch {k + 1} ended {end - kill:.1f} s after its kill"
    assert wall < 400, f"the restart loop took {wall:.0f} s"  # generous: a loaded machine (the kills are bounded above)
    log = (run_dir / "train.log").read_text()
    assert len(re.findall(r"workstation\.sh: launch \d ended with status \d+ \(a rank was killed", log)) == 3

    # -- the run is whole: every epoch once, its final weights bit-identical to the uninterrupted run's
    epochs = read_table(run_dir / "metrics.h5", "epochs")
    np.testing.assert_array_equal(epochs["epoch"], np.arange(1, RUN_A_EPOCHS + 1))
    assert len(read_table(run_dir / "metrics.h5", "rounds")["round"]) == len(
        read_table(reference / "metrics.h5", "rounds")["round"]
    )
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
    job = TimedLines(
        ["bash", str(SCRIPT), "2", "--restarts", "3", "--run-dir", str(run_dir), "--batch-size", "0"], env=_env()
    )
    status = job.wait(timeout=120)
    wall = time.monotonic() - t0
    stderr = job.text("err")
    assert status == 2, stderr
    assert "flodl-mpi: error: --batch-size 0: must be an integer >= 1" in stderr
    assert _launch_lines(stderr) == [
        "workstation.sh: launch 1 ended with status 2 (bad input): not restarted, the same input would fail again"
    ]
    assert not run_dir.exists()  # nothing created for a run whose input is bad
    assert wall < 60


# -- the loop's rules, against a stand-in mpiexec (no MPI starts): each launch takes the next line of a plan,
# "STATUS [hydra|ompi|wait]": exit STATUS, after printing the launcher's report of a rank killed by a signal
# (Hydra's, on stdout: signal STATUS; Open MPI's, on stderr: signal STATUS - 128), or after waiting for a
# signal (exit 4 on SIGUSR1).

FAKE = """#!/bin/bash
if [[ $1 == --version ]]; then echo "$FAKE_MPI_VERSION"; exit 0; fi
echo "$*" >>"$FAKE_LOG"
read -r status what < <(sed -n "$(wc -l <"$FAKE_LOG")p" "$FAKE_PLAN")
case $what in
    hydra) echo "YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Interrupt (signal $status)" ;;
    ompi) printf 'prterun noticed that process rank 1 with PID 7 on node vm exited on\\nsignal %s (Killed).\\n' \\
              "$((status - 128))" >&2 ;;
    wait) trap 'echo "got USR1" >>"$FAKE_LOG"; exit 4' USR1; echo ready >>"$FAKE_LOG.ready"
          while :; do sleep 0.05; done ;;
esac
exit "$status"
"""
HYDRA = "HYDRA build details:\\n    Version:                                 4.3.0"
OPEN_MPI = "mpiexec (Open MPI) 5.0.8"


def _fake(
    tmp_path: Path,
    plan: list[str],
    *args: str,
    mpi: str = HYDRA,
    log_line: str | None = None,
    signal_when_ready: bool = False,
):
    """Run the script against the stand-in; returns (status, stderr, the launches' arguments)."""
    import os
    import signal
    import subprocess

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "mpiexec").write_text(FAKE)
    (bin_dir / "mpiexec").chmod(0o755)
    (tmp_path / "plan").write_text("\n".join(plan) + "\n")
    run_dir = tmp_path / "run"
    if log_line is not None:
        run_dir.mkdir()
        (run_dir / "train.log").write_text(f"12:00:00 epoch 1/5 ...\n12:00:01 {log_line}\n")
    log = tmp_path / "launches"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PRTE_", "PMIX_"))}
    env.update(
        PATH=f"{bin_dir}:{env['PATH']}", FAKE_MPI_VERSION=mpi, FAKE_PLAN=str(tmp_path / "plan"), FAKE_LOG=str(log)
    )
    argv = ["bash", str(SCRIPT), "2", *(a.replace("RUN", str(run_dir)) for a in args)]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if signal_when_ready:
        ready = Path(f"{log}.ready")
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=60)
    launches = [line for line in log.read_text().splitlines() if line != "got USR1"] if log.exists() else []
    return proc.returncode, err, launches, log.read_text() if log.exists() else ""


def test_a_signal_whose_number_is_one_of_our_statuses_is_restarted_at_the_restart_world_size(tmp_path):
    status, err, launches, _ = _fake(
        tmp_path,
        ["2 hydra", "0"],
        "--restarts",
        "1",
        "--restart-world-size",
        "1",
        "--run-dir",
        "RUN",
        "--resume",
        "--epochs",
        "3",
    )
    assert status == 0, err
    run_dir = tmp_path / "run"
    assert launches == [
        f"-n 2 flodl-mpi train --run-dir {run_dir} --resume --epochs 3",
        f"-n 1 flodl-mpi train --run-dir {run_dir} --epochs 3 --resume auto",
    ]
    assert _launch_lines(err) == [
        "workstation.sh: launch 1 ended with status 2 (a rank was killed by signal 2; the launcher's 2 is that "
        f"signal's number, not flodl-mpi's): restart 1 of 1, 1 rank(s), from the last checkpoint in {run_dir} "
        "(--resume auto)",
        "workstation.sh: launch 2 ended with status 0 (done) after 1 restart(s)",
    ]


def test_the_restarts_are_bounded_and_the_last_status_is_returned(tmp_path):
    status, err, launches, _ = _fake(tmp_path, ["137 ompi"] * 3, "--restarts=2", "--run-dir=RUN", mpi=OPEN_MPI)
    assert status == 137
    assert len(launches) == 3 and all(a.startswith("--oversubscribe --bind-to none -n 2 ") for a in launches)
    assert _launch_lines(err)[-1] == (
        "workstation.sh: launch 3 ended with status 137 (a rank was killed by signal 9)"
        ": no restart left (2 of 2 used); exit status 137"
    )
    assert (tmp_path / "run").exists() is False  # the stand-in wrote no train.log: none appended to


def test_a_stop_is_not_restarted_but_a_status_4_without_the_stop_is(tmp_path):
    (tmp_path / "a").mkdir()
    status, err, launches, _ = _fake(
        tmp_path / "a",
        ["4", "0"],
        "--restarts",
        "3",
        "--run-dir",
        "RUN",
        log_line="stopped, not done (5 epochs asked); exit status 4: ...",
    )
    assert (status, len(launches)) == (4, 1), err
    assert _launch_lines(err) == [
        "workstation.sh: launch 1 ended with status 4 (stopped on request): not restarted; go on with --resume"
    ]
    (tmp_path / "b").mkdir()
    status, err, launches, _ = _fake(
        tmp_path / "b", ["4", "0"], "--restarts", "3", "--run-dir", "RUN", log_line="epoch 2/5 ..."
    )
    assert (status, len(launches)) == (0, 2), err
    assert "train.log does not end 'stopped, not done': under MPICH, a rank killed by signal 4" in err


@pytest.mark.parametrize("plan", [["9 wait", "0"], ["9", "9 wait", "0"]], ids=["first launch", "a relaunch"])
def test_a_stop_signal_to_the_script_reaches_the_launcher_and_ends_the_loop(tmp_path, plan):
    status, err, launches, log = _fake(tmp_path, plan, "--restarts", "3", "--run-dir", "RUN", signal_when_ready=True)
    assert "got USR1" in log  # the launch then running got it (not an earlier one's pid)
    assert (status, len(launches)) == (4, len(plan) - 1), err
    assert _launch_lines(err)[-1] == (
        f"workstation.sh: launch {len(plan) - 1} ended with status 4 (stopped on request): not restarted; "
        "go on with --resume"
    )


def test_refused_restart_options_are_one_line_and_exit_2(tmp_path):
    cases = {
        ("--restarts", "3"): "workstation.sh: error: --restarts needs --run-dir DIR on the command line (the "
        "run each restart resumes)",
        ("--restarts", "x", "--run-dir", "RUN"): "workstation.sh: error: --restarts 'x': must be an integer >= 0",
        ("--restart-world-size", "2"): "workstation.sh: error: --restart-world-size needs --restarts N",
        (
            "--restarts",
            "1",
            "--restart-world-size",
            "0",
            "--run-dir",
            "RUN",
        ): "workstation.sh: error: --restart-world-size '0': must be an integer >= 1",
    }
    for k, (args, line) in enumerate(cases.items()):
        (tmp_path / str(k)).mkdir()
        status, err, launches, _ = _fake(tmp_path / str(k), ["0"], *args)
        assert (status, err.strip(), launches) == (2, line, [])
