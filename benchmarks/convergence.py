"""Issue 12: flodl-mpi with and without ``--average-optimizer-state`` beside DDP, real runs.

MNIST-1D (``mnist1d_data.py``: 4,000 train / 1,000 test) with the paper's 1-D
CNN (``models.py``), each run a separate ``mpiexec`` of the venv's launcher
(``runs.py``): ``flodl-mpi train`` as a user would run it, and
``ddp_baseline.py`` (DistributedDataParallel over gloo, flodl-mpi's own batch
plan) at the same per-rank batch, optimizer and learning rate. Reports test
accuracy after the last epoch and the bytes each rank put into Allreduce per
round (DDP: its gradient bytes per step).

    . .venv/bin/activate && pip install mnist1d
    python benchmarks/convergence.py --out conv.jsonl                  # the grid below, resumable
    python benchmarks/convergence.py --table conv.jsonl                # the table
    python benchmarks/convergence.py --ranks 2 --optimizers adam --seeds 0 --epochs 5 --out quick.jsonl

The grid: ranks x optimizers x policies x seeds, each with three runs: ``ddp``,
``flodl off`` (each rank keeps its optimizer state) and ``flodl on``
(``--average-optimizer-state corrected`` for Adam and AdamW, ``mean`` for
SGD, whose momentum has no second moment to rebuild). Optimizers: SGD 0.05
with momentum 0.9, Adam 1e-3, AdamW 1e-3 with weight decay 0.01.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import mnist1d_cnn
from runs import mnist1d_file, run_ddp, run_flodl

HERE = Path(__file__).resolve().parent
MODEL = f"{HERE / 'models.py'}:mnist1d_cnn"
#: optimizer -> (lr, weight decay, flodl's "on" mode)
PARAMS = sum(p.numel() for p in mnist1d_cnn((40,), 10).parameters())
OPTIMIZERS = {"sgd": (0.05, 0.0, "mean"), "adam": (1e-3, 0.0, "corrected"), "adamw": (1e-3, 0.01, "corrected")}


def configs(ranks, optimizers, policies, seeds) -> list[dict]:
    """The runs, most informative first: seed by seed, so a cut-short grid still pairs with DDP."""
    out = []
    for seed in seeds:
        for policy in policies:
            for w in ranks:
                for opt in optimizers:
                    for variant in ("ddp", "off", "on"):
                        if variant == "ddp" and policy != "sync":
                            continue  # DDP has no window: the sync row is the reference
                        out.append({"ranks": w, "optimizer": opt, "policy": policy, "seed": seed, "variant": variant})
    return out


def key(c: dict) -> str:
    return json.dumps({k: c[k] for k in ("ranks", "optimizer", "policy", "seed", "variant", "epochs")}, sort_keys=True)


def run_one(c: dict, data: Path) -> dict:
    lr, wd, on_mode = OPTIMIZERS[c["optimizer"]]
    common = ["--data", str(data), "--model", MODEL, "--epochs", str(c["epochs"]), "--batch-size", "32",
              "--optimizer", c["optimizer"], "--lr", str(lr), "--weight-decay", str(wd), "--seed", str(c["seed"])]
    t0 = time.perf_counter()
    if c["variant"] == "ddp":
        res = run_ddp(c["ranks"], common)
        per_round = 4 * PARAMS  # DDP all-reduces the float32 gradients once per step
        mode = "-"
    else:
        mode = "off" if c["variant"] == "off" else on_mode
        policy = ["--policy", "sync"] if c["policy"] == "sync" else ["--window", c["policy"].removeprefix("window")]
        res = run_flodl(c["ranks"], [*common, *policy, "--average-optimizer-state", mode, "--checkpoint-every", "0",
                                     "--progress", "lines"])
        per_round = res["bytes_per_rank"] / max(res["rounds"], 1)
    return {**c, "mode": mode, "test_accuracy": res["test_accuracy"][-1], "curve": res["test_accuracy"],
            "bytes_per_round": per_round, "rounds": res["rounds"], "wall_s": time.perf_counter() - t0}


def table(path: Path) -> str:
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    ddp = {(r["ranks"], r["optimizer"], r["seed"]): r["test_accuracy"] for r in recs if r["variant"] == "ddp"}
    groups: dict[tuple, list] = {}
    for r in recs:
        groups.setdefault((r["optimizer"], r["ranks"], r["policy"], r["variant"]), []).append(r)
    order = {"sgd": 0, "adam": 1, "adamw": 2}
    lines = [("| optimizer | ranks | policy | run | seeds | test acc (mean) | vs DDP, same seed (points) | "
              "bytes/round/rank |"), "|---|---|---|---|---|---|---|---|"]
    for k in sorted(groups, key=lambda k: (order.get(k[0], 9), k[1], k[2] != "sync", k[2], k[3] != "ddp", k[3])):
        rs = sorted(groups[k], key=lambda r: r["seed"])
        acc = np.mean([r["test_accuracy"] for r in rs])
        name = "DDP (gloo)" if k[3] == "ddp" else f"flodl-mpi, state {rs[0]['mode']}"
        d = [100 * (r["test_accuracy"] - ddp[(r["ranks"], r["optimizer"], r["seed"])]) for r in rs
             if (r["ranks"], r["optimizer"], r["seed"]) in ddp]
        vs = "-" if k[3] == "ddp" or not d else f"{np.mean(d):+.1f} ({', '.join(f'{x:+.1f}' for x in d)})"
        seeds = ",".join(str(r["seed"]) for r in rs)
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {name} | {seeds} | {acc:.3f} | {vs} | "
                     f"{np.mean([r['bytes_per_round'] for r in rs]):,.0f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    p.add_argument("--optimizers", nargs="+", choices=sorted(OPTIMIZERS), default=["sgd", "adam", "adamw"])
    p.add_argument("--policies", nargs="+", default=["sync", "window8"], help="sync and/or windowK")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--out", type=Path, help="JSON lines, one per run; runs already there are skipped")
    p.add_argument("--table", type=Path, metavar="JSONL", help="print the table of a results file and exit")
    a = p.parse_args()
    if a.table:
        print(table(a.table))
        return
    if a.out is None:
        p.error("--out is required to run")
    done = set()
    if a.out.exists():
        done = {key(json.loads(line)) for line in a.out.read_text().splitlines() if line.strip()}
    data = mnist1d_file()
    for c in configs(a.ranks, a.optimizers, a.policies, a.seeds):
        c["epochs"] = a.epochs
        if key(c) in done:
            continue
        rec = run_one(c, data)
        with a.out.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        print(f"{c['optimizer']} W={c['ranks']} {c['policy']} seed {c['seed']} {c['variant']} ({rec['mode']}): "
              f"acc {rec['test_accuracy']:.4f}, {rec['bytes_per_round']:,.0f} B/round, {rec['wall_s']:.0f} s",
              flush=True)
    print(table(a.out))


if __name__ == "__main__":
    main()
