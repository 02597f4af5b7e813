"""Uneven ranks side by side: sync, window, cadence and async against DDP over gloo (issue 6).

Two ranks, rank 1 slowed 2x and 4x (``benchmarks/slowed.py``: every training forward
sleeps ``FLODL_SLOW_MS`` x the rank's factor), on the built-in digits and on MNIST-1D
(the paper's CNN). For each it runs, one ``mpiexec`` each, as a user would:

- each rank's speed alone (1 rank, one round per epoch): the solo throughputs;
- flodl-mpi ``--policy sync``, ``--window 10``, ``--policy cadence``, ``--policy async``;
- ``benchmarks/ddp_baseline.py``: PyTorch DDP over gloo, same model, data, batch size.

and prints, per run: total samples per second (training samples of all ranks over the
epochs' wall time, evaluation excluded for flodl-mpi, included for DDP, which reports
only its total), rounds, bytes each rank put on the wire, the last epoch's test
accuracy, and for async the share of the round time hidden behind compute over every
round, ``1 - sum(wait_ms) / sum(bridge_ms)`` (an epoch's last round runs on into the next
epoch's first window; only the last epoch's is waited for whole)::

    python benchmarks/heterogeneous.py                       # everything (about 20 minutes on 2 busy cores)
    python benchmarks/heterogeneous.py --datasets digits --slowdowns 4 --epochs-digits 3
    python benchmarks/heterogeneous.py --datasets mnist1d --slowdowns 4 --policies sync cadence --no-ddp \
        --solo-each-block

Numbers depend on the machine and its load: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runs import MPIEXEC, ROOT, _env, mnist1d_file  # noqa: E402

SLOWED = str(ROOT / "benchmarks" / "slowed.py")
POLICIES = {"sync": ["--policy", "sync"], "window 10": ["--window", "10"], "cadence": ["--policy", "cadence"],
            "async": ["--policy", "async"], "async easgd": ["--policy", "async", "--async-adopt", "easgd"]}


def _launch(ranks: int, argv: list[str], factors: str, slow_ms: float) -> None:
    env = {**_env(), "FLODL_SLOW_FACTORS": factors, "FLODL_SLOW_MS": str(slow_ms)}
    proc = subprocess.run([MPIEXEC, "-n", str(ranks), sys.executable, *argv], capture_output=True, text=True, env=env,
                          check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")


def flodl(ranks: int, args: list[str], factors: str, slow_ms: float, keep: Path | None = None) -> dict:
    """One flodl-mpi run; its throughput, rounds, bytes, accuracy and overlap from metrics.h5.

    ``keep``: copy the run's metrics.h5 there (for benchmarks/guard_replay.py)."""
    from flodl_mpi.outputs.metrics import read_table

    with tempfile.TemporaryDirectory(prefix="flodl-het-") as tmp:
        run_dir = Path(tmp) / "run"
        _launch(ranks, ["-m", "flodl_mpi", "train", *args, "--run-dir", str(run_dir)], factors, slow_ms)
        ep = read_table(run_dir / "metrics.h5", "epochs")
        rd = read_table(run_dir / "metrics.h5", "rounds")
        if keep is not None:
            keep.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(run_dir / "metrics.h5", keep)
    wait, bridge = rd["wait_ms"], rd["bridge_ms"]
    # The rounds that do not end an epoch (before the carry, the epoch-end rounds were waited for whole).
    mid = ~np.isin(rd["round"], ep["rounds"] - 1)
    return {
        "samples_per_s": float(ep["per_rank_samples"].sum() / (ep["epoch_ms"].sum() / 1e3)),
        "rounds": len(rd["round"]),
        "mb_per_rank": float(rd["bytes"].sum() / 1e6),
        "test_accuracy": [float(v) for v in ep["test_accuracy"]],
        "overlap": float(1 - np.nansum(wait) / np.nansum(bridge)),
        "overlap_mid_epoch": float(1 - np.nansum(wait[mid]) / np.nansum(bridge[mid])) if mid.any() else None,
        "batch_ms": [float(v) for v in np.nanmean(rd["batch_ms"], axis=0)],
        "quota_last": [int(v) for v in rd["quota"][-1]],
        "anchor_last": int(rd["anchor"][-1]),
    }


def ddp(args: list[str], factors: str, slow_ms: float, n_train: int, epochs: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="flodl-het-") as tmp:
        out = Path(tmp) / "ddp.json"
        _launch(2, [str(ROOT / "benchmarks" / "ddp_baseline.py"), *args, "--out", str(out)], factors, slow_ms)
        res = json.loads(out.read_text())
    ep = res["epochs"]
    return {"samples_per_s": n_train * epochs / ep[-1]["time_s"], "rounds": None,
            "mb_per_rank": res["bytes_per_rank"] / 1e6, "test_accuracy": [e["test_accuracy"] for e in ep],
            "overlap": None, "overlap_mid_epoch": None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--datasets", nargs="+", default=["digits", "mnist1d"], choices=("digits", "mnist1d"))
    p.add_argument("--slowdowns", nargs="+", type=float, default=[2.0, 4.0])
    p.add_argument("--epochs-digits", type=int, default=5)
    p.add_argument("--epochs-mnist1d", type=int, default=10)
    p.add_argument("--slow-ms", type=float, default=10.0, help="ms a factor-1 forward sleeps (default 10)")
    p.add_argument("--out", help="JSON file for every number")
    p.add_argument("--solo-only", action="store_true", help="measure and print the solo throughputs only")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES), metavar="NAME",
                   help=f"which flodl-mpi runs (default all: {', '.join(POLICIES)})")
    p.add_argument("--no-ddp", action="store_true", help="leave out the DDP baseline")
    p.add_argument("--keep-metrics", type=Path, metavar="DIR",
                   help="copy each two-rank run's metrics.h5 to DIR/<dataset>-<slowdown>x-<run>.h5")
    p.add_argument("--solo-each-block", action="store_true",
                   help="measure the two solo throughputs again right before and right after each slowdown's "
                        "block, and divide by their mean (the load of a shared machine moves; default: once, "
                        "at the start)")
    args = p.parse_args()

    results = []
    for name in args.datasets:
        if name == "digits":
            data, model, epochs, n_train = [], "slowed_mlp", args.epochs_digits, 1437
        else:
            data, model, n_train = ["--data", str(mnist1d_file())], "slowed_mnist1d_cnn", 4000
            epochs = args.epochs_mnist1d
        common = [*data, "--model", f"{SLOWED}:{model}", "--epochs", str(epochs), "--batch-size", "32"]
        # One torch thread, as each of the two ranks gets on two cores (a lone rank would take both).
        alone = [*data, "--model", f"{SLOWED}:{model}", "--epochs", "2", "--batch-size", "32", "--window", "1000",
                 "--threads", "1"]

        def solo_of(f: float, alone: list[str] = alone) -> float:
            return flodl(1, alone, f"{f}", args.slow_ms)["samples_per_s"]

        solo = {f: solo_of(f) for f in sorted({1.0, *args.slowdowns})}
        if args.solo_only:
            print(f"{name}: solo samples/s by factor: " + ", ".join(f"{f:g}: {v:.0f}" for f, v in solo.items()))
            continue
        for s in args.slowdowns:
            factors = f"1,{s}"
            load = [os.getloadavg()[0]]
            before = (solo_of(1.0), solo_of(s)) if args.solo_each_block else (solo[1.0], solo[s])
            rows = {}
            for k in args.policies:
                stem = f"{name}-{s:g}x-{k.replace(' ', '_')}"
                keep = None if args.keep_metrics is None else args.keep_metrics / f"{stem}.h5"
                rows[k] = flodl(2, [*common, *POLICIES[k]], factors, args.slow_ms, keep)
                load.append(os.getloadavg()[0])
            if not args.no_ddp:
                rows["DDP (gloo)"] = ddp(common, factors, args.slow_ms, n_train, epochs)
            after = (solo_of(1.0), solo_of(s)) if args.solo_each_block else before
            load.append(os.getloadavg()[0])
            r0, r1 = (before[0] + after[0]) / 2, (before[1] + after[1]) / 2
            both = r0 + r1
            print(f"\n{name}, rank 1 slowed {s:g}x, {epochs} epochs; solo samples/s: rank 0 {r0:.0f}, "
                  f"rank 1 {r1:.0f} (sum {both:.0f})"
                  + (f"; before the block {sum(before):.0f}, after {sum(after):.0f}" if args.solo_each_block else "")
                  + f"; 1-min load average {', '.join(f'{v:.1f}' for v in load)}")
            print(f"{'run':<12} {'samples/s':>10} {'x solo sum':>10} {'x sync':>7} {'rounds':>7} {'MB/rank':>8} "
                  f"{'test acc':>8} {'hidden (mid-epoch)':>18}")
            for k, r in rows.items():
                hidden = "-"
                if k.startswith("async"):
                    mid = r["overlap_mid_epoch"]
                    hidden = f"{100 * r['overlap']:.0f} % ({'-' if mid is None else f'{100 * mid:.0f} %'})"
                x_sync = f"{r['samples_per_s'] / rows['sync']['samples_per_s']:.2f}" if "sync" in rows else "-"
                print(f"{k:<12} {r['samples_per_s']:>10.0f} {r['samples_per_s'] / both:>10.2f} {x_sync:>7} "
                      f"{'-' if r['rounds'] is None else r['rounds']:>7} {r['mb_per_rank']:>8.1f} "
                      f"{r['test_accuracy'][-1]:>8.4f} {hidden:>18}")
            results.append({"dataset": name, "slowdown": s, "epochs": epochs, "solo": [r0, r1],
                            "solo_before": list(before), "solo_after": list(after), "load": load, "runs": rows})
            sys.stdout.flush()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
