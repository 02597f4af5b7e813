"""The stall watchdog: its decisions as pure functions, then whole jobs that stall or merely wait.

A rank waiting for a slower peer that keeps making progress is not stalled; a
rank hung in its training or setup step, or frozen, ends the job with exit 3
and is named. The multi-rank jobs read a digits file written once here (never
the user's cache: a cold cache would make another setup step the slow one).
"""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from flodl_mpi.errors import EXIT_STALL
from flodl_mpi.runtime.world import BEAT_DTYPE, heartbeat_period, overdue_verdict, stall_slack, stall_verdict
from tests.conftest import launch_argv, launch_env, run_flodl
from tests.faults import fault_hooks

# Stall timeout of the jobs below, seconds: small, yet well above any one setup
# step's skew between two ranks on a loaded two-core machine.
STALL = 4.0


def beats(ages, waiting, doing=None, timeout=STALL, exiting=None):
    """Heartbeats of ranks 0..W-1, as one exchange gathers them."""
    w = len(ages)
    out = np.zeros(w, dtype=BEAT_DTYPE)
    out["age"] = ages
    out["timeout"] = timeout
    out["waiting"] = waiting
    out["exiting"] = exiting if exiting is not None else [0] * w
    out["doing"] = [(d or f"doing {r}").encode() for r, d in enumerate(doing or [None] * w)]
    return out


# --------------------------------------------------------------------------- decisions (no MPI)


def test_a_waiting_rank_is_not_stalled_while_a_peer_makes_progress():
    # Rank 0 has waited 10 timeouts; rank 1 trained a batch 1 s ago.
    assert stall_verdict(beats([10 * STALL, 1.0], [1, 0])) is None
    # Every rank waits, one of them arrived recently (its part was progress).
    assert stall_verdict(beats([10 * STALL, 0.5, 3 * STALL], [1, 1, 1])) is None


def test_long_work_on_every_rank_with_no_rank_waiting_is_not_a_stall():
    # A cold import or a first compile on every rank at once.
    assert stall_verdict(beats([5 * STALL, 5 * STALL], [0, 0])) is None


def test_no_progress_while_a_rank_waits_is_a_stall_naming_the_working_rank():
    why = stall_verdict(beats([STALL + 0.6, STALL + 0.3, STALL + 0.9], [1, 0, 1],
                              ["waiting for the others in a round (last progress: reached a round)",
                               "working on training (last progress: batch 3 of epoch 1)", None]))
    assert why == (f"no rank made progress for {STALL + 0.3:.1f} s (stall timeout {STALL:g} s): rank 1 working on "
                   f"training (last progress: batch 3 of epoch 1), no progress for {STALL + 0.3:.1f} s; "
                   f"ranks 0, 2 waited for it")


def test_ranks_waiting_in_different_collectives_are_all_named():
    why = stall_verdict(beats([STALL + 1, STALL + 2], [1, 1], ["waiting in a round", "waiting in setup step 'x'"]))
    assert why.endswith("every rank waits in a collective: rank 0 waiting in a round; "
                        "rank 1 waiting in setup step 'x'")


def test_the_agreed_timeout_is_the_largest_until_every_rank_has_read_it():
    # Rank 0 already runs with the configured 4 s, rank 1 still with the default.
    early = beats([STALL + 1, STALL + 1], [1, 0])
    early["timeout"] = [STALL, 600.0]
    assert stall_verdict(early) is None
    early["age"] = [601.0, 602.0]
    assert stall_verdict(early).startswith("no rank made progress for 601.0 s (stall timeout 600 s)")


def test_an_overdue_heartbeat_names_the_rank_that_was_working():
    last = beats([0.1, 0.2, 0.3], [1, 0, 1], ["waiting in a round", "working on training", "waiting in a round"])
    assert overdue_verdict(STALL, STALL, 0, last, STALL) is None
    why = overdue_verdict(STALL + 0.5, STALL, 0, last, STALL + 0.7)
    assert why == (f"the watchdogs' heartbeat exchange has not completed for {STALL + 0.5:.1f} s (stall timeout "
                   f"{STALL:g} s): a rank is frozen (stopped, swapped out) or gone without the launcher noticing; "
                   f"likely rank 1, at the last exchange {STALL + 0.7:.1f} s ago: rank 1 working on training")
    # The rank deciding is alive: never blamed. With every other rank waiting, all are named.
    assert "one of ranks 0, 2" in overdue_verdict(9.0, STALL, 1, last, 9.0)
    assert overdue_verdict(9.0, STALL, 0, None, 0.0).endswith("no exchange had completed yet")


def test_heartbeat_period_and_slack():
    assert heartbeat_period(4.0) == pytest.approx(0.4)
    assert heartbeat_period(600.0) == 2.0
    assert stall_slack(600.0) == 5.0


class _Rank0:
    rank = 0


def test_the_verdict_is_appended_to_the_run_log_and_a_hung_file_system_cannot_hold_the_exit(tmp_path):
    from mpi4py import MPI

    from flodl_mpi.runtime import world

    watchdog = world.Watchdog(_Rank0(), stall_timeout=STALL, thread_level=MPI.THREAD_MULTIPLE)  # not started
    watchdog._note("watchdog: nothing set: nothing written")  # no log_path (other ranks, before the run dir)
    log = tmp_path / "train.log"
    log.write_text("12:00:00 epoch 1/3\n")
    watchdog.log_path = log
    watchdog._note("watchdog: the verdict")
    lines = log.read_text().splitlines()
    assert lines[0] == "12:00:00 epoch 1/3" and re.fullmatch(r"\d\d:\d\d:\d\d run failed: watchdog: the verdict",
                                                              lines[1]) and len(lines) == 2
    # A log whose open never returns (a FIFO nobody reads: a hung file system's stand-in) delays
    # the note by its bound, not forever.
    fifo = tmp_path / "hung.log"
    os.mkfifo(fifo)
    watchdog.log_path = fifo
    t0 = time.monotonic()
    watchdog._note("watchdog: lost")
    elapsed = time.monotonic() - t0
    assert world._NOTE_WAIT_S <= elapsed < world._NOTE_WAIT_S + 5
    with open(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK), closefd=True):  # let the writer thread finish
        pass


@pytest.mark.mpi  # needs MPI started (COMM_SELF): the serial pytest process never starts it
def test_below_thread_multiple_the_watchdog_says_so_once_and_times_local_waits(capfd):
    from mpi4py import MPI

    from flodl_mpi.runtime.world import Watchdog

    watchdog = Watchdog(MPI.COMM_SELF, stall_timeout=5.0, thread_level=MPI.THREAD_SERIALIZED)
    assert not watchdog.heartbeats
    watchdog.start()
    watchdog.round_started()
    watchdog.round_finished()
    watchdog.close()
    assert capfd.readouterr().err == ("flodl-mpi: MPI provides less than THREAD_MULTIPLE: the stall watchdog times "
                                      "each rank's own waits (a rank waiting longer than --stall-timeout for a "
                                      "slower one is taken for stalled)\n")


# --------------------------------------------------------------------------- in the world (pytest-mpi)


@pytest.mark.mpi
def test_heartbeats_run_beside_the_setup_collectives_and_stop_on_every_rank():
    from mpi4py import MPI

    from flodl_mpi.runtime.world import Watchdog, agree

    comm = MPI.COMM_WORLD
    watchdog = Watchdog(comm, stall_timeout=5.0)  # a heartbeat every 0.5 s
    watchdog.start()
    # The main thread's collectives on the world while the heartbeats run on their own communicator.
    for i in range(40):
        assert agree(comm, f"step {i}", lambda i=i: comm.rank + i, watchdog) == comm.rank + i
        time.sleep(0.05)
    time.sleep(0.3 * comm.rank)  # the ranks leave at different times
    watchdog.close()  # returns on every rank: the heartbeats ended on the same exchange
    assert comm.allgather(comm.rank) == list(range(comm.size))  # the world still works


# --------------------------------------------------------------------------- whole jobs


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    from flodl_mpi.training.data import write_digits

    return str(write_digits(tmp_path_factory.mktemp("data") / "digits.h5"))


def slow_model(tmp_path, forward_s=0.0, factory_s=0.0):
    """A model file whose rank 1 sleeps ``forward_s`` per training forward and ``factory_s`` when built.

    Every rank writes its process id to ``pid-<rank>`` beside the file.
    """
    module = tmp_path / "slow_net.py"
    module.write_text(
        "import os, time, torch\n"
        "from mpi4py import MPI\n"
        "class Net(torch.nn.Linear):\n"
        "    def forward(self, x):\n"
        f"        if self.training and MPI.COMM_WORLD.rank == 1 and {forward_s!r}:\n"
        f"            time.sleep({forward_s!r})\n"
        "        return super().forward(x)\n"
        "def make_slow_net(input_shape, num_classes):\n"
        "    rank = MPI.COMM_WORLD.rank\n"
        f"    open(os.path.join({str(tmp_path)!r}, f'pid-{{rank}}'), 'w').write(str(os.getpid()))\n"
        f"    if rank == 1:\n"
        f"        time.sleep({factory_s!r})\n"
        "    return Net(input_shape[0], num_classes)\n")
    return f"{module}:make_slow_net"


def stall_age(stderr):
    """The seconds without progress the verdict reports."""
    return float(re.search(r"watchdog: no rank made progress for ([0-9.]+) s", stderr).group(1))


@pytest.fixture(scope="module")
def slow_peer_run(tmp_path_factory, digits):
    """One 2-rank job whose rank 1 is slow twice over, read by the two tests that a slow peer is no stall.

    Rank 1 builds its model 0.6 stall timeouts late (a setup step within the timeout), then takes 0.35 s
    a batch where rank 0 takes milliseconds: in each window of 45 batches rank 0 waits about 16 s (4 stall
    timeouts) in the control gather. Was a job for each test (the setup one at batch 64, a round a batch);
    the two delays are in different phases (setup, then training), so neither hides the other: the setup
    step's wait ends before the first batch, and each ends in progress by the slow rank."""
    tmp_path = tmp_path_factory.mktemp("slow_peer")
    run_dir = tmp_path / "r"
    proc = run_flodl(2, "train", "--data", digits, "--model", slow_model(tmp_path, forward_s=0.35, factory_s=0.6 * STALL),
                     "--epochs", "1", "--batch-size", "16", "--window", "45", "--stall-timeout", f"{STALL:g}",
                     "--run-dir", str(run_dir), timeout=300)
    return proc, run_dir


@pytest.mark.slow
def test_a_rank_waiting_far_longer_than_the_timeout_for_a_slow_peer_finishes(slow_peer_run):
    """Rank 0 waits for rank 1, slow in every batch, far longer than the stall timeout: the run finishes
    (the module's `slow_peer_run`)."""
    proc, run_dir = slow_peer_run
    assert proc.returncode == 0, proc.stderr
    assert "watchdog" not in proc.stderr
    from flodl_mpi.outputs.metrics import read_table

    batches = read_table(run_dir / "metrics.h5", "batches")
    slow = batches["batch_ms"][batches["rank"] == 1].sum() / 1e3
    fast = batches["batch_ms"][batches["rank"] == 0].sum() / 1e3
    # The path: rank 0 trained as many batches but waited for rank 1 far longer than the timeout.
    assert (batches["rank"] == 0).sum() == (batches["rank"] == 1).sum() == 45
    assert slow - fast > 3 * STALL, (slow, fast)


@pytest.mark.slow
def test_a_rank_slow_in_a_setup_step_within_the_timeout_finishes(slow_peer_run):
    """Rule: a setup step is one piece of progress. Rank 1 builds its model 0.6 timeouts late while rank 0
    waits in the step: not a stall (the module's `slow_peer_run`, whose rank 1 is slow in training too)."""
    proc, run_dir = slow_peer_run
    assert proc.returncode == 0, proc.stderr
    assert "watchdog" not in proc.stderr
    assert (run_dir / "metrics.h5").exists()  # it trained past the setup it was slow in


def test_a_rank_hung_in_setup_is_named_and_ends_the_job(tmp_path, digits):
    # Rank 1's model factory never returns: its part of the step 'model' runs
    # past the timeout while rank 0 waits for it.
    t0 = time.monotonic()
    proc = run_flodl(2, "train", "--data", digits, "--model", slow_model(tmp_path, factory_s=600),
                     "--stall-timeout", f"{STALL:g}", "--run-dir", str(tmp_path / "r"), timeout=400)
    elapsed = time.monotonic() - t0
    assert proc.returncode == EXIT_STALL, proc.stderr
    assert ("(stall timeout 4 s): rank 1 working on setup step 'model' (last progress: setup step 'data' "
            "finished)") in proc.stderr
    assert "rank 0 waited for it" in proc.stderr
    # rank 1's stack: the factory. faulthandler writes " in ", the name and "\n" one write each, and both ranks
    # dump at once into the shared stderr: the name alone is one piece, the other rank's stack never has it
    assert "make_slow_net" in proc.stderr.split("rank 1: watchdog: this rank's stacks:")[1]
    assert STALL <= stall_age(proc.stderr) < STALL + stall_slack(STALL) + 10  # printed to 0.1 s; generous bound
    assert elapsed < 300  # no 600 s hang (generous: a loaded machine)
    assert not (tmp_path / "r").exists()  # nothing was created before the stall


def last_log_line(run_dir):
    """train.log's last line, without its time stamp."""
    line = (run_dir / "train.log").read_text().splitlines()[-1]
    assert re.match(r"\d\d:\d\d:\d\d ", line), line
    return line[9:]


def printed_verdict(stderr, prefix="flodl-mpi: watchdog: "):
    """The watchdog's verdict as printed: from ``prefix`` (less ``flodl-mpi: ``) to the text before the stacks.

    Searched, not matched at a line's start: the other rank dumps its stacks at the same time
    (faulthandler writes them piece by piece), and a piece may land just before this line.
    """
    printed = re.search(re.escape(prefix) + r"(.*?); (?:every rank's )?stacks follow", stderr)
    assert printed is not None, stderr[-3000:]
    return prefix[len("flodl-mpi: "):] + printed.group(1)


@pytest.mark.parametrize("hung", [1, 0])
def test_a_rank_hung_in_its_training_step_is_named_and_ends_the_job(tmp_path, digits, hung):
    # hung 0: rank 0, which writes train.log, is the hung one; its watchdog thread still runs.
    run_dir = tmp_path / "r"
    t0 = time.monotonic()
    proc = run_flodl(2, "train", "--data", digits, "--epochs", "1", "--batch-size", "64",
                     "--run-dir", str(run_dir), "--stall-timeout", f"{STALL:g}",
                     hooks=fault_hooks(f"hang@{hung}:2"), timeout=400)
    elapsed = time.monotonic() - t0
    assert f"injected fault: rank {hung} hangs in round 2" in proc.stderr  # the hang was the fault's, not another
    assert proc.returncode == EXIT_STALL, proc.stderr
    assert f"(stall timeout 4 s): rank {hung} working on training (last progress: " in proc.stderr
    assert f"rank {1 - hung} waited for it" in proc.stderr
    assert "_fault_hook" in proc.stderr.split(f"rank {hung}: watchdog: this rank's stacks:")[1]  # hung there (as above)
    assert STALL <= stall_age(proc.stderr) < STALL + stall_slack(STALL) + 10
    assert elapsed < 300  # the note in train.log keeps the exit prompt (generous: a loaded machine)
    # train.log ends with the verdict rank 0 printed (README: it ends with the reason when a run fails)
    assert last_log_line(run_dir) == f"run failed: {printed_verdict(proc.stderr)}"


def test_a_frozen_rank_ends_the_job(tmp_path, digits):
    """SIGSTOP on rank 1's process: no launcher notices, its heartbeat stops."""
    run_dir = tmp_path / "r"
    proc = subprocess.Popen(launch_argv(2, sys.executable, "-m", "flodl_mpi", "train", "--data", digits,
                             "--model", slow_model(tmp_path, forward_s=0.05), "--epochs", "50",
                             "--stall-timeout", f"{STALL:g}", "--run-dir", str(run_dir)),
                            env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid = None
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "metrics.h5").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (run_dir / "metrics.h5").exists(), "the run did not start"
        time.sleep(2.0)  # well into training
        pid = int((tmp_path / "pid-1").read_text())
        os.kill(pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        _, err = proc.communicate(timeout=300)
        elapsed = time.monotonic() - t_stop
    finally:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):  # never leave a stopped process behind
                os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.communicate()
    assert proc.returncode == EXIT_STALL, err
    assert re.search(r"rank 0: watchdog: the watchdogs' heartbeat exchange has not completed for [0-9.]+ s "
                     r"\(stall timeout 4 s\): a rank is frozen .*; likely rank 1, at the last exchange", err), err
    # rank 0 decided alone and noted its verdict as the run's last line
    assert last_log_line(run_dir) == f"run failed: {printed_verdict(err, 'flodl-mpi: rank 0: watchdog: ')}"
    assert elapsed < STALL + stall_slack(STALL) + 30  # generous: includes the launcher's teardown
    print(f"frozen rank: job ended {elapsed:.1f} s after SIGSTOP")

