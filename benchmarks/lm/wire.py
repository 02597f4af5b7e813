"""The wire modes on the language model: final validation loss and bytes per round (issue 24 item 3).

For each ``--wire`` mode (fp32, bf16, bf16-delta, int8-delta), at ``--policy sync`` and at
``--policy window --window 50 --outer nesterov`` (DiLoCo's outer step), one ``mpiexec`` of
``flodl-mpi train`` as a user runs it: the GPT of ``model.py`` on the GCIDE file of
``corpus.py`` (written once to ``--data``), ``--node-reduce mpi`` so that every mode moves
its bytes over MPI (the delta wires run there only; fp32 is then the float64 Allreduce).
Prints one row per run: final validation loss per token (and its perplexity), its ratio to
fp32's at the same policy, the median bytes one rank put on the wire per round (the delta
wires' first round is the exact float64 one; the median is the steady state), rounds, and
the run's seconds::

    python benchmarks/lm/wire.py                                   # 8 runs, 2 ranks, 1 epoch of 2 MB
    python benchmarks/lm/wire.py --epochs 2 --size small --wires fp32 int8-delta --json out.json

Numbers depend on the machine's load (seconds) and on the seed (losses): compare within one run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
import corpus  # noqa: E402
from runs import run_flodl  # noqa: E402

from flodl_mpi.outputs.metrics import read_table  # noqa: E402

WIRES = ("fp32", "bf16", "bf16-delta", "int8-delta")
POLICIES = {"sync": ["--policy", "sync"], "window 50 + nesterov": ["--policy", "window", "--window", "50",
                                                                    "--outer", "nesterov", "--outer-momentum", "0.9"]}
# momentum 0.9 (DiLoCo's, the default until issue 24 item 4): the setting docs/benchmarks.rst's wire table ran at


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--size", default="small", help="model.py's size (tiny, small, medium)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--train-bytes", type=int, default=2_000_000)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--block-bytes", type=int, default=65536)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wires", nargs="+", choices=WIRES, default=list(WIRES))
    p.add_argument("--policies", nargs="+", choices=list(POLICIES), default=list(POLICIES))
    p.add_argument("--data", default=None, help="the corpus file (written if absent; default: a temporary one)")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args(argv)

    tmp = tempfile.TemporaryDirectory(prefix="flodl-lm-")
    data = Path(args.data or Path(tmp.name) / "gcide.h5")
    if not data.exists():
        info = corpus.write_h5(data, args.train_bytes, args.context, args.block_bytes)
        print(f"# {data}: {info['train']} train / {info['test']} validation sequences of {args.context} bytes")
    rows = []
    print("| policy | wire | val loss | perplexity | loss / fp32's | bytes per round (median) | rounds | s |")
    print("|---|---|---|---|---|---|---|---|")
    for policy in args.policies:
        base = None
        for wire in args.wires:
            run_dir = Path(tmp.name) / f"{policy.split()[0]}-{wire}"
            cli = ["--model", f"{HERE / 'model.py'}:{args.size}", "--data", str(data), "--epochs", str(args.epochs),
                   "--optimizer", "adamw", "--lr", str(args.lr), "--batch-size", str(args.batch_size), "--seed", str(args.seed), "--node-reduce", "mpi",
                   "--wire", wire, "--average-optimizer-state", "off", "--checkpoint-every", "0", *POLICIES[policy]]
            res = run_flodl(args.ranks, cli, run_dir=run_dir)
            per_round = read_table(run_dir / "metrics.h5", "rounds")["bytes"]
            loss = res["test_loss"][-1]
            base = loss if wire == "fp32" else base
            row = {"policy": policy, "wire": wire, "val_loss": loss, "perplexity": math.exp(loss),
                   "ratio": loss / base if base else float("nan"), "bytes_per_round": float(np.median(per_round)),
                   "rounds": res["rounds"], "seconds": res["seconds"], "command": cli}
            rows.append(row)
            print(f"| {policy} | {wire} | {loss:.4f} | {row['perplexity']:.2f} | {row['ratio']:.4f} | "
                  f"{row['bytes_per_round']:,.0f} | {row['rounds']} | {row['seconds']:.0f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
