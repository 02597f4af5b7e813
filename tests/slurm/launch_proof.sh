#!/usr/bin/env bash
# Repeated srun launches of the MPICH wheel, each against a planted stale slab:
#
#   bash tests/slurm/launch_proof.sh [N] [KIND]    (root; Slurm installed: tests/slurm/install.sh)
#
# KIND: allreduce (default: tests/slurm/allreduce.py, MPI start + Allreduce, about
# 2 s a launch), train (`flodl-mpi train --epochs 1`, the product's entry point,
# about 30 s), or control (allreduce.py --no-clean: without flodl-mpi's clean-up;
# each launch is expected to FAIL in MPI_Init).
#
# Before each launch `srun --mpi=pmi2 -n 2 -K ...` (a job of its own, step 0) it
# copies a slab left by killed ranks to the name MPICH will use for that job's
# KVS name "<job id>.0" (flodl_mpi/runtime/stale_shm.py), as a requeued job or a reset
# Slurm meets it. Prints one line per launch and "launches: N, failed: F".
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
n=${1:-30}
kind=${2:-allreduce}
venv=${FLODL_VENV:-$repo/.venv}
[ "$(id -u)" = 0 ] || { echo "launch_proof.sh: needs root (slurmd)" >&2; exit 2; }
. "$here/cluster.sh"
. "$venv/bin/activate"
tmp=$(mktemp -d /tmp/flodl-launch.XXXXXX)
trap 'cluster_down "$tmp/cluster"; rm -f /dev/shm/mpich_shm_${seed_id:-none}_0; rm -rf "$tmp"' EXIT
cluster_up "$tmp/cluster"
export FLODL_MPI_DATA_DIR=$tmp/data
name_of() { python -c 'import sys; from flodl_mpi.runtime.stale_shm import segment_prefixes; print(segment_prefixes(sys.argv[1])[0] + "0")' "$1"; }

# A real stale slab: two ranks that start MPI and are killed (no MPI_Finalize).
# They clear a slab an earlier cluster's job 1 may have left first, as flodl-mpi does.
srun --mpi=pmi2 -n 2 -K python -c 'from flodl_mpi.cli.main import _clear_stale_shm; _clear_stale_shm()
from mpi4py import MPI; import os, signal; MPI.COMM_WORLD.Barrier(); os.kill(os.getpid(), signal.SIGKILL)' \
    >/dev/null 2>&1 || true
seed_job=$(( $(scontrol show config | sed -n 's/^NEXT_JOB_ID *= *//p') - 1 ))
seed=/dev/shm/$(name_of "$seed_job.0")
seed_id=$(basename "$seed" | cut -d_ -f3)
[ -f "$seed" ] || { echo "launch_proof.sh: killed ranks of job $seed_job left no $seed" >&2; exit 2; }
echo "stale slab from killed job $seed_job: $seed"

case $kind in
    allreduce) cmd=(python "$here/allreduce.py") ;;
    control) cmd=(python "$here/allreduce.py" --no-clean) ;;
    train) cmd=(flodl-mpi train --epochs 1) ;;
    *) echo "launch_proof.sh: unknown kind $kind" >&2; exit 2 ;;
esac
failed=0
for i in $(seq "$n"); do
    job=$(scontrol show config | sed -n 's/^NEXT_JOB_ID *= *//p')
    cp "$seed" "/dev/shm/$(name_of "$job.0")"
    run=("${cmd[@]}")
    [ "$kind" = train ] && run+=(--run-dir "$tmp/runs/$job")
    t0=$SECONDS
    if out=$(timeout 120 srun --mpi=pmi2 -n 2 -K "${run[@]}" 2>&1) &&
        { [ "$kind" = train ] && grep -q "done: test accuracy" <<<"$out" || [ "$(grep -c '^OK .* 2 3.0' <<<"$out")" = 2 ]; }; then
        echo "launch $i (job $job): ok ($((SECONDS - t0)) s)"
    else
        failed=$((failed + 1))
        echo "launch $i (job $job): FAILED ($((SECONDS - t0)) s): $(grep -m1 -E 'ERROR|Fatal|truncated|error' <<<"$out" || tail -n1 <<<"$out")"
        rm -f "/dev/shm/$(name_of "$job.0")"
    fi
done
echo "launches: $n, failed: $failed ($kind)"
