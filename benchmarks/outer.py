"""Average rarely, converge anyway: outer optimizers against a round after every batch.

For each dataset, 2 ranks: ``--policy sync`` (plain averaging after every batch),
then windows of 10, 50 and 200 batches with ``--outer avg``, ``slowmo`` and
``nesterov`` at their default outer learning rate and momentum (SlowMo 1.0/0.9,
DiLoCo 0.7/0.9). Reports final and best test accuracy at equal epochs, rounds and
bytes each rank put into Allreduce, and the bytes saved against sync::

    . .venv/bin/activate && pip install mnist1d
    python benchmarks/outer.py                        # every dataset (about 25 minutes here)
    python benchmarks/outer.py --datasets digits --windows 10 50 --json out.json

Inner optimizer per dataset (the same for every row): ``digits``, the built-in
MLP with Adam 1e-3 for 10 epochs; ``mnist1d``, the paper's CNN with SGD 0.05,
momentum 0.9 for 40 epochs (where flodl-mpi's sync matches DDP, issue 12's
table); ``mnist1d-adam``, the same CNN with Adam 1e-3 (DiLoCo's kind of inner
optimizer).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runs import mnist1d_file, run_flodl  # noqa: E402

DATASETS = {
    "digits": ["--epochs", "10", "--optimizer", "adam", "--lr", "1e-3"],
    "mnist1d": ["--model", str(Path(__file__).resolve().parent / "models.py") + ":mnist1d_cnn",
                "--epochs", "40", "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9"],
    # DiLoCo's setting: an adaptive inner optimizer (issue 12's Adam 1e-3).
    "mnist1d-adam": ["--model", str(Path(__file__).resolve().parent / "models.py") + ":mnist1d_cnn",
                     "--epochs", "40", "--optimizer", "adam", "--lr", "1e-3"],
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--datasets", nargs="+", choices=sorted(DATASETS), default=["digits", "mnist1d", "mnist1d-adam"])
    p.add_argument("--windows", nargs="+", type=int, default=[10, 50, 200])
    p.add_argument("--outers", nargs="+", default=["avg", "slowmo", "nesterov"])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--epochs", type=int, help="override every dataset's epochs (quick looks)")
    p.add_argument("--json", help="write every run's per-epoch results here")
    args = p.parse_args()

    results = []
    for name in args.datasets:
        base = list(DATASETS[name])
        if name.startswith("mnist1d"):
            base += ["--data", str(mnist1d_file())]
        if args.epochs:
            base[base.index("--epochs") + 1] = str(args.epochs)
        rows = [("sync", 1, "avg", ["--policy", "sync"])]
        rows += [("window", w, o, ["--window", str(w), "--outer", o]) for w in args.windows for o in args.outers]
        for policy, window, outer, extra in rows:
            res = run_flodl(args.ranks, base + extra)
            res.update(dataset=name, policy=policy, window=window, outer=outer)
            results.append(res)
            print(f"{name:8s} {policy:6s} {window:4d} {outer:9s} final {res['test_accuracy'][-1]:.4f} "
                  f"best {max(res['test_accuracy']):.4f} rounds {res['rounds']:6d} "
                  f"{res['bytes_per_rank'] / 1e6:9.2f} MB", flush=True)
    print()
    print("| data | window | outer | final acc | best acc | rounds | MB per rank | bytes vs sync |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        sync = next(s for s in results if s["dataset"] == r["dataset"] and s["policy"] == "sync")
        ratio = sync["bytes_per_rank"] / max(r["bytes_per_rank"], 1)
        label = "sync (1)" if r["policy"] == "sync" else str(r["window"])
        print(f"| {r['dataset']} | {label} | {r['outer']} | {r['test_accuracy'][-1]:.4f} | "
              f"{max(r['test_accuracy']):.4f} | {r['rounds']} | {r['bytes_per_rank'] / 1e6:.2f} | "
              f"{'1x' if r is sync else f'{ratio:.0f}x fewer'} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
