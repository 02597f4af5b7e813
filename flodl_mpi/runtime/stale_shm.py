"""Remove MPICH shared memory that an earlier Slurm job step left under this step's name.

MPICH (4.x, 5.x: the ``mpich`` wheel of the ``[mpi]`` extra) keeps a node's
shared-memory slab in ``/dev/shm/mpich_shm_<id>_<node>`` (``mpich_vci_<id>_<node>``
with several VCIs), where ``<id>`` is the 32-bit FNV-1a hash of the PMI KVS name,
in lower-case hex (``src/mpi/init/mpir_pmi.c``: ``HASH_FNV(pmi_kvs_name)``;
``src/mpid/ch4/shm/posix``: ``"mpich_shm_%x_%d"``). The first process to start
creates it (``O_EXCL``); the others open it and, once it is marked ready, use it as
it is. The slab is removed in ``MPI_Finalize``: a step whose processes were killed
(SIGKILL at the end of a preemption's grace time, a crash, a start that failed)
leaves it behind.

Under ``srun --mpi=pmi2`` the KVS name is ``<job id>.<step id>`` (``PMI_JOBID``),
and it repeats: a requeued job keeps its id and counts its steps from 0 again, and
a Slurm whose state was reset counts job ids from 1 again. The next step with that
name then opens the dead step's slab, finds it "ready" and starts on its stale
contents: ``MPI_Init`` fails with ``UCX ERROR failed to unpack address, invalid
bandwidth 0.00`` or ``Message from rank 1 and tag 7 truncated`` (in
``MPIDI_UCX_comm_set_vcis``), or leaves the other ranks waiting. Measured on
Slurm 22.05 with the mpich 5.0.2 wheel: a planted stale slab failed 5 of 5 launches
(``tests/slurm/check.sh`` has the check). MPICH's own launcher (Hydra) names its KVS
with its process id, a random number and the host, so it does not meet this.

:func:`clear_stale_segments` runs on every rank before MPI starts and removes the
slabs with this step's names that are older than the step: made before the
``slurmstepd`` that started this process began, they belong to an earlier step. A
slab another rank of this step made already (it started faster) is newer and stays.
Nothing here starts MPI; no other file is touched.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["StaleSegment", "clear_before_mpi", "clear_stale_segments", "fnv1a32", "kvs_name", "process_start_time",
           "segment_prefixes"]

#: Where POSIX shared memory lives on Linux.
SHM_DIR = Path("/dev/shm")
#: The prefixes of MPICH's named slabs (``"/mpich_shm_%x_%d"``, ``"/mpich_vci_%x_%d"`` in libmpi.so).
MPICH_PREFIXES = ("mpich_shm_", "mpich_vci_")


def fnv1a32(text: str) -> int:
    """The 32-bit FNV-1a hash of ``text``'s UTF-8 bytes, as an int in [0, 2**32).

    Offset basis 2166136261, prime 16777619 (Fowler, Noll, Vo; the ``HASH_FNV``
    of uthash, which MPICH uses for its world id).
    """
    h = 2166136261
    for byte in text.encode():
        h = ((h ^ byte) * 16777619) & 0xFFFFFFFF
    return h


def kvs_name(environ: Mapping[str, str]) -> str | None:
    """The PMI KVS name MPICH gets under ``srun --mpi=pmi2``, or ``None`` outside such a step.

    Slurm's pmi2 plugin puts it in ``PMI_JOBID`` (``"<job id>.<step id>"``);
    without that variable it is built from ``SLURM_JOB_ID`` and ``SLURM_STEP_ID``.
    ``None`` unless the process is a task of a Slurm step that speaks PMI
    (``PMI_RANK`` set, not under MPICH's Hydra, which sets ``PMI_RANK`` too but
    names its KVS uniquely).
    """
    if "PMI_RANK" not in environ or "SLURM_STEP_ID" not in environ or "SLURM_PROCID" not in environ:
        return None
    if "HYDI_CONTROL_FD" in environ or "MPI_LOCALNRANKS" in environ:  # Hydra inside an allocation
        return None
    if environ.get("PMI_JOBID"):
        return environ["PMI_JOBID"]
    job = environ.get("SLURM_JOB_ID", "")
    return f"{job}.{environ['SLURM_STEP_ID']}" if job else None


def segment_prefixes(kvs: str) -> tuple[str, ...]:
    """The file-name prefixes of MPICH's slabs for KVS name ``kvs`` (node id follows).

    E.g. ``"mpich_shm_eb421bf2_"``.
    """
    world_id = fnv1a32(kvs)
    return tuple(f"{prefix}{world_id:x}_" for prefix in MPICH_PREFIXES)


def process_start_time(pid: int | str = "self") -> float | None:
    """When process ``pid`` started, in seconds since the epoch (``time.time()``'s clock), or ``None``.

    From ``/proc/<pid>/stat`` (field 22: start time in clock ticks after boot) and
    ``/proc/uptime``; good to a clock tick (10 ms). ``None`` where ``/proc`` cannot
    be read (not Linux, the process is gone).
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError):
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # from field 3 (state) on; comm may hold blanks
    start_ticks = int(fields[22 - 3])  # field 22, starttime (proc(5))
    return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


def _step_start_time() -> float | None:
    """The start of the ``slurmstepd`` that started this process (its parent), else this process's start."""
    parent = os.getppid()
    try:
        is_stepd = Path(f"/proc/{parent}/comm").read_text().strip() == "slurmstepd"
    except OSError:
        is_stepd = False
    return process_start_time(parent) if is_stepd else process_start_time()


@dataclass(frozen=True)
class StaleSegment:
    """One slab found older than this step: its path, its owner, and whether it was removed.

    ``error`` says why it could not be removed (e.g. another user's: ``/dev/shm`` is
    sticky), else ``None``.
    """

    path: Path
    uid: int
    removed: bool
    error: str | None = None


def clear_stale_segments(environ: Mapping[str, str] | None = None, shm_dir: Path | None = None,
                         step_start: float | None = None) -> list[StaleSegment]:
    """Remove the MPICH slabs named for this Slurm step that were made before the step began.

    Args:
        environ: the environment to read the step from (default ``os.environ``).
        shm_dir: where the slabs live (default :data:`SHM_DIR`, ``/dev/shm``).
        step_start: the step's start, seconds since the epoch; default: the start
            of this process's parent ``slurmstepd`` (this process's own start when the
            parent is something else).

    Returns:
        One :class:`StaleSegment` per stale slab this call found (removed, or not and
        why); empty outside a Slurm PMI step, or when there is none. A slab
        removed meanwhile by another rank of the step is not listed. Never raises
        for a file it cannot read or remove.

    A slab counts as stale when both its modification and its status-change time
    are before ``step_start``: the step that made it was over before this one began.
    """
    kvs = kvs_name(os.environ if environ is None else environ)
    if kvs is None:
        return []
    start = _step_start_time() if step_start is None else step_start
    if start is None:
        return []
    shm_dir = SHM_DIR if shm_dir is None else shm_dir
    prefixes = segment_prefixes(kvs)
    found = []
    try:
        names = sorted(n for n in os.listdir(shm_dir) if n.startswith(prefixes))
    except OSError:
        return []
    for name in names:
        path = shm_dir / name
        try:
            st = path.stat()
        except OSError:
            continue
        if max(st.st_mtime, st.st_ctime) >= start:
            continue  # made by this step (a faster rank): in use
        try:
            path.unlink()
        except FileNotFoundError:
            continue  # another rank of this step removed it first
        except OSError as exc:
            found.append(StaleSegment(path, st.st_uid, False, exc.strerror or str(exc)))
            continue
        found.append(StaleSegment(path, st.st_uid, True))
    return found


def clear_before_mpi(library: str = "MPICH") -> None:
    """Under ``srun``, remove MPICH shared memory a dead earlier step left under this step's name.

    Else MPI_Init would start on it and fail (see :mod:`flodl_mpi.runtime.stale_shm`). Only for
    an MPICH ``library`` (:func:`flodl_mpi.runtime.launcher.mpi_library`'s name). The rank that
    removed a slab says so; one it cannot remove is reported by the node's first task.
    """
    from flodl_mpi.runtime.launcher import library_family

    if library_family(library) != "mpich":
        return
    for seg in clear_stale_segments():
        if seg.removed:
            print(f"flodl-mpi: removed {seg.path}: MPICH shared memory left by an earlier Slurm step "
                  f"with this step's name (MPI_Init would have failed on it)", file=sys.stderr, flush=True)
        elif os.environ.get("SLURM_LOCALID", "0") == "0":
            print(f"flodl-mpi: warning: cannot remove {seg.path} ({seg.error}; owner uid {seg.uid}): MPICH "
                  f"shared memory left by an earlier Slurm step with this step's name; MPI_Init will likely "
                  f"fail on it: remove it (rm {seg.path}) or ask the administrators", file=sys.stderr, flush=True)
