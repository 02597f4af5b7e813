"""Average rarely, converge anyway: outer optimizers against a round after every batch.

For each dataset, 2 ranks: ``--policy sync`` (plain averaging after every batch),
then windows of 10, 50 and 200 batches with ``--outer avg``, ``slowmo`` and
``nesterov`` at their default outer learning rate and momentum (SlowMo 1.0/0.5,
DiLoCo 0.7/0.5 since issue 24 item 4; the docs' tables measured before it ran at momentum 0.9:
``--outer-momentum 0.9`` reruns them); a window of 1 is ``--policy sync`` with that outer step. Every run
uses the defaults otherwise (``--average-optimizer-state auto``: Adam's state
averaged, ``corrected``; SGD's not, ``off``; the inner state kept across outer
steps). Reports final and best test accuracy at equal epochs, the test loss at its
lowest and at the end, rounds and bytes each rank put into Allreduce, the bytes saved
against sync, and the epoch at which the run's going-wrong warning
(``flodl_mpi.protocol.outer_watch``) fired, if it did::

    . .venv/bin/activate && pip install mnist1d
    python benchmarks/outer.py                        # every dataset (about 25 minutes here)
    python benchmarks/outer.py --datasets digits --windows 1 5 10 20 50 --outer-momentum 0.9 --json out.json
    python benchmarks/outer.py --datasets mnist1d-adam --windows 50 --outers slowmo --lr 4e-3 --no-sync --outer-momentum 0.9
    python benchmarks/outer.py --datasets digits --windows 10 --outers nesterov --no-sync --extra=--outer-reset-inner

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


def _watch(outer: str, res: dict) -> int | None:
    """The epoch (1-based) at which the run's going-wrong warning fired, from its training losses; None: never."""
    from flodl_mpi.protocol.outer_watch import OuterWatch

    watch = OuterWatch(outer, 1.0, 0.0)
    for epoch, loss in enumerate(res["train_loss"]):
        if watch.observe(epoch, loss) is not None:
            return epoch + 1
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--datasets", nargs="+", choices=sorted(DATASETS), default=["digits", "mnist1d", "mnist1d-adam"])
    p.add_argument("--windows", nargs="+", type=int, default=[10, 50, 200])
    p.add_argument("--outers", nargs="+", default=["avg", "slowmo", "nesterov"])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--epochs", type=int, help="override every dataset's epochs (quick looks)")
    p.add_argument("--lr", help="override every dataset's inner learning rate")
    p.add_argument("--extra", nargs="*", default=[],
                   help="more flodl-mpi train options for every run (one flag: --extra=--outer-reset-inner)")
    p.add_argument("--outer-momentum", help="--outer-momentum for the slowmo and nesterov rows (default: the "
                   "product's, 0.5 since issue 24 item 4; the docs' tables before it ran at 0.9)")
    p.add_argument("--outer-lr", help="--outer-lr for the slowmo and nesterov rows (default: the product's)")
    p.add_argument("--no-sync", action="store_true", help="leave out the plain --policy sync row")
    p.add_argument("--json", help="write every run's per-epoch results here")
    args = p.parse_args()

    results = []
    for name in args.datasets:
        base = list(DATASETS[name])
        if name.startswith("mnist1d"):
            base += ["--data", str(mnist1d_file())]
        if args.epochs:
            base[base.index("--epochs") + 1] = str(args.epochs)
        if args.lr:
            base[base.index("--lr") + 1] = args.lr
        base += args.extra
        rows = [] if args.no_sync else [("sync", 1, "avg", ["--policy", "sync"])]
        for w in args.windows:
            for o in args.outers:
                if w == 1 and o == "avg" and not args.no_sync:
                    continue  # the sync row
                step = [] if o == "avg" else ((["--outer-momentum", args.outer_momentum] if args.outer_momentum else [])
                                              + (["--outer-lr", args.outer_lr] if args.outer_lr else []))
                rows.append(("sync" if w == 1 else "window", w, o,
                             (["--policy", "sync"] if w == 1 else ["--window", str(w)]) + ["--outer", o] + step))
        for policy, window, outer, extra in rows:
            res = run_flodl(args.ranks, base + extra)
            res.update(dataset=name, policy=policy, window=window, outer=outer, watch=_watch(outer, res))
            results.append(res)
            print(f"{name:8s} {policy:6s} {window:4d} {outer:9s} final {res['test_accuracy'][-1]:.4f} "
                  f"best {max(res['test_accuracy']):.4f} test loss {min(res['test_loss']):.3f}->"
                  f"{res['test_loss'][-1]:.3f} rounds {res['rounds']:6d} {res['bytes_per_rank'] / 1e6:9.2f} MB "
                  f"warned {res['watch'] or '-'}", flush=True)
    print()
    print("| data | window | outer | final acc | best acc | test loss lowest -> last | rounds | MB per rank | "
          "bytes vs sync | warned at epoch |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        sync = next((s for s in results if s["dataset"] == r["dataset"] and s["policy"] == "sync"
                     and s["outer"] == "avg"), None)
        ratio = f"{sync['bytes_per_rank'] / max(r['bytes_per_rank'], 1):.0f}x fewer" if sync else "-"
        label = "sync (1)" if r["policy"] == "sync" else str(r["window"])
        print(f"| {r['dataset']} | {label} | {r['outer']} | {r['test_accuracy'][-1]:.4f} | "
              f"{max(r['test_accuracy']):.4f} | {min(r['test_loss']):.3f} -> {r['test_loss'][-1]:.3f} | "
              f"{r['rounds']} | {r['bytes_per_rank'] / 1e6:.2f} | {'1x' if r is sync else ratio} | "
              f"{r['watch'] or '-'} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
