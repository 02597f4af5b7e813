#!/usr/bin/env bash
# The whole suite: serial tests, then the multi-rank tests at 2 and at 3 ranks.
# `python -m mpi4py` aborts the world when a rank fails, so a failure never hangs.
# In the multi-rank stages rank 0 prints pytest's report; every other rank writes
# its own to a file, printed only if the stage fails (so a failing rank is shown).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pytest -q "$@"
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
for n in 2 3; do
    echo "== multi-rank tests on $n ranks (rank 0's report; the others' are printed if the stage fails)"
    status=0
    mpiexec -n "$n" env PYTHONUNBUFFERED=1 bash -c '
        rank=${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-0}}
        if [ "$rank" = 0 ]; then exec "$@"; fi
        exec "$@" > "$0/rank-$rank.log" 2>&1' "$logs" \
        python -m mpi4py -m pytest -q --with-mpi -m mpi -p no:cacheprovider "$@" || status=$?
    if [ "$status" -ne 0 ]; then
        for f in "$logs"/rank-*.log; do echo "== $(basename "$f" .log) of $n:"; cat "$f"; done
        exit "$status"
    fi
done
