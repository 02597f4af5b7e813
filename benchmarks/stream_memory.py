"""Each rank's peak resident memory, streamed against in-memory data, on a file made large for it (issue 22).

    python benchmarks/stream_memory.py [--ranks 2] [--rows 60000] [--features 1024] [--epochs 1]

Writes a file of ``rows`` training rows of ``features`` float32 features (random values, labels
0..9; 2,000 test rows) to a temporary directory, then runs ``flodl-mpi train`` on it twice under
``mpiexec -n ranks``, ``--data-loading memory`` and ``--data-loading stream`` (batch 256, the
built-in MLP, one epoch). Each rank runs the CLI's ``main`` in process and then reports its
peak resident set (``VmHWM`` of /proc/self/status). Prints per mode each rank's peak MiB,
the training features' size, how much less each rank held streaming, and whether both runs
reached the same test accuracy (they train on the same float32 values, bit for bit).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import h5py
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.runs import MPIEXEC, _env  # noqa: E402

MODES = ("memory", "stream")


def write_file(path: Path, rows: int, features: int) -> int:
    """``rows`` x ``features`` float32 training rows, 2,000 test rows, in chunks; returns the train features' bytes."""
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        for split, n in (("train", rows), ("test", 2000)):
            x = f.create_dataset(f"{split}/x", shape=(n, features), dtype=np.float32)
            for lo in range(0, n, 4096):
                x[lo : min(lo + 4096, n)] = rng.normal(size=(min(4096, n - lo), features)).astype(np.float32)
            f[f"{split}/y"] = rng.integers(0, 10, size=n)
    return 4 * rows * features


def peak_mib() -> float:
    """This process's peak resident set (``VmHWM``) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def child(argv: list[str]) -> None:
    """One rank: the CLI's ``train`` in process, then ``PEAK {rank, mib}`` on stdout."""
    from flodl_mpi.cli.main import main as cli_main

    rc = cli_main(argv)
    rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    print("PEAK " + json.dumps({"rank": rank, "mib": peak_mib(), "rc": rc}), flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rows", type=int, default=60000)
    p.add_argument("--features", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=1)
    args = p.parse_args(argv)
    from flodl_mpi.outputs.metrics import read_table

    with tempfile.TemporaryDirectory(prefix="flodl-stream-mem-") as tmp:
        path = Path(tmp) / "big.h5"
        size = write_file(path, args.rows, args.features)
        print(
            f"{path.stat().st_size / 2**20:.0f} MiB file; training features {size / 2**20:.0f} MiB as float32; "
            f"{args.ranks} ranks"
        )
        peaks, accuracy = {}, {}
        for mode in MODES:
            run_dir = Path(tmp) / mode
            cmd = [
                MPIEXEC,
                "-n",
                str(args.ranks),
                sys.executable,
                __file__,
                "--child",
                "train",
                "--data",
                str(path),
                "--data-loading",
                mode,
                "--epochs",
                str(args.epochs),
                "--batch-size",
                "256",
                "--run-dir",
                str(run_dir),
                "-q",
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=_env())
            if proc.returncode != 0:
                raise RuntimeError(f"{mode}: exited {proc.returncode}:\n{proc.stderr[-2000:]}")
            got = [json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("PEAK ")]
            peaks[mode] = sorted((g["rank"], g["mib"]) for g in got)
            accuracy[mode] = float(read_table(run_dir / "metrics.h5", "epochs")["test_accuracy"][-1])
        for mode in MODES:
            print(f"{mode:>6}: peak resident MiB per rank " + ", ".join(f"rank {r} {m:.0f}" for r, m in peaks[mode]))
        saved = [m - s for (_, m), (_, s) in zip(peaks["memory"], peaks["stream"])]
        print(
            "streaming held less per rank: "
            + ", ".join(f"{d:.0f} MiB" for d in saved)
            + f" (the training features are {size / 2**20:.0f} MiB)"
        )
        print(f"same test accuracy: {accuracy['memory'] == accuracy['stream']} ({accuracy['stream']:.4f})")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2:])
    else:
        main()
