"""flodl_mpi: MPI-launched PyTorch training with work-weighted parameter averaging.

Every rank trains its own replica; a background bridge thread per rank averages
the parameters across ranks with MPI Allreduce, weighting each rank by the
optimizer steps it actually took since the last round (SPEC §1-2), and rank 0
writes metrics and checkpoints to HDF5.
"""

__version__ = "0.1.0"
