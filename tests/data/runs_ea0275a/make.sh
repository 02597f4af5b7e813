#!/usr/bin/env bash
# Makes the run directories of this folder with the landed version ea0275a (flodl-mpi 0.1.0,
# before the sub-packages), and the references its own resumes give. Run from this folder:
#   git -C /work/main worktree add /work/wt/old ea0275a
#   OLD=/work/wt/old bash make.sh
# (MPICH's mpiexec and torch from /work/main/.venv). Everything runs on 2 ranks, one thread each.
set -euo pipefail
OLD=${OLD:-/work/wt/old}
HERE=$(cd "$(dirname "$0")" && pwd)
WORK=$(mktemp -d /tmp/flodl-old-runs.XXXXXX)
export PYTHONPATH=$OLD
cd "$WORK"
cp "$HERE/tiny_model.py" "$HERE/averager_loop.py" .
CLI=(train --model tiny_model.py:model --threads 1 --checkpoint-every 1)

# cli_done: 2 complete epochs (23 rounds each), checkpoints after epochs 1 and 2.
mpiexec -n 2 python -m flodl_mpi "${CLI[@]}" --run-dir cli_done --epochs 2
# cli_stopped: stopped in epoch 2 after round 30 (as if SIGUSR1 had come), exit status 4:
# its newest checkpoint is mid-epoch (cursor 14, epoch_reports).
mpiexec -n 2 python "$OLD/tests/hooked_flodl.py" --stop-at-round 30 -- "${CLI[@]}" --run-dir cli_stopped \
    --epochs 2 || test $? -eq 4
# averager_cut: 2 epochs of an own loop, then 3 step() calls into epoch 3 and close(): saved incomplete.
mpiexec -n 2 python averager_loop.py averager_cut 3 3

# References: what the old version's own resume gives (kept as the final params and the epoch rows).
mkdir -p reference
cp -r cli_done ref_done && mpiexec -n 2 python -m flodl_mpi "${CLI[@]}" --run-dir ref_done --epochs 3 --resume
cp -r cli_stopped ref_stopped && mpiexec -n 2 python -m flodl_mpi "${CLI[@]}" --run-dir ref_stopped --epochs 2 --resume
cp -r averager_cut ref_averager && mpiexec -n 2 python averager_loop.py ref_averager 3 0 --resume \
    --out reference/averager_cut.npz
python - <<'PY'
import json
import h5py
import numpy as np
import flodl_mpi.checkpoint as c
for name, src in (("cli_done", "ref_done"), ("cli_stopped", "ref_stopped")):
    ck = c.read_checkpoint(c.latest_checkpoint(f"{src}/checkpoints"), ranks=[])
    np.savez(f"reference/{name}.npz", **ck.params, **ck.buffers)
    with h5py.File(f"{src}/metrics.h5", "r") as f:
        rows = {"avg_loss": f["epochs/avg_loss"][()].tolist(), "test_accuracy": f["epochs/test_accuracy"][()].tolist(),
                "round": int(ck.meta["round"]), "epoch": int(ck.meta["epoch"]), "checkpoint": ck.path.name}
    json.dump(rows, open(f"reference/{name}.json", "w"), indent=1)
PY
# The run dirs as written, packed (their metrics.h5 are mostly preallocated chunks: 3.5 MB each, 20 kB packed).
rm -rf "$HERE/reference" "$HERE/runs.tar.gz"
tar --sort=name --owner=0 --group=0 --mtime=@0 -czf "$HERE/runs.tar.gz" cli_done cli_stopped averager_cut
cp -r reference "$HERE/"
du -sh "$HERE"
echo "made in $WORK"
