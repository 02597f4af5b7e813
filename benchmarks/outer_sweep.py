"""The outer optimizers at long windows, swept (issue 24 item 4): outer lr, momentum, inner lr, inner state.

2 ranks (``mpiexec -n 2``), MNIST-1D (the paper's 1-D CNN, ``benchmarks/models.py``), Adam, batch 32
per rank, 40 epochs (``--epochs`` to shorten). Each row is a separate launch, and DDP
(``ddp_baseline.py``, gloo) and flodl-mpi's ``--policy sync`` run in the same sweep at the same
inner learning rates, so the table compares each method at its own best inner lr. Every flodl-mpi
row runs under ``outer_probe.py`` (the product's CLI in-process, its outer step wrapped to measure,
not changed), which adds per row: the parameters' norm at the end (``|θ|``), the mean gain of the
outer step (``|new − prev| / |prev − consensus|``) and the mean cosine between a round's pseudo-
gradient and the velocity before it. Results go to ``--out`` as JSON lines, one per row; rows
already there are skipped (the sweep resumes)::

    . .venv/bin/activate && pip install mnist1d
    python benchmarks/outer_sweep.py --out sweep.jsonl                  # the default grid, in priority order
    python benchmarks/outer_sweep.py --table sweep.jsonl                # the table, best inner lr per method
    python benchmarks/outer_sweep.py --table sweep.jsonl --rst          # a line per method (the docs' table)
    python benchmarks/outer_sweep.py --out sweep.jsonl --only nesterov  # rows whose label contains a word

Row labels: ``ddp``; ``sync``; ``avg H50``; ``nesterov H50 0.7/0.9`` (outer lr / momentum); a suffix
``state=off`` (``--average-optimizer-state off``: each rank keeps its own Adam state, as a run
without averaging of the state), ``state=reset`` (``--outer-reset-inner``: every rank clears its
Adam state after each outer step), ``warmup=K`` (benchmark-only, not a product option: the probe's
first K outer steps are plain averaging). Without a suffix, the default: Adam's state averaged
(``--average-optimizer-state auto`` = ``corrected``) and kept across outer steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runs import MPIEXEC, ROOT, _env, mnist1d_file, run_ddp  # noqa: E402

HERE = Path(__file__).resolve().parent
MODEL = f"{HERE / 'models.py'}:mnist1d_cnn"
LRS = (5e-4, 1e-3, 2e-3, 4e-3)


def grid(window: int = 50) -> list[dict]:
    """The default rows, most telling first (a sweep cut short still answers the main question)."""
    rows: list[dict] = []

    def add(method, lrs, outer_lr=None, mu=None, state="avg", warmup=0, w=window):
        for lr in lrs:
            rows.append({"method": method, "window": 1 if method in ("ddp", "sync") else w, "outer_lr": outer_lr,
                         "mu": mu, "lr": lr, "state": state, "warmup": warmup})

    add("ddp", (1e-3, 2e-3, 4e-3, 8e-3))
    add("nesterov", (5e-4,), 0.7, 0.9)
    add("slowmo", (1e-3, 4e-3), 1.0, 0.9)
    add("nesterov", (1e-3,), 0.7, 0.9)
    add("avg", (2e-3, 4e-3))
    add("nesterov", (1e-3, 2e-3), 0.7, 0.5)
    add("slowmo", (1e-3, 4e-3), 1.0, 0.5)
    add("nesterov", (4e-3,), 0.7, 0.5)
    add("nesterov", (1e-3,), 0.7, 0.9, state="reset")
    add("nesterov", (1e-3,), 0.7, 0.9, warmup=10)
    add("nesterov", (2e-3,), 0.7, 0.9)
    add("slowmo", (2e-3,), 1.0, 0.5)
    add("ddp", (1.6e-2,))
    add("nesterov", (1e-3,), 0.7, 0.9, state="off")
    add("sync", (8e-3,))
    add("nesterov", (8e-3,), 0.7, 0.5)
    add("slowmo", (8e-3,), 1.0, 0.5)
    add("nesterov", (4e-3,), 0.7, 0.9)
    add("nesterov", (4e-3,), 0.7, 0.5, warmup=10)
    add("avg", (8e-3,))
    add("slowmo", (2e-3,), 1.0, 0.9)
    add("slowmo", (2e-3, 4e-3, 8e-3), 0.7, 0.5)
    # further rows, when the machine allows
    add("avg", (1e-3,))
    add("slowmo", (2e-3,), 1.0, 0.7)
    add("nesterov", (1e-3, 2e-3), 0.5, 0.5)
    add("sync", (4e-3,))
    return rows


def label(r: dict) -> str:
    """The row's method words (everything but the inner lr)."""
    if r["method"] in ("ddp", "sync"):
        return r["method"]
    s = f"{r['method']} H{r['window']}" + (f" {r['outer_lr']:g}/{r['mu']:g}" if r["method"] != "avg" else "")
    if r["state"] != "avg":
        s += f" state={r['state']}"
    if r["warmup"]:
        s += f" warmup={r['warmup']}"
    return s


def key(r: dict) -> str:
    return f"{label(r)} lr={r['lr']:g} epochs={r['epochs']}"


def run_row(r: dict, data: Path) -> dict:
    """One launch: DDP, or flodl-mpi under the probe; the row with its results."""
    base = ["--data", str(data), "--model", MODEL, "--epochs", str(r["epochs"]), "--optimizer", "adam",
            "--lr", f"{r['lr']:g}"]
    if r["method"] == "ddp":
        res = run_ddp(2, base)
        return {**r, "test_accuracy": res["test_accuracy"], "test_loss": res["test_loss"],
                "bytes_per_rank": res["bytes_per_rank"]}
    train = list(base) + (["--policy", "sync"] if r["method"] == "sync" else ["--window", str(r["window"])])
    if r["method"] in ("nesterov", "slowmo", "avg"):
        train += ["--outer", r["method"]]
    if r["method"] in ("nesterov", "slowmo"):
        train += ["--outer-lr", f"{r['outer_lr']:g}", "--outer-momentum", f"{r['mu']:g}"]
    if r["state"] == "off":
        train += ["--average-optimizer-state", "off"]
    elif r["state"] == "reset":
        train += ["--outer-reset-inner"]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "probe.json"
        cmd = [MPIEXEC, "-n", "2", sys.executable, str(HERE / "outer_probe.py"), "--out", str(out),
               "--warmup", str(r["warmup"]), "--", *train]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
        res = json.loads(out.read_text())
    steps = res["steps"]
    return {**r, "test_accuracy": res["epochs"]["test_accuracy"], "test_loss": res["epochs"]["test_loss"],
            "train_loss": res["epochs"]["avg_loss"], "rounds": res["rounds"], "bytes_per_rank": res["bytes_per_rank"],
            "param_norm": res["param_norm"],
            "gain": sum(s["gain"] for s in steps) / len(steps) if steps else None,
            "cos": sum(s["cos"] for s in steps) / len(steps) if steps else None}


def table(path: str) -> str:
    """Markdown: every row, then the best inner lr per method beside DDP's best."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    out = ["| method | inner lr | final acc | best acc | test loss lowest -> last | |θ| end | gain | cos(g, v) |",
           "|---|---|---|---|---|---|---|---|"]
    def f(r: dict, k: str, fmt: str) -> str:
        return "-" if r.get(k) is None else format(r[k], fmt)

    for r in sorted(rows, key=lambda r: (label(r), r["lr"])):
        out.append(f"| {label(r)} | {r['lr']:g} | {r['test_accuracy'][-1]:.4f} | {max(r['test_accuracy']):.4f} | "
                   f"{min(r['test_loss']):.3f} -> {r['test_loss'][-1]:.3f} | {f(r, 'param_norm', '.1f')} | "
                   f"{f(r, 'gain', '.2f')} | {f(r, 'cos', '+.2f')} |")
    best: dict[str, dict] = {}
    for r in rows:
        if label(r) not in best or r["test_accuracy"][-1] > best[label(r)]["test_accuracy"][-1]:
            best[label(r)] = r
    ddp = best.get("ddp")
    out += ["", "| method | best inner lr | final acc | vs DDP's best (points) | inner lrs tried |", "|---|---|---|---|---|"]
    for name, r in sorted(best.items(), key=lambda kv: -kv[1]["test_accuracy"][-1]):
        tried = ", ".join(f"{x['lr']:g}" for x in sorted(rows, key=lambda x: x["lr"]) if label(x) == name)
        vs = f"{100 * (r['test_accuracy'][-1] - ddp['test_accuracy'][-1]):+.1f}" if ddp else "-"
        out.append(f"| {name} | {r['lr']:g} | {r['test_accuracy'][-1]:.4f} | {vs} | {tried} |")
    return "\n".join(out)


def pivot(path: str) -> str:
    """reStructuredText: one line per method, the final test accuracy per inner lr (the best epoch's in
    brackets), the best against DDP's best, and the probe's ‖θ‖, gain and cos at the method's best lr."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    lrs = sorted({r["lr"] for r in rows})
    names = sorted({label(r) for r in rows}, key=lambda n: -max(r["test_accuracy"][-1] for r in rows if label(r) == n))
    ddp = max((r["test_accuracy"][-1] for r in rows if r["method"] == "ddp"), default=None)
    head = ["method", *(f"{lr:g}" for lr in lrs), "best vs DDP", "‖θ‖", "gain", "cos"]
    body = []
    for n in names:
        mine = {r["lr"]: r for r in rows if label(r) == n}
        best = max(mine.values(), key=lambda r: r["test_accuracy"][-1])
        cells = [f"{mine[lr]['test_accuracy'][-1]:.3f} ({max(mine[lr]['test_accuracy']):.3f})" if lr in mine else ""
                 for lr in lrs]
        vs = "" if ddp is None else f"{100 * (best['test_accuracy'][-1] - ddp):+.1f}"
        probe = [("" if best.get(k) is None else format(best[k], fmt)) for k, fmt in
                 (("param_norm", ".0f"), ("gain", ".2f"), ("cos", "+.2f"))]
        body.append([n, *cells, vs, *probe])
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    rule = "  ".join("=" * w for w in widths)
    line = (lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip())  # noqa: E731
    return "\n".join([rule, line(head), rule, *map(line, body), rule])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="JSON lines, appended; rows already there are skipped")
    p.add_argument("--table", help="print the table of a results file and exit")
    p.add_argument("--rst", action="store_true", help="with --table: one line per method, a column per inner lr")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--window", type=int, default=50)
    p.add_argument("--only", nargs="*", default=[], help="run only rows whose label contains one of these words")
    args = p.parse_args()
    if args.table:
        print(pivot(args.table) if args.rst else table(args.table))
        return
    if not args.out:
        p.error("give --out (or --table)")
    done = set()
    if os.path.exists(args.out):
        done = {key(json.loads(line)) for line in Path(args.out).read_text().splitlines() if line.strip()}
    data = mnist1d_file()
    for r in grid(args.window):
        r["epochs"] = args.epochs
        if key(r) in done or (args.only and not any(w in label(r) for w in args.only)):
            continue
        res = run_row(r, data)
        with open(args.out, "a") as f:
            f.write(json.dumps(res) + "\n")
        print(f"{key(r):50s} final {res['test_accuracy'][-1]:.4f} best {max(res['test_accuracy']):.4f} "
              f"test loss {min(res['test_loss']):.3f}->{res['test_loss'][-1]:.3f} |θ| {res.get('param_norm') or 0:.1f}",
              flush=True)


if __name__ == "__main__":
    main()
