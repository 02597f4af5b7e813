"""One MPI start and an Allreduce, for tests/slurm/launch_proof.sh: prints "OK <rank> <size> <sum>".

    srun --mpi=pmi2 -n 2 python tests/slurm/allreduce.py [--no-clean]

First, as ``flodl-mpi train`` does before MPI starts, removes the MPICH slab a dead
earlier step left under this step's name (flodl_mpi/runtime/stale_shm.py); ``--no-clean``
skips that, to show what happens without it.
"""

import sys

if "--no-clean" not in sys.argv:
    from flodl_mpi.cli.main import _clear_stale_shm

    _clear_stale_shm()

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
total = np.zeros(1)
comm.Allreduce(np.array([comm.rank + 1.0]), total)
assert total[0] == comm.size * (comm.size + 1) / 2, total
print(f"OK {comm.rank} {comm.size} {total[0]}", flush=True)  # one write: ranks share the pipe
