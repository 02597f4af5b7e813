#!/usr/bin/env bash
# The whole suite: serial tests, then the multi-rank tests at 2 and at 3 ranks.
# `python -m mpi4py` aborts the world when a rank fails, so a failure never hangs.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pytest -q "$@"
for n in 2 3; do
    echo "== multi-rank tests on $n ranks"
    mpiexec -n "$n" python -m mpi4py -m pytest -q --with-mpi -m mpi -p no:cacheprovider "$@"
done
