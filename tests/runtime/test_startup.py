"""The one MPI start-up (flodl_mpi.runtime.startup.start_mpi): its refusals, in one process, before MPI starts.

The launched runs that prove every rank says it once and exits 2 are in
tests/runtime/test_launch.py (another MPI's launcher), tests/cli/test_cli_env.py and
tests/api/test_api_faults.py (a bad FLODL_MPI_START_TIMEOUT, under the CLI and the API).
"""

import pytest

from flodl_mpi.errors import InputError
from flodl_mpi.runtime import startup

pytestmark = pytest.mark.skipif(startup.mpi_running(), reason="MPI runs in this process: start_mpi checks nothing")

LAUNCHER_VARS = ("OMPI_", "PMI_", "PMIX_", "HYDI_", "MPI_LOCAL", "SLURM_")


@pytest.fixture
def no_launcher(monkeypatch):
    """This process as if started without a launcher, MPICH loaded, one install."""
    import os

    for name in list(os.environ):
        if name.startswith(LAUNCHER_VARS):
            monkeypatch.delenv(name)
    monkeypatch.delenv(startup.START_TIMEOUT_VAR, raising=False)
    monkeypatch.setattr(startup, "mpi_library", lambda: "MPICH Version: 4.2.0")
    monkeypatch.setattr(startup, "mixed_install", lambda: None)
    return monkeypatch


def _mpi_started() -> bool:
    return startup.mpi_running()


def test_another_mpis_launcher_is_refused_before_mpi_starts(no_launcher):
    no_launcher.setenv("OMPI_COMM_WORLD_SIZE", "2")
    no_launcher.setenv("OMPI_COMM_WORLD_RANK", "0")
    with pytest.raises(InputError) as refused:
        startup.start_mpi()
    assert str(refused.value).startswith("flodl-mpi: error: started by Open MPI's")
    assert "(OMPI_COMM_WORLD_SIZE=2) but mpi4py loads MPICH (MPICH Version: 4.2.0)" in str(refused.value)
    assert not _mpi_started()


def test_a_mixed_install_is_warned_about_then_a_bad_start_timeout_refused(no_launcher):
    said = []
    no_launcher.setattr(startup, "mixed_install", lambda: "both wheels are installed")
    no_launcher.setenv(startup.START_TIMEOUT_VAR, "soon")
    with pytest.raises(InputError, match=r"^flodl-mpi: error: FLODL_MPI_START_TIMEOUT='soon': must be a number of "
                                         r"seconds > 0$"):
        startup.start_mpi(warn=said.append)
    assert said == ["flodl-mpi: warning: both wheels are installed"]  # in that order, each once
    assert not _mpi_started()


@pytest.mark.parametrize("text, want", [("", 120.0), ("  ", 120.0), ("2.5", 2.5)])
def test_the_start_timeout(text, want):
    assert startup.start_timeout({startup.START_TIMEOUT_VAR: text}) == want


@pytest.mark.parametrize("text", ["0", "-1", "inf", "nan", "soon"])
def test_a_bad_start_timeout(text):
    with pytest.raises(InputError, match="must be a number of seconds > 0"):
        startup.start_timeout({startup.START_TIMEOUT_VAR: text})


@pytest.mark.parametrize(
    "env, after, changed",
    [
        ({"OMPI_MCA_mpi_ft_enable": "1"}, "1", True),  # mpiexec --with-ft ulfm: the closing fence is skipped
        ({"OMPI_MCA_mpi_ft_enable": "1", startup.ASYNC_FINALIZE_VAR: "0"}, "0", False),  # the user's setting kept
        ({"OMPI_MCA_mpi_ft_enable": "0"}, None, False),  # Open MPI without fault tolerance: nothing changed
        ({}, None, False),  # MPICH, or no launcher
    ],
)
def test_the_finalize_fence_is_skipped_only_under_fault_tolerance(env, after, changed):
    """(The hang it removes, and that a shrunk run's survivors exit: tests/elastic/test_elastic.py.)"""
    env = dict(env)
    before = {k: v for k, v in env.items() if k != startup.ASYNC_FINALIZE_VAR}
    assert startup.fault_tolerant_finalize(env) is changed
    assert env.get(startup.ASYNC_FINALIZE_VAR) == after
    assert {k: v for k, v in env.items() if k != startup.ASYNC_FINALIZE_VAR} == before  # nothing else touched
