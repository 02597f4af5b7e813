"""A rank's death, a shrink, then the survivors' exit: the smallest run of what ends every shrunk ``flodl-mpi`` job.

Launched as ``mpiexec --with-ft ulfm -n 3 python tests/elastic/shrink_then_exit.py [--plain]``: MPI starts
through `flodl_mpi.runtime.startup.start_mpi` (``--plain``: ``from mpi4py import MPI`` alone, Open MPI's own
defaults), rank 1 kills itself (SIGKILL) after a few Allreduces, the survivors' next Allreduce fails, they
revoke and shrink (`flodl_mpi.runtime.elastic`), meet in a barrier, print ``rank R: shrunk to 2`` and exit
(``MPI_Finalize`` at interpreter exit). tests/elastic/test_elastic.py launches it; with ``--plain`` it shows the
hang `flodl_mpi.runtime.startup.fault_tolerant_finalize` removes (docs/elastic.rst, "Measured").
"""

from __future__ import annotations

import os
import signal
import sys

import numpy as np


def main(argv: list[str]) -> int:
    if "--plain" in argv:
        from mpi4py import MPI
    else:
        from flodl_mpi.runtime.startup import start_mpi

        MPI = start_mpi()
    from flodl_mpi.runtime.elastic import is_rank_failure, revoke, shrink

    comm = MPI.COMM_WORLD.Dup()
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    x = np.ones(1000)
    for _ in range(5):
        comm.Allreduce(MPI.IN_PLACE, x)
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        for _ in range(100):
            comm.Allreduce(MPI.IN_PLACE, x)
    except MPI.Exception as exc:
        if not is_rank_failure(exc):
            raise
        revoke(comm)
        survivors = shrink(MPI.COMM_WORLD)
        survivors.comm.Barrier()
        fence = os.environ.get("OMPI_MCA_async_mpi_finalize", "unset")  # (flodl_mpi.runtime.startup sets it)
        print(f"rank {comm.rank}: shrunk to {survivors.comm.size} (failed {list(survivors.failed)}); "
              f"OMPI_MCA_async_mpi_finalize={fence}", flush=True)
        return 0
    print(f"rank {comm.rank}: no failure seen", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
