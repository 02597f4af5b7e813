"""Streamed against in-memory data: the data wait's share of an epoch (issue 22 item 1).

    python benchmarks/streaming.py [--ranks 2] [--epochs 4] [--repeats 3] [--batch-size 32] [--window 1]

Each repeat runs ``flodl-mpi train`` twice on the same file, ``--data-loading memory`` and
``--data-loading stream`` (the order alternating between repeats, the runs neighbours in time),
on an MNIST-1D-sized file (4,000 train and 1,000 test rows of 40 float32 features, 10 classes;
random values, written once to a temporary directory: only the sizes matter here). From each
run's ``metrics.h5`` epochs table: the data wait's share of the epoch, ``sum over ranks of
per_rank_data_ms / (ranks x epoch_ms)``, the first epoch left out (warm-up), and the epoch's
ms. Prints per mode the median share and epoch ms over the repeats, the median of the
repeats' stream / memory epoch-ms ratios, and whether every streamed run's final parameters
equal the in-memory run's bit for bit.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import h5py
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.runs import run_flodl  # noqa: E402

MODES = ("memory", "stream")


def write_file(path: Path) -> Path:
    """4,000 / 1,000 rows of 40 float32 features and labels 0..9 (MNIST-1D's sizes)."""
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        for split, n in (("train", 4000), ("test", 1000)):
            f[f"{split}/x"] = rng.normal(size=(n, 40)).astype(np.float32)
            f[f"{split}/y"] = rng.integers(0, 10, size=n)
    return path


def measure(run_dir: Path, ranks: int) -> tuple[float, float]:
    """(data share, epoch ms): medians over the epochs after the first."""
    from flodl_mpi.outputs.metrics import read_table

    epochs = read_table(run_dir / "metrics.h5", "epochs")
    share = epochs["per_rank_data_ms"].sum(axis=1) / (ranks * epochs["epoch_ms"])
    return float(np.median(share[1:])), float(np.median(epochs["epoch_ms"][1:]))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--window", type=int, default=1)
    args = p.parse_args(argv)
    from flodl_mpi.outputs.checkpoint import latest_checkpoint, read_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="flodl-stream-bench-"))
    data = write_file(tmp / "mnist1d-sized.h5")
    shares: dict[str, list[float]] = {m: [] for m in MODES}
    epoch_ms: dict[str, list[float]] = {m: [] for m in MODES}
    ratios, identical = [], True
    for r in range(args.repeats):
        params = {}
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            run_dir = tmp / f"{mode}-{r}"
            run_flodl(
                args.ranks,
                [
                    "--data",
                    str(data),
                    "--epochs",
                    str(args.epochs),
                    "--batch-size",
                    str(args.batch_size),
                    "--window",
                    str(args.window),
                    "--data-loading",
                    mode,
                    "-q",
                ],
                run_dir,
            )
            share, ms = measure(run_dir, args.ranks)
            shares[mode].append(share)
            epoch_ms[mode].append(ms)
            params[mode] = read_checkpoint(latest_checkpoint(run_dir / "checkpoints")).params
        ratios.append(epoch_ms["stream"][-1] / epoch_ms["memory"][-1])
        identical = identical and all(
            np.array_equal(params["memory"][k], params["stream"][k]) for k in params["memory"]
        )
    print(
        f"{args.ranks} ranks, {args.epochs} epochs, batch {args.batch_size}, window {args.window}, "
        f"{args.repeats} repeats (first epoch of each run left out)"
    )
    for mode in MODES:
        print(
            f"  {mode:7s} data share {statistics.median(shares[mode]):.4f} (repeats "
            f"{', '.join(f'{v:.4f}' for v in shares[mode])}), epoch {statistics.median(epoch_ms[mode]):.1f} ms"
        )
    print(f"  stream / memory epoch ms: {statistics.median(ratios):.3f} (median of the repeats' ratios)")
    print(f"  final parameters bit-identical in every repeat: {identical}")


if __name__ == "__main__":
    main()
