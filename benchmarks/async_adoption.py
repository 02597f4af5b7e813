"""Why async trails sync at equal epochs: the adoptions and the optimizer state, on MNIST-1D (issue 6).

Two ranks, rank 1 slowed 2x (``benchmarks/slowed.py``), the MNIST-1D paper's CNN, batch 32 per rank,
Adam 1e-3, 10 epochs, for each seed: the policies as a user runs them, and the same runs with the
optimizer state each rank's own (``--average-optimizer-state off``; sync, cadence and async delta
average Adam's state by default: rebuilt second moment, async adopting it by the decayed delta of
``flodl_mpi.protocol.optimizer_state.adopt_delta``), with both moments averaged (``mean``), and with a fixed
anchor (*20*: the same rounds for cadence and async before async's anchor shrank to what hides
the round; now ``--max-anchor`` is only its ceiling), and async with small anchors (*delta 3*, *delta
5*: ``--anchor N --max-anchor N``, what showed that short windows, not the adoption, were missing),
and EASGD's pull at several alphas (*easgd 0.5*, *easgd 0.25*, *easgd 1.0*: the last is the delta
adoption) with the optimizer state adopted by the same pull (the default) or each rank's own.
Prints one JSON line per run (final test accuracy,
its curve, rounds, the share of round time hidden, the 1-minute load average after it) and the
mean final accuracy per variant::

    python benchmarks/async_adoption.py                        # every variant, seeds 0 and 1 (about 30 minutes)
    python benchmarks/async_adoption.py --variants delta sync cadence --seeds 0 1 2 3   # README's table
    python benchmarks/async_adoption.py --variants sync delta "easgd 0.5" --seeds 0 1 2 --factors 1,4

Accuracy is deterministic only for sync (the balanced policies' quotas follow measured speeds).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from heterogeneous import SLOWED, flodl  # noqa: E402
from runs import mnist1d_file  # noqa: E402

FIXED = ["--anchor", "20", "--max-anchor", "20"]
VARIANTS = {
    "sync": ["--policy", "sync"],
    "cadence": ["--policy", "cadence"],
    "delta": ["--policy", "async", "--async-adopt", "delta"],
    "delta, state mean": ["--policy", "async", "--average-optimizer-state", "mean"],
    "delta, own state": ["--policy", "async", "--average-optimizer-state", "off"],
    "easgd 0.5": ["--policy", "async", "--async-adopt", "easgd"],
    "easgd 1.0": ["--policy", "async", "--async-adopt", "easgd", "--easgd-alpha", "1.0"],
    "easgd 0.25": ["--policy", "async", "--async-adopt", "easgd", "--easgd-alpha", "0.25"],
    "easgd 0.5, own state": ["--policy", "async", "--async-adopt", "easgd", "--average-optimizer-state", "off"],
    "sync, own state": ["--policy", "sync", "--average-optimizer-state", "off"],
    "cadence 20": ["--policy", "cadence", *FIXED],
    "cadence 20, own state": ["--policy", "cadence", *FIXED, "--average-optimizer-state", "off"],
    "delta 20": ["--policy", "async", *FIXED],
    "easgd 0.5 20": ["--policy", "async", "--async-adopt", "easgd", *FIXED],
    "delta 3": ["--policy", "async", "--anchor", "3", "--max-anchor", "3"],
    "delta 5": ["--policy", "async", "--anchor", "5", "--max-anchor", "5"],
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), metavar="NAME",
                   help=f"which runs (default all: {', '.join(VARIANTS)})")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--factors", default="1,2", help="per-rank slowdown factors (default 1,2)")
    p.add_argument("--keep-metrics", type=Path, metavar="DIR",
                   help="copy each run's metrics.h5 to DIR/<variant>-seed<N>.h5 (for benchmarks/guard_replay.py)")
    args = p.parse_args()
    finals: dict[str, list[float]] = {}
    for seed in args.seeds:  # the variants of one seed side by side: a load that moves touches them alike
        for name in args.variants:
            argv = ["--data", str(mnist1d_file()), "--model", f"{SLOWED}:slowed_mnist1d_cnn", "--epochs",
                    str(args.epochs), "--batch-size", "32", "--seed", str(seed), *VARIANTS[name]]
            stem = name.replace(", ", "-").replace(" ", "_")
            keep = None if args.keep_metrics is None else args.keep_metrics / f"{stem}-seed{seed}.h5"
            r = flodl(2, argv, args.factors, 10.0, keep)
            finals.setdefault(name, []).append(r["test_accuracy"][-1])
            print(json.dumps({"run": name, "seed": seed, "acc": r["test_accuracy"][-1],
                              "samples_per_s": round(r["samples_per_s"]), "mb_per_rank": round(r["mb_per_rank"], 1),
                              "curve": [round(a, 3) for a in r["test_accuracy"]], "rounds": r["rounds"],
                              "hidden": round(r["overlap"], 3), "anchor": r["anchor_last"],
                              "load": round(os.getloadavg()[0], 1)}), flush=True)
    for name, accs in finals.items():
        print(f"{name:<24} mean final test accuracy {sum(accs) / len(accs):.4f} over seeds {args.seeds}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
