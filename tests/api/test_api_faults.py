"""Faults of the Python API under a launcher, as a user meets them (issue 7's new-user trial).

Each test runs a small script under ``mpiexec -n 2`` and asserts the exit status,
the message, a time bound, and that the named path was reached. Where the point needs no peer (a
failure of every rank, a refusal at a world of 1), the script runs at a world of 1 in a forked child of
the pytest process instead (tests/conftest.py's fork_python); where tests need the same 2-rank run, they share it (a
module-scoped fixture: the stopped own loop, the uneven sync runs, one own loop that checks the import's
handlers, a spawned worker and a quarantine).
"""

import shutil

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from tests.conftest import launch_argv, launch_env, launcher_kind, rank_pids, fork_python

pytestmark = pytest.mark.slow

#: The launcher's rank, read without importing flodl_mpi (Hydra's and Open MPI's variables).
RANK_BEFORE_IMPORT = "int(os.environ.get('PMI_RANK', os.environ.get('OMPI_COMM_WORLD_RANK', '0')))"
RANK = "__import__('flodl_mpi.runtime.launcher').runtime.launcher.launcher_rank()"
#: Upper bound on a job that must end promptly, start-up included: it guards against a hang (or the
#: 600 s stall timeout), never measures speed; generous for a loaded machine (CI may be 2x slower,
#: and the serial tests run two at a time).
PROMPT_S = 300


def _run(tmp_path, script: str, *args: str, env: dict | None = None, timeout: float = 400.0, ranks: int = 2):
    """``script`` (dedented) under ``mpiexec -n 2``, or at ``ranks=1`` forked (tests/conftest.py's fork_python):
    ``(process, seconds)``."""
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(script))
    t0 = time.monotonic()
    if ranks == 1:
        return fork_python(path, *args, env=env, timeout=timeout), time.monotonic() - t0
    proc = subprocess.run(launch_argv(ranks, sys.executable, str(path), *args), capture_output=True, text=True,
                          timeout=timeout, env=launch_env(env), check=False)
    return proc, time.monotonic() - t0


# ---- item 1: an error on one rank before the Averager or fit starts ------------------------------

def test_an_error_after_the_import_aborts_the_job_at_once(tmp_path):
    """Rank 1 fails to open its data after `import flodl_mpi`, before any Averager: the job ends (was: a hang)."""
    proc, took = _run(tmp_path, f"""
        import os, time
        import flodl_mpi, torch
        if {RANK} == 1:
            open("/nonexistent/data.h5")
        time.sleep(1)
        with flodl_mpi.Averager(torch.nn.Linear(2, 1)) as avg:
            avg.step()
        print("not reached", flush=True)
    """)
    assert took < PROMPT_S
    assert proc.returncode == 1, proc.stderr[-2000:]
    # the world's hook aborted the job, with the line the README promises
    assert ("flodl-mpi: rank 1: error: FileNotFoundError: [Errno 2] No such file or directory: "
            "'/nonexistent/data.h5'; aborting the job") in proc.stderr
    assert "FileNotFoundError" in proc.stderr and "/nonexistent/data.h5" in proc.stderr
    assert "not reached" not in proc.stdout


def test_an_error_before_the_import_ends_the_peers_start_up(tmp_path):
    """Rank 1 fails before it imports flodl_mpi: rank 0's MPI start-up is bounded (Hydra would wait forever)."""
    proc, took = _run(tmp_path, f"""
        import os
        if {RANK_BEFORE_IMPORT} == 1:
            raise FileNotFoundError("rank 1 cannot open data.h5")
        import flodl_mpi
        print("not reached", flush=True)
    """, env={"FLODL_MPI_START_TIMEOUT": "2"})  # rank 0 spins in MPI start-up that long: short
    assert took < PROMPT_S
    assert proc.returncode != 0, proc.stderr[-2000:]
    assert "not reached" not in proc.stdout
    assert "rank 1 cannot open data.h5" in proc.stderr
    if launcher_kind() == "hydra":  # Open MPI's mpirun ends the job itself when rank 1 exits
        assert ("flodl-mpi: rank 0: error: MPI did not start within 2 s: another rank ended before it started MPI"
                in proc.stderr), proc.stderr[-2000:]


#: One 2-rank own loop that three tests read (test_a_spawned_worker_does_not_start_mpi,
#: test_the_scripts_own_handlers_come_back_after_the_run, test_a_quarantine_in_an_own_loop_is_logged: each was
#: a launch of its own): the script sets its own SIGTERM handler and imports flodl_mpi (the import's stop
#: handler replaces it); a "spawn" worker imports the script again; then an own loop with a run_dir in which
#: rank 1's loss is NaN at its 6th step() call (sync: round 5); after the loop, the handlers are printed.
SHARED_OWN_LOOP = """
    import multiprocessing as mp
    import signal
    import sys

    def mine(signum, frame):
        pass

    if __name__ == "__main__":  # not in the worker: the pool's terminate() ends it with SIGTERM
        signal.signal(signal.SIGTERM, mine)
    import flodl_mpi  # a spawned worker runs this again, with the launcher's variables: it must not start MPI
    from flodl_mpi.runtime.session import _stop_before_run

    def work(i):
        return "mpi4py.MPI" in sys.modules

    if __name__ == "__main__":  # the worker's import of the script ends above (torch: the rank's alone)
        import torch

        assert signal.getsignal(signal.SIGTERM) is _stop_before_run
        assert signal.getsignal(signal.SIGINT) is _stop_before_run
        with mp.get_context("spawn").Pool(1) as pool:
            print(f"worker started MPI: {pool.map(work, [0])[0]}", flush=True)  # one write: ranks share the pipe
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with flodl_mpi.Averager(model, optimizer=opt, run_dir=sys.argv[1]) as avg:
            for epoch in range(2):
                for i in range(4):
                    opt.zero_grad()
                    loss = model(torch.ones(3, 2)).pow(2).mean()
                    if avg.global_step == 5 and avg.rank == 1:
                        loss = loss * float("nan")  # the 6th call (sync: round 5) of rank 1
                    loss.backward()
                    opt.step()
                    avg.step(loss)
                avg.end_epoch()
        print(f"after {signal.getsignal(signal.SIGTERM) is mine} "
              f"{signal.getsignal(signal.SIGINT) is signal.default_int_handler}", flush=True)
        print("done", flush=True)
        print("finished", flush=True)
"""


@pytest.fixture(scope="module")
def shared_own_loop(tmp_path_factory):
    """`SHARED_OWN_LOOP` launched once at 2 ranks: ``(process, seconds, run dir)``."""
    tmp = tmp_path_factory.mktemp("shared_own_loop")
    return (*_run(tmp, SHARED_OWN_LOOP, str(tmp / "run")), tmp / "run")


def test_a_spawned_worker_does_not_start_mpi(shared_own_loop):
    """A "spawn" worker (a DataLoader's) imports the script again with the launcher's variables: not a rank.
    The launch is `SHARED_OWN_LOOP`'s (the worker starts before its own loop, as before its Averager)."""
    proc, took, _ = shared_own_loop
    assert took < PROMPT_S
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("worker started MPI: False") == 2 and proc.stdout.count("done") == 2


def test_a_bad_start_timeout_is_refused_in_one_line(tmp_path):
    proc, took = _run(tmp_path, "import flodl_mpi\nprint('not reached')\n", env={"FLODL_MPI_START_TIMEOUT": "soon"})
    assert took < PROMPT_S
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("flodl-mpi: error: FLODL_MPI_START_TIMEOUT='soon': must be a number of seconds > 0") == 1
    assert "not reached" not in proc.stdout and "Traceback" not in proc.stderr


# ---- item 2: stop signals stop API runs as they stop the CLI --------------------------------------

OWN_LOOP = """
    import sys, time
    from pathlib import Path
    import torch
    import flodl_mpi
    run_dir, marker = sys.argv[1], Path(sys.argv[2])
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 4), torch.randn(64, 1)
    with flodl_mpi.Averager(model, optimizer=opt, run_dir=run_dir) as avg:
        for epoch in range(avg.epoch, 100000):
            for i in range(8):
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                avg.step(loss)
                time.sleep(0.01)
                if avg.global_step == 20 and avg.rank == 0:
                    marker.write_text("started")
            avg.end_epoch()
    print("not reached", flush=True)
"""

FIT = """
    import os, signal, sys
    from pathlib import Path
    import flodl_mpi
    run_dir, marker = sys.argv[1], Path(sys.argv[2])
    self_signal = sys.argv[3] if len(sys.argv) > 3 else None  # the signal it sends itself once it trains
    run = flodl_mpi.fit(epochs=100000, run_dir=run_dir, eval_every=0)
    for epoch in run:
        if epoch.epoch == 1 and run.rank == 0:
            marker.write_text("started")
            if self_signal:
                os.kill(os.getpid(), getattr(signal, self_signal))
    print("not reached", flush=True)
"""


def _start_until_marked(tmp_path, script):
    """Launch ``script`` at 2 ranks with (run dir, marker) arguments; return once it wrote the marker."""
    path, run_dir, marker = tmp_path / "script.py", tmp_path / "run", tmp_path / "started"
    path.write_text(textwrap.dedent(script))
    proc = subprocess.Popen(launch_argv(2, sys.executable, str(path), str(run_dir), str(marker)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=launch_env())
    deadline = time.monotonic() + PROMPT_S
    while not marker.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    return proc, run_dir, marker


def _signal_run(tmp_path, script, signame: str, target: str):
    """Launch ``script`` at 2 ranks, send ``signame`` once it trains (to the launcher or every rank, or to one
    rank), wait for the exit: ``(process, stdout, stderr, seconds from the signal to the exit, run dir)``."""
    proc, run_dir, marker = _start_until_marked(tmp_path, script)
    try:
        assert marker.exists(), "the run did not start"
        if target == "launcher" and launcher_kind() == "hydra":
            proc.send_signal(getattr(signal, signame))  # Hydra forwards it to every rank
        elif target == "launcher":  # Open MPI's mpirun kills the job on SIGTERM: signal every rank, as scancel does
            for pid in rank_pids(proc, str(run_dir)):
                os.kill(pid, getattr(signal, signame))
        else:
            ranks = rank_pids(proc, str(run_dir))
            assert len(ranks) == 2
            os.kill(ranks[-1], getattr(signal, signame))
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=PROMPT_S)
        took = time.monotonic() - t0
    finally:
        proc.kill()
        proc.communicate()
    return proc, out, err, took, run_dir


@pytest.fixture(scope="module")
def stopped_own_loop(tmp_path_factory):
    """OWN_LOOP at 2 ranks, SIGTERM through the launcher once it trains (Hydra forwards it; under Open MPI
    to every rank, as scancel does): `_signal_run`'s tuple. test_a_stop_signal_saves_and_exits_4's
    ``own-loop-sigterm-launcher`` case, and the run dir the tests of what a stopped own loop leaves read
    (each was a launch of its own; the resume's test resumes a copy)."""
    return _signal_run(tmp_path_factory.mktemp("stopped_own_loop"), OWN_LOOP, "SIGTERM", "launcher")


def _stop_own_loop(stopped_own_loop):
    """The run dir `stopped_own_loop` left, after its exit 4 (read it; copy it to write)."""
    proc, _, err, _, run_dir = stopped_own_loop
    assert proc.returncode == 4, err[-3000:]
    return run_dir


@pytest.mark.parametrize("script, signame, target", [
    (OWN_LOOP, "SIGTERM", "launcher"), (OWN_LOOP, "SIGINT", "rank"), (FIT, "SIGTERM", "launcher"),
    (FIT, "SIGINT", "rank"),
], ids=["own-loop-sigterm-launcher", "own-loop-ctrl-c-rank", "fit-sigterm-launcher", "fit-ctrl-c-rank"])
def test_a_stop_signal_saves_and_exits_4(tmp_path, request, script, signame, target):
    """The own loop's cases and ``fit-sigterm-launcher`` launch at 2 ranks (the signal reaches the ranks
    through the launcher, or one rank's stop reaches the other through the rounds); ``own-loop-sigterm-launcher``
    is `stopped_own_loop`'s run. ``fit-ctrl-c-rank`` runs at a world of 1, forked (was a launch): the script
    sends itself SIGINT once it trains; one rank's stop reaching the others in fit is test_api_stop_resume.py's
    fit trio (rank 1's SIGUSR1 at 2 ranks), and a Ctrl-C on one of 2 ranks is ``own-loop-ctrl-c-rank``."""
    from flodl_mpi.outputs.checkpoint import latest_checkpoint, read_checkpoint

    if (script, signame, target) == (OWN_LOOP, "SIGTERM", "launcher"):
        proc, out, err, took, run_dir = request.getfixturevalue("stopped_own_loop")
    elif (script, target) == (FIT, "rank"):
        run_dir, marker = tmp_path / "run", tmp_path / "started"
        proc, took = _run(tmp_path, script, str(run_dir), str(marker), signame, ranks=1, timeout=PROMPT_S)
        out, err = proc.stdout, proc.stderr
        assert marker.exists(), "the run did not start"
    else:
        proc, out, err, took, run_dir = _signal_run(tmp_path, script, signame, target)
    assert took < PROMPT_S - 100  # the run had 100000 epochs to go: it stopped
    assert proc.returncode == 4, err[-3000:]
    assert err.count("flodl-mpi: stopped on request") == 1, err[-3000:]  # rank 0's line, the path reached
    assert "run the same script with resume=True to go on; exit status 4" in err
    assert "Traceback" not in err and "not reached" not in out and "BAD TERMINATION" not in out + err
    latest = latest_checkpoint(run_dir / "checkpoints")
    ckpt = read_checkpoint(latest)
    assert ckpt.meta["reason"] == "graceful_shutdown"
    assert not [p for p in run_dir.rglob("*") if ".tmp" in p.name]  # the save completed, then renamed
    _assert_the_stop_is_recorded(run_dir, latest, ckpt.meta)


def _assert_the_stop_is_recorded(run_dir, latest, meta) -> None:
    """What a stopped run leaves, the same for fit and an own loop: train.log and the report count the
    stop, every round reached metrics.h5, the checkpoint is named for the epoch it stopped in."""
    from flodl_mpi.outputs.metrics import read_table
    from flodl_mpi.cli.report import summarize
    from flodl_mpi.outputs.run_reader import load_run

    log = (run_dir / "train.log").read_text().splitlines()
    assert sum("stopped on request" in line for line in log) == 1, log[-3:]  # was 0 for an own loop
    assert "stopped, not done" in log[-1] and "resume=True" in log[-1]
    assert summarize(load_run(run_dir))["stops"] == 1
    # every round up to the stop's has its row (the stop round's was lost in an own loop)
    np.testing.assert_array_equal(read_table(run_dir / "metrics.h5", "rounds")["round"], np.arange(meta["round"]))
    assert meta["metrics_rows"]["rounds"] == meta["round"]
    # named as the CLI's: the epoch saved; "epoch" counts the epochs done (one fewer when the stop cut it short)
    assert latest.name == f"ckpt-e{meta['epoch'] + (0 if meta['epoch_complete'] else 1):06d}-r{meta['round']:06d}.h5"


def test_a_stopped_own_loop_resumes_where_it_stopped(tmp_path, stopped_own_loop):
    """The stop's checkpoint is the resume's start: the consensus and the round count continue. The resume
    launches at 2 ranks (the stopped run's world), in a copy of `stopped_own_loop`'s run dir."""
    from flodl_mpi.outputs.checkpoint import latest_checkpoint, read_checkpoint

    run_dir = shutil.copytree(_stop_own_loop(stopped_own_loop), tmp_path / "run")
    stopped = read_checkpoint(latest_checkpoint(run_dir / "checkpoints"))
    resume = tmp_path / "resume.py"
    resume.write_text(textwrap.dedent("""
        import sys
        import torch
        import flodl_mpi
        model = torch.nn.Linear(4, 1)
        with flodl_mpi.Averager(model, run_dir=sys.argv[1], resume=True) as avg:
            print(f"resumed {avg.epoch} {avg.bridge.version}", flush=True)
    """))
    done = subprocess.run(launch_argv(2, sys.executable, str(resume), str(run_dir)), capture_output=True, text=True,
                          timeout=400, env=launch_env(), check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"resumed {stopped.meta['epoch']} {stopped.meta['round']}" in done.stdout
    from flodl_mpi.cli.report import summarize
    from flodl_mpi.outputs.run_reader import load_run

    s = summarize(load_run(run_dir))
    assert (s["stops"], s["resumes"]) == (1, 1)  # was: stops 0, resumes 1


# ---- item 3: ranks that call step() a different number of times ------------------------------------

UNEVEN = """
    import sys
    import torch, flodl_mpi
    from flodl_mpi.runtime.launcher import launcher_rank
    window, where = int(sys.argv[1]), sys.argv[2]
    avg = flodl_mpi.Averager(torch.nn.Linear(2, 1), policy="sync" if window == 1 else "window", window=window)
    for epoch in range(2):
        for i in range(8 if launcher_rank() == 0 else 7):   # rank 1's loader is one batch shorter
            avg.step()
        if where == "end_epoch":
            avg.end_epoch()
    avg.close()
    print("not reached", flush=True)
"""


#: UNEVEN with a run_dir (its third argument).
UNEVEN_RUN_DIR = UNEVEN.replace("window=window)", "window=window, run_dir=sys.argv[3])")


@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    """``uneven(window, where)``: UNEVEN launched at 2 ranks once per case, ``(process, seconds, run dir or
    None)``; at window 1 (sync) with a run_dir, so that test_uneven_step_counts_end_train_log_with_the_reason
    reads the run test_uneven_step_counts_end_at_once_naming_the_ranks checks (each was a launch of its own)."""
    cache = {}

    def get(window: int, where: str):
        if (window, where) not in cache:
            tmp = tmp_path_factory.mktemp(f"uneven-{window}-{where}")
            if window == 1:
                cache[window, where] = (*_run(tmp, UNEVEN_RUN_DIR, str(window), where, str(tmp / "run")), tmp / "run")
            else:
                cache[window, where] = (*_run(tmp, UNEVEN, str(window), where), None)
        return cache[window, where]

    return get


@pytest.mark.parametrize("window, where, line", [
    (1, "end_epoch", "(rank 0 in step() call 8; rank 1 in end_epoch() after 7 step() call(s))"),
    (4, "end_epoch", "(rank 0 in step() call 8; rank 1 in end_epoch() after 7 step() call(s))"),
    (1, "close", "(rank 0 in step() call 15; rank 1 in close() after 14 step() call(s))"),
    (2, "close", "(rank 0 in step() call 16; rank 1 in close() after 14 step() call(s))"),
], ids=["sync-end-epoch", "window-end-epoch", "sync-close", "window-close"])
def test_uneven_step_counts_end_at_once_naming_the_ranks(uneven, window, where, line):
    """One rank's loader is shorter: every rank raises the same error at the next round (was: exit 3 after 600 s).
    Each case a launch at 2 ranks (`uneven`; the sync cases with a run_dir)."""
    proc, took, _ = uneven(window, where)
    assert took < PROMPT_S  # the stall timeout is 600 s: the error came from the boundary check
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.count("flodl-mpi: error: the ranks called step() a different number of times") == 1
    assert line in proc.stderr, proc.stderr[-2000:]
    assert "watchdog" not in proc.stderr and "Traceback" not in proc.stderr and "not reached" not in proc.stdout


@pytest.mark.parametrize("where", ["end_epoch", "close"])
def test_uneven_step_counts_end_train_log_with_the_reason(uneven, where):
    """With a run_dir, train.log's last line is the same reason, written once by rank 0 (was: nothing).
    The run is `uneven`'s sync case (test_uneven_step_counts_end_at_once_naming_the_ranks's too)."""
    proc, _, run_dir = uneven(1, where)
    assert proc.returncode == 1, proc.stderr[-2000:]
    step = {"end_epoch": 8, "close": 15}[where]
    why = (f"the ranks called step() a different number of times in this epoch (rank 0 in step() call {step}; "
           f"rank 1 in {where}() after {step - 1} step() call(s))")
    assert proc.stderr.count(why) == 1, proc.stderr[-2000:]  # the path reached: the boundary check
    log = (run_dir / "train.log").read_text()
    assert log.count("failed:") == 1 and log.splitlines()[-1].split(" ", 1)[1] == f"run failed: CohortError: {why}" \
        "; every rank must call step() equally often between end_epoch() calls (a rank without a batch calls " \
        "step(realized=False), or the loop runs in `with avg.join():`)"


def test_boundary_verdict_from_the_gathered_columns():
    import numpy as np

    from flodl_mpi.transport.bridge import boundary_verdict

    nan = np.nan
    assert boundary_verdict(np.array([nan, nan]), np.array([3.0, 3.0])) is None  # a round
    assert boundary_verdict(np.array([nan, nan]), np.array([nan, nan])) is None  # the CLI's rows
    assert boundary_verdict(np.array([1.0, 1.0]), np.array([7.0, 7.0])) is None  # the same boundary
    assert boundary_verdict(np.array([1.0, 1.0]), np.array([7.0, 6.0])) == (
        "the ranks called step() a different number of times in this epoch (rank 0 in end_epoch() after 7 step() "
        "call(s); rank 1 in end_epoch() after 6 step() call(s)); every rank must call step() equally often between "
        "end_epoch() calls (a rank without a batch calls step(realized=False), or the loop runs in "
        "`with avg.join():`)")
    assert "rank 0 in close() after 2 step() call(s); rank 1 in end_epoch()" in boundary_verdict(
        np.array([2.0, 1.0]), np.array([2.0, 2.0]))


# ---- item 4: bad arguments are the API's bad input: one line in its words, exit 2 -------------------

#: (call, the line it must print): test_bad_arguments_are_one_line_in_the_api_words_and_exit_2's cases.
BAD_ARGUMENT_CASES = [
    ("flodl_mpi.Averager(torch.nn.Linear(2, 1), policy='windows')",
     "flodl-mpi: error: policy='windows': must be one of sync, window"),
    ("flodl_mpi.Averager(torch.nn.Linear(2, 1), window='3')", "flodl-mpi: error: window must be an int, got str '3'"),
    ("flodl_mpi.Averager(torch.nn.Linear(2, 1), stall_timeout=-1)",
     "flodl-mpi: error: stall_timeout must be seconds > 0, got -1"),
    ("flodl_mpi.Averager(torch.nn.Linear(2, 1), resume=True)",
     "flodl-mpi: error: resume=True needs run_dir: the run directory to continue"),
    ("flodl_mpi.fit(epochs=0)", "flodl-mpi: error: epochs=0: must be an integer >= 1"),
    ("flodl_mpi.Averager(torch.nn.Linear(2, 1), run_dir=TAKEN)",
     "flodl-mpi: error: run_dir='TAKEN' is not empty (it may hold another run)"),
    ("flodl_mpi.Averager(torch.nn.Linear(2, 1), run_dir=RUN, resume=True)",
     "flodl-mpi: error: resume=True: 'RUN' is not empty but holds no flodl-mpi run"),
    ("flodl_mpi.fit(policy='windows')", "flodl-mpi: error: policy='windows': must be one of sync, "),
    ("flodl_mpi.Averager(torch.nn.Linear(2, 1), run_dir=UNDER_FILE)",
     "flodl-mpi: error: run_dir='UNDER_FILE': cannot create it: Not a directory"),
    ("flodl_mpi.fit(run_dir=UNDER_FILE)", "flodl-mpi: error: run_dir='UNDER_FILE': cannot create it: Not a directory"),
    ("flodl_mpi.fit(windw=4)", ("flodl-mpi: error: fit() got unknown option(s) windw (did you mean window?); "
                                "the options it takes by name are ")),
    # issue 26 item 9: was a raw TypeError, MPI_Abort and exit 1
    ("flodl_mpi.Averager(torch.nn.Linear(2, 1), windw=4)",
     "flodl-mpi: error: Averager() got unknown option(s) windw (did you mean window?); the options it takes by "
     "name are bf16_wire, broadcast, checkpoint_every, chunk_elems, comm, gamma, hierarchical, keep_checkpoints, "
     "model, node_reduce, on_non_finite, optimizer, pin_staging, policy, resume, run_dir, stall_timeout, window"),
]


@pytest.mark.parametrize("call, line", BAD_ARGUMENT_CASES, ids=[
    "policy", "window-type", "stall-timeout", "resume-without-run-dir", "fit-epochs", "run-dir-taken", "resume-not-a-run",
    "fit-policy", "averager-run-dir-under-a-file", "fit-run-dir-under-a-file", "fit-typo", "averager-typo"])
def test_bad_arguments_are_one_line_in_the_api_words_and_exit_2(tmp_path, bad_arguments_in_one_process, call, line):
    """Each case was a launch at 2 ranks. `LAUNCHED_CASES` still are (a bad keyword, the misspelt one that was
    an MPI_Abort; a run dir agreed by the ranks): exit 2, one line on stderr, no traceback, nothing reached.
    (``policy``, a bad option's value refused in Averager() as ``averager-typo``'s keyword is, on every rank
    alike, was launched too: the typo's launch is the 2-rank proof of that path.)
    The others are the same calls in one world-of-1 process (`bad_arguments_in_one_process`): the same
    assertions on the line (``flodl-mpi: error: `` and the InputError's text, as the exit prints it)."""
    if call not in LAUNCHED_CASES:
        text, taken = bad_arguments_in_one_process
        stderr = text[call]
        assert stderr.count("flodl-mpi: error:") == 1, stderr
    else:
        taken = tmp_path / "taken"
        taken.mkdir()
        (taken / "notes.txt").write_text("mine")
        proc, took = _run(tmp_path, f"""
            import torch
            import flodl_mpi
            {_bad_call(call, taken)}
            print("not reached", flush=True)
        """)
        assert took < PROMPT_S
        assert proc.returncode == 2, proc.stderr[-2000:]
        stderr = proc.stderr
        assert stderr.count("flodl-mpi: error:") == 1, stderr[-2000:]
        assert "Traceback" not in stderr and "not reached" not in proc.stdout
    line = _bad_line(line, taken)
    assert line in stderr, stderr[-2000:]
    assert "--run-dir" not in stderr and "--resume" not in stderr
    assert (taken / "notes.txt").read_text() == "mine"  # nothing already there was touched
    if "fit(windw" in call:  # every name fit() takes, its own keywords too
        taken_names = stderr.split("options it takes by name are ", 1)[1].split("\n", 1)[0].split(", ")
        assert {"window", "policy", "gamma", "seed", "anchor", "lr", "optimizer"} <= set(taken_names)


#: The cases of test_bad_arguments_are_one_line_in_the_api_words_and_exit_2 still launched at 2 ranks.
LAUNCHED_CASES = ("flodl_mpi.Averager(torch.nn.Linear(2, 1), run_dir=TAKEN)",
                  "flodl_mpi.Averager(torch.nn.Linear(2, 1), windw=4)")


def _bad_call(call: str, taken) -> str:
    """A case's call with its paths: ``taken`` (a folder holding notes.txt), a run dir under that file."""
    under_file = taken / "notes.txt" / "run"  # a run dir under a file
    call = call.replace("UNDER_FILE", repr(str(under_file)))
    return call.replace("TAKEN", repr(str(taken))).replace("RUN", repr(str(taken)))


def _bad_line(line: str, taken) -> str:
    line = line.replace("'UNDER_FILE'", repr(str(taken / "notes.txt" / "run")))
    return line.replace("'TAKEN'", repr(str(taken))).replace("'RUN'", repr(str(taken)))


@pytest.fixture(scope="module")
def bad_arguments_in_one_process(tmp_path_factory):
    """Every case of the bad-arguments test that is not launched, called one after another in one world-of-1
    process: call -> what the exit would print for it (``flodl-mpi: error: `` and the InputError's text, or
    what happened instead), and the ``taken`` folder they share."""
    import json

    root = tmp_path_factory.mktemp("bad_arguments")
    taken = root / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    calls = [c for c, _ in BAD_ARGUMENT_CASES if c not in LAUNCHED_CASES]
    script = ["import json, torch, flodl_mpi", "out = {}"]
    for i, call in enumerate(calls):
        script += ["try:", f"    {_bad_call(call, taken)}", f"    out[{i}] = 'not refused'",
                   "except flodl_mpi.InputError as exc:", f"    out[{i}] = 'flodl-mpi: error: ' + str(exc)",
                   "except BaseException as exc:", f"    out[{i}] = 'not an InputError: ' + repr(exc)"]
    script += ["print('RESULTS ' + json.dumps(out), flush=True)"]
    (root / "script.py").write_text("\n".join(script) + "\n")
    proc = fork_python(root / "script.py", cwd=root)  # a world of 1, forked
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULTS ", 1)[1])
    return {call: out[str(i)] for i, call in enumerate(calls)}, taken


def test_a_bad_argument_is_an_input_error_to_catch(tmp_path):
    """Under plain python (a world of 1), the same bad argument is a catchable flodl_mpi.InputError (forked)."""
    proc, _ = _run(tmp_path, """
        import torch, flodl_mpi
        try:
            flodl_mpi.Averager(torch.nn.Linear(2, 1), policy="windows")
        except flodl_mpi.InputError as exc:
            print("caught", type(exc).__name__, exc)
    """, ranks=1)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "caught InputError policy='windows': must be one of sync, window" in proc.stdout


def test_the_api_names_its_keywords_not_the_cli_flags():
    from flodl_mpi.errors import InputError
    from flodl_mpi.runtime.session import api_words

    text = str(api_words(InputError("--run-dir '/x' holds a flodl-mpi run: add --resume to continue it; "
                                    "--batch-size 32 (was 16)")))
    assert text == "run_dir='/x' holds a flodl-mpi run: add resume=True to continue it; batch_size=32 (was 16)"
    # a choice's bare value is the keyword's string (issue 7 left: `--on-non-finite stop` in an own loop)
    text = str(api_words(InputError("--average-optimizer-state mean is not supported with --policy async; use "
                                    "--average-optimizer-state off; --on-non-finite stop, so; add --resume to go on")))
    assert text == ("average_optimizer_state='mean' is not supported with policy='async'; use "
                    "average_optimizer_state='off'; on_non_finite='stop', so; add resume=True to go on")
    # an upper-case metavar is the keyword's value (not "add val_fraction F")
    text = str(api_words(InputError("the data file has no val/ group: add --val-fraction F (0 < F < 1)")))
    assert text == "the data file has no val/ group: add val_fraction=F (0 < F < 1)"
    plain = ValueError("--run-dir")
    assert api_words(plain) is plain


def test_the_import_finds_no_launcher_and_starts_nothing():
    code = "import sys, flodl_mpi; print('mpi4py.MPI' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         env=launch_env()).stdout
    assert out.split() == ["False", "False"]




# ---- an own loop's events and failures reach train.log, as fit's and the CLI's --------------------

NAN_LOOP = """
    import sys
    import torch, flodl_mpi
    run_dir, who = sys.argv[1], sys.argv[2]
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with flodl_mpi.Averager(model, optimizer=opt, run_dir=run_dir) as avg:
        for epoch in range(2):
            for i in range(4):
                opt.zero_grad()
                loss = model(torch.ones(3, 2)).pow(2).mean()
                if avg.global_step == 5 and (who == "all" or avg.rank == 1):
                    loss = loss * float("nan")  # the 6th call (sync: round 5) of rank 1, or of every rank
                loss.backward()
                opt.step()
                avg.step(loss)
            avg.end_epoch()
    print("finished", flush=True)
"""


def test_a_quarantine_in_an_own_loop_is_logged(shared_own_loop):
    """Rank 1's NaN loss in round 5: rank 0 says so in train.log and on the terminal, as fit does (was: silent).
    The launch is `SHARED_OWN_LOOP`'s (NAN_LOOP's loop with who="one", after the spawned worker)."""
    proc, _, run_dir = shared_own_loop
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = ("round 5: rank(s) 1 had a non-finite loss or NaN/Inf parameters: quarantined (mass 0), "
            "adopted the consensus")
    log = (run_dir / "train.log").read_text()
    assert log.count(line) == 1 and proc.stderr.count(line) == 1, proc.stderr[-2000:]
    assert log.index(line) < log.index("epoch 2 ")  # logged in its epoch, when it happened
    assert "finished" in proc.stdout


def test_an_own_loop_failure_ends_train_log_with_the_reason(tmp_path):
    """Every rank's loss NaN in round 5: exit 1, and train.log's last line is the reason (was: nothing).
    At a world of 1, forked (was 2 ranks): no rank is finite needs no peer, and the line names the one rank."""
    proc, took = _run(tmp_path, NAN_LOOP, str(tmp_path / "run"), "all", ranks=1)
    assert took < PROMPT_S
    assert proc.returncode == 1, proc.stderr[-2000:]
    # the NaN loss's gradients made the step's parameters NaN too
    why = ("non-finite values in round 5: rank(s) 0 (loss and parameters/buffers) "
           "had NaN or infinite values; no rank is finite")
    assert proc.stderr.count(why) == 1  # the path reached: the cohort's non-finite verdict
    last = (tmp_path / "run" / "train.log").read_text().splitlines()[-1]
    assert last.split(" ", 1)[1].startswith(f"run failed: NonFiniteError: {why}"), last
    assert "finished" not in proc.stdout


# ---- issue 7 left: a non-finite stop in the API's words; the cut-short epoch's batch rows -------------------------

FIT_NAN = """
    import torch, flodl_mpi
    from flodl_mpi.runtime.launcher import launcher_rank

    def step(model, batch):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(model(x), y)
        return loss * float("nan") if launcher_rank() == 1 else loss   # rank 1 diverges at once

    flodl_mpi.fit(train_step=step, epochs=2, on_non_finite="stop", eval_every=0).wait()
    print("not reached", flush=True)
"""


@pytest.mark.parametrize("shape", ["own-loop", "fit"])
def test_a_non_finite_stop_names_the_api_keyword(tmp_path, shape):
    """Issue 7 left: the stop's message named the CLI's `--on-non-finite stop` in the API."""
    if shape == "fit":
        proc, took = _run(tmp_path, FIT_NAN)
        first = "non-finite values in round 0: rank(s) 1 (loss"
    else:
        script = NAN_LOOP.replace("run_dir=run_dir)", "run_dir=run_dir, on_non_finite='stop')")
        proc, took = _run(tmp_path, script, str(tmp_path / "run"), "one")
        first = "non-finite values in round 5: rank(s) 1 (loss"
    assert took < PROMPT_S
    assert proc.returncode == 1, proc.stderr[-2000:]
    words = "had NaN or infinite values; on_non_finite='stop', so the job stops (training diverged? lower the learning"
    assert proc.stderr.count(f"flodl-mpi: error: {first}") == 1, proc.stderr[-2000:]  # the path: the stop verdict
    assert proc.stderr.count(words) == 1 and "--on-non-finite" not in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "not reached" not in proc.stdout and "finished" not in proc.stdout
    if shape == "own-loop":
        last = (tmp_path / "run" / "train.log").read_text().splitlines()[-1]
        assert f"run failed: NonFiniteError: {first}" in last and words in last, last


def _assert_every_batch_is_recorded(run_dir, global_steps: dict[int, int]) -> None:
    """metrics.h5's batches table holds one row per realized step of each rank: steps 1..global_step."""
    from flodl_mpi.outputs.metrics import read_table

    b = read_table(run_dir / "metrics.h5", "batches")
    for rank, n in global_steps.items():
        np.testing.assert_array_equal(np.sort(b["step"][b["rank"] == rank]), np.arange(1, n + 1))
    assert len(b["step"]) == sum(global_steps.values())


def test_a_stopped_own_loop_records_the_batches_of_the_epoch_it_cut_short(stopped_own_loop):
    """Issue 7 left: the stop's epoch had its rounds in metrics.h5 but not its batches (`stopped_own_loop`'s run)."""
    from flodl_mpi.outputs.checkpoint import latest_checkpoint, read_checkpoint, read_rank_state

    run_dir = _stop_own_loop(stopped_own_loop)
    latest = latest_checkpoint(run_dir / "checkpoints")
    meta = read_checkpoint(latest).meta
    assert not meta["epoch_complete"]  # a step()'s round carried the stop: always within an epoch
    steps = {r: read_rank_state(latest, r)[1]["global_step"] for r in (0, 1)}
    assert steps[0] == steps[1] > 8 * meta["epoch"]  # steps of the epoch cut short
    _assert_every_batch_is_recorded(run_dir, steps)
    assert meta["metrics_rows"]["batches"] == sum(steps.values())  # a resume keeps them


UNEVEN_WITH = """
    import sys
    import torch, flodl_mpi
    from flodl_mpi.runtime.launcher import launcher_rank
    with flodl_mpi.Averager(torch.nn.Linear(2, 1), run_dir=sys.argv[1]) as avg:
        for epoch in range(2):
            for i in range(8 if launcher_rank() == 0 or epoch == 0 else 7):   # rank 1's loader is one short
                avg.step(0.5)
            avg.end_epoch()
    print("not reached", flush=True)
"""


def test_uneven_step_counts_record_the_batches_each_rank_trained(tmp_path):
    """Issue 7 left: the epoch the uneven counts ended had no batch rows; each rank's are there now."""
    proc, took = _run(tmp_path, UNEVEN_WITH, str(tmp_path / "run"))
    assert took < PROMPT_S
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.count("flodl-mpi: error: the ranks called step() a different number of times in this epoch "
                             "(rank 0 in step() call 8; rank 1 in end_epoch() after 7 step() call(s))") == 1
    _assert_every_batch_is_recorded(tmp_path / "run", {0: 16, 1: 15})


# ---- issue 7 left: a stop signal after the import, before the run opens --------------------------------------------

BEFORE_RUN = """
    import sys, time
    from pathlib import Path
    import flodl_mpi   # under a launcher: MPI starts here
    run_dir, marker = sys.argv[1], Path(sys.argv[2])
    if flodl_mpi.runtime.launcher.launcher_rank() == 0:
        marker.write_text("imported")
    time.sleep(100)    # the script's own setup: loading its data
    flodl_mpi.fit(epochs=2, run_dir=run_dir).wait()
    print("not reached", flush=True)
"""


@pytest.mark.parametrize("signame, target", [("SIGTERM", "ranks"), ("SIGUSR1", "ranks"), ("SIGINT", "launcher")],
                         ids=["sigterm-every-rank", "sigusr1-every-rank", "ctrl-c-launcher"])
def test_a_stop_signal_before_the_run_opens_exits_4_at_once(tmp_path, signame, target):
    """Issue 7 left: between `import flodl_mpi` and fit(), Ctrl-C was exit 1 and SIGTERM 15: a job script that
    requeues on 4 dropped the job. Nothing is trained yet: the job ends now, status 4, one line."""
    if target == "launcher" and launcher_kind() != "hydra":
        pytest.skip("Open MPI's mpirun ends the job itself on a signal (its own status)")
    proc, run_dir, marker = _start_until_marked(tmp_path, BEFORE_RUN)
    try:
        assert marker.exists(), "the script did not import flodl_mpi"
        time.sleep(1)  # every rank past its import
        if target == "launcher":
            proc.send_signal(getattr(signal, signame))  # Hydra forwards it to every rank
        else:  # as scancel and Slurm's --signal do
            for pid in rank_pids(proc, str(run_dir)):
                os.kill(pid, getattr(signal, signame))
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=90)
        took = time.monotonic() - t0
    finally:
        proc.kill()
        proc.communicate()
    assert took < 60  # not the 100 s of setup: the path is the handler installed at the import
    assert proc.returncode == 4, err[-3000:]
    assert err.count(f"flodl-mpi: {signame} before the run opened (flodl_mpi.fit or Averager): nothing trained, "
                     "nothing to save; exit status 4") == 1, err[-3000:]
    assert "Traceback" not in err and "not reached" not in out and "BAD TERMINATION" not in out + err
    assert not run_dir.exists()


def test_the_scripts_own_handlers_come_back_after_the_run(shared_own_loop):
    """The import's handler lasts until the first run opens; after the last run, the script's own come back.
    The launch is `SHARED_OWN_LOOP`'s (its asserts at the import: a failed one is exit 1 here)."""
    proc, took, _ = shared_own_loop
    assert took < PROMPT_S
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("after True True") == 2, proc.stdout
