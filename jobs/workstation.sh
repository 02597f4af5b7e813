#!/usr/bin/env bash
# flodl-mpi on one workstation: one rank per GPU (or N ranks on the CPU).
#
#   jobs/workstation.sh                 # one rank per visible GPU; 2 CPU ranks without one
#   jobs/workstation.sh 4 --epochs 30   # 4 ranks; the rest goes to `flodl-mpi train`
#
# Run it with the project's virtual environment active: its `mpiexec` is the one
# that came with the `mpich` wheel, the MPI mpi4py uses. A launcher from another
# MPI would start N separate one-rank jobs; flodl-mpi sees that and exits 2.
set -euo pipefail

if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then
    n=$1; shift
elif command -v nvidia-smi >/dev/null && n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU') && [[ $n -gt 0 ]]; then
    :   # one rank per GPU; rank r takes GPU (local rank r) mod (visible GPUs)
else
    n=2 # no GPU: ranks share the CPU cores (flodl-mpi gives each rank cores/N torch threads)
fi

# -n: ranks. The MPICH wheel's Hydra mpiexec oversubscribes without extra flags
# and forwards SIGINT/SIGTERM/SIGUSR1 to the ranks, so Ctrl-C or `kill -USR1`
# on this script's mpiexec stops the run at the next round with a checkpoint.
exec mpiexec -n "$n" flodl-mpi train "$@"
