"""Read back one run directory for tests/slurm/check.sh; prints one JSON object.

    python tests/slurm/inspect_run.py RUN_DIR [--states DIR] [--reference RUN_DIR]

Fields: world_size and hosts (metrics.h5 root attributes: hosts is every rank's
host name, in rank order), epochs (the epochs table's epoch
column), rounds (the rounds table's row count), rounds_continuous (the round
column is exactly 0..rows-1: no gap and no repeat across attempts),
last_epoch_rounds (the epochs table's rounds column, last row), checkpoints
(file name -> reason), error (why the directory could not be read, else null).
With --states DIR (the per-rank dumps tests/slurm/paced_model.py writes under
FLODL_STATE_DIR): state_hosts and state_nodes (each rank's host name and
SLURMD_NODENAME, rank order), identical (every floating-point tensor of the model
the same bits on every rank; integer buffers such as BatchNorm's batch count are
each rank's own). With --reference RUN_DIR: equals_reference (the newest
checkpoint's model the same bits as the newest checkpoint of RUN_DIR, e.g. an
uninterrupted run of the same options).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import h5py
import numpy as np


def inspect(run_dir: Path) -> dict:
    out: dict = {"run_dir": str(run_dir), "error": None}
    try:
        with h5py.File(run_dir / "metrics.h5", "r") as f:
            out["world_size"] = int(f.attrs["world_size"])
            out["hosts"] = json.loads(f.attrs["hosts"])
            out["epochs"] = [int(e) for e in f["epochs/epoch"][:]]
            rounds = np.asarray(f["rounds/round"][:], dtype=np.int64)
            out["rounds"] = int(rounds.size)
            out["rounds_continuous"] = bool(np.array_equal(rounds, np.arange(rounds.size)))
            out["last_epoch_rounds"] = int(f["epochs/rounds"][-1]) if f["epochs/rounds"].size else None
        out["checkpoints"] = {}
        for path in sorted((run_dir / "checkpoints").glob("*.h5")):
            with h5py.File(path, "r") as c:
                out["checkpoints"][path.name] = str(c.attrs.get("reason", ""))
    except (OSError, KeyError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def inspect_states(states: Path) -> dict:
    """Every rank's dump in ``states`` (rank0.npz, rank1.npz, ...): hosts, nodes, identical (see the module)."""
    dumps = []
    while (states / f"rank{len(dumps)}.npz").exists():
        with np.load(states / f"rank{len(dumps)}.npz") as z:
            dumps.append(dict(z))
    floats = [k for k, v in dumps[0].items() if k.startswith("state/") and v.dtype.kind == "f"] if dumps else []
    return {
        "state_hosts": [str(d["host"]) for d in dumps],
        "state_nodes": [str(d["node"]) for d in dumps],
        "identical": bool(floats) and all(np.array_equal(dumps[0][k], d[k]) for d in dumps for k in floats),
    }


def same_final_model(run_dir: Path, reference: Path) -> bool:
    """Whether the newest checkpoints of the two runs hold the same model, bit for bit (same names too)."""
    from flodl_mpi.outputs.checkpoint import latest_checkpoint, load_state_dict

    paths = [latest_checkpoint(d / "checkpoints") for d in (run_dir, reference)]
    if None in paths:
        return False
    a, b = (load_state_dict(p) for p in paths)
    return list(a) == list(b) and all(np.array_equal(a[k].numpy(), b[k].numpy()) for k in a)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--states", type=Path)
    p.add_argument("--reference", type=Path)
    args = p.parse_args()
    out = inspect(args.run_dir)
    if args.states is not None:
        out.update(inspect_states(args.states))
    if args.reference is not None:
        try:
            out["equals_reference"] = same_final_model(args.run_dir, args.reference)
        except (OSError, KeyError, ValueError) as exc:
            out["equals_reference"] = False
            out["error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out))


if __name__ == "__main__":
    main()
