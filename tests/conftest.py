"""Shared test helpers: starting ``flodl-mpi`` under ``mpiexec`` as a user would, under either MPI.

One helper knows what each launcher needs (:func:`launch_command`, :func:`launch_env`):
Open MPI's ``mpiexec`` refuses more ranks than cores without ``--oversubscribe``
and refuses root without its two ``OMPI_ALLOW_RUN_AS_ROOT*`` variables; MPICH's
Hydra needs neither. Every child launcher starts from a clean environment: no
``PMI_*`` / ``PMIX_*`` / ``OMPI_*`` left over from a launcher that started this
process (``tests/run.sh`` runs pytest itself under ``mpiexec``).

The serial pytest process never initialises MPI: importing ``mpi4py.MPI`` there
only loads the library (``mpi4py.rc.initialize = False``, set in
:func:`pytest_configure`); the tests that need MPI are marked ``mpi`` and run
under ``mpiexec ... --with-mpi``, where importing it starts MPI as usual.

Which tests start processes, and how many launchers a session started: ``tests/_launches.py``
(registered by :func:`pytest_sessionstart`; the ``launch`` and ``quick`` markers).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mpi4py
import pytest

from tests import _launches


def pytest_configure(config):
    """A serial run (no ``--with-mpi``): importing ``mpi4py.MPI`` loads the library but must not start MPI."""
    if not config.getoption("--with-mpi", default=False) and "mpi4py.MPI" not in sys.modules:
        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False

MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")

#: Variables a launcher sets in the processes it starts; a child launcher must not inherit them.
LAUNCHER_VARS_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "HYDI_", "HYDRA_", "PRTE_", "OPAL_", "MPI_LOCAL", "SLURM_")


@functools.cache
def launcher_kind(mpiexec: str | None = None) -> str:
    """``"openmpi"`` or ``"hydra"`` (MPICH), from ``mpiexec --version``."""
    out = subprocess.run([mpiexec or MPIEXEC, "--version"], capture_output=True, text=True, timeout=60, check=False,
                         env=launch_env(kind="unknown")).stdout
    return "openmpi" if "open mpi" in out.lower() or "open-mpi" in out.lower() else "hydra"


def launch_env(extra: dict | None = None, kind: str | None = None) -> dict:
    """A clean environment for a child launcher: this one's, less any launcher's leftovers, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARS_PREFIXES)}
    kind = kind or launcher_kind()
    if kind == "openmpi" and os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.update(extra or {})
    return env


def launch_argv(n: int, *argv: str) -> list[str]:
    """``mpiexec [what this launcher needs] -n N ARGV``."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    _launches.LAUNCHES.record(n)
    flags = ["--oversubscribe"] if launcher_kind() == "openmpi" else []
    return [MPIEXEC, *flags, "-n", str(n), *argv]


def launch_command(n: int, *args: str) -> list[str]:
    """``mpiexec [what this launcher needs] -n N python -m flodl_mpi ARGS``."""
    return launch_argv(n, sys.executable, "-m", "flodl_mpi", *args)


def run_flodl(n: int, *args: str, timeout: float = 240.0, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``flodl-mpi ARGS`` on N ranks with a hard timeout; returns the finished process."""
    return subprocess.run(launch_command(n, *args), capture_output=True, text=True, timeout=timeout, check=False,
                          env=launch_env(env))


def start_flodl(n: int, *args: str, env: dict | None = None) -> subprocess.Popen:
    """Start ``flodl-mpi ARGS`` on N ranks in the background (stdout and stderr piped, text)."""
    return subprocess.Popen(launch_command(n, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=launch_env(env))


def rank_pids(launcher: subprocess.Popen, marker: str) -> list[int]:
    """The pids of the ranks a launcher started, found by a string unique to their command line."""
    out = subprocess.run(["pgrep", "-f", "--", marker], capture_output=True, text=True, check=False).stdout.split()
    return [int(p) for p in out if int(p) != launcher.pid and "mpiexec" not in _cmdline(int(p))
            and "prterun" not in _cmdline(int(p))]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def flip_data_byte(path, group: str, name: str) -> None:
    """Flip one byte inside a checkpoint dataset's stored data (not its header), so its
    Fletcher-32 checksum fails; ``name`` is the state-dict name (escaped as stored)."""
    import h5py

    from flodl_mpi.outputs.checkpoint import escape_name

    with h5py.File(path, "r") as f:
        ds = f[group][escape_name(name)]
        offset = ds.id.get_chunk_info(0).byte_offset if ds.chunks else ds.id.get_offset()
    with open(path, "r+b") as fh:
        fh.seek(offset + 5)
        byte = fh.read(1)
        fh.seek(offset + 5)
        fh.write(bytes([byte[0] ^ 0xFF]))


def pytest_sessionstart(session):
    """The ``launch`` marker and the launchers' count (``tests/_launches.py``), for every run of the suite."""
    if not session.config.pluginmanager.is_registered(_launches):
        session.config.pluginmanager.register(_launches, "flodl-launches")
