"""Read back one run directory for tests/slurm/check.sh; prints one JSON object.

    python tests/slurm/inspect_run.py RUN_DIR

Fields: world_size (metrics.h5 root attribute), epochs (the epochs table's epoch
column), rounds (the rounds table's row count), rounds_continuous (the round
column is exactly 0..rows-1: no gap and no repeat across attempts),
last_epoch_rounds (the epochs table's rounds column, last row), checkpoints
(file name -> reason), error (why the directory could not be read, else null).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import h5py
import numpy as np


def inspect(run_dir: Path) -> dict:
    out: dict = {"run_dir": str(run_dir), "error": None}
    try:
        with h5py.File(run_dir / "metrics.h5", "r") as f:
            out["world_size"] = int(f.attrs["world_size"])
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


if __name__ == "__main__":
    print(json.dumps(inspect(Path(sys.argv[1]))))
