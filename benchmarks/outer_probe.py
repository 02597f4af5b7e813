"""Look inside the outer step (issue 24 item 4): the norms of each round's outer update, benchmark-only.

Run under the launcher, as ``flodl-mpi train`` (every option after ``--`` is passed to it)::

    mpiexec -n 2 python benchmarks/outer_probe.py --out probe.json -- --model benchmarks/models.py:mnist1d_cnn \\
        --data ~/.cache/flodl_mpi/mnist1d.h5 --epochs 40 --optimizer adam --lr 1e-3 --window 50 --outer nesterov

It wraps :meth:`flodl_mpi.protocol.outer.OuterOptimizer.step` in this process only (the product
is not changed) and records, for every outer step on rank 0 (the step is the same on every rank),
in float64: ``g`` = ``|prev - consensus|`` (the pseudo-gradient: what plain averaging would have
moved), ``v`` = ``|velocity|`` after the update, ``step`` = ``|new - prev|`` (what the outer step
moves), ``gain`` = ``step / g`` (1 for plain averaging; ``lr / (1 - mu)`` for slowmo under a steady
``g``, ``lr (1 + mu / (1 - mu))`` for nesterov), ``cos`` = cos(g, the previous velocity) (how much
this round's change repeats the last ones: near 1, the momentum compounds a drift; near 0 or
below, it carries stale directions), and ``rms_g_per_step`` = ``rms(g) / (H lr)``, the pseudo-
gradient's per-element size per inner step in units of the inner lr (Adam moves each weight
by about ``lr`` per step: 1 means the H steps all pointed the same way, ``1/sqrt(H)`` a random
walk). The run's own ``metrics.h5`` epochs (test accuracy and loss, training loss), its rounds and
bytes, and the parameters' norm in its last checkpoint go beside them. ``--warmup K`` is a
benchmark-only experiment, not a product option: the first K outer steps after the zero step adopt
the consensus as ``--outer avg`` does (``prev`` follows it, the velocity stays 0). ``--outer avg``
takes no outer step: its rows have the epochs and the norm only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _wrap(records: list[dict], warmup: int) -> None:
    from flodl_mpi.protocol import outer as outer_mod

    real = outer_mod.OuterOptimizer.step

    def step(self, consensus: np.ndarray) -> None:
        if self.kind == "avg" or self.steps == 0:
            real(self, consensus)
            return
        prev = self.prev.astype(np.float64)
        v_old = self.velocity.astype(np.float64)
        c = consensus.astype(np.float64)
        if self.steps <= warmup:  # benchmark-only warm-up: plain averaging, the velocity left at 0
            np.copyto(self.prev, consensus)
            self.steps += 1
        else:
            real(self, consensus)
        g = prev - c
        d = consensus.astype(np.float64) - prev
        ng, nv_old = float(np.linalg.norm(g)), float(np.linalg.norm(v_old))
        records.append({"step": self.steps - 1, "g": ng, "v": float(np.linalg.norm(self.velocity.astype(np.float64))),
                        "move": float(np.linalg.norm(d)), "gain": float(np.linalg.norm(d)) / ng if ng else 0.0,
                        "cos": float(g @ v_old / (ng * nv_old)) if ng and nv_old else 0.0,
                        "prev": float(np.linalg.norm(prev)), "rms_g": ng / np.sqrt(max(g.size, 1))})

    outer_mod.OuterOptimizer.step = step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON written by rank 0")
    p.add_argument("--warmup", type=int, default=0,
                   help="BENCHMARK-ONLY experiment, not a product option: the first K outer steps after the zero "
                        "step adopt the consensus as --outer avg does (prev follows it, the velocity stays 0)")
    p.add_argument("train", nargs=argparse.REMAINDER, help="-- then flodl-mpi train's options (no --run-dir)")
    args = p.parse_args()
    train = [a for a in args.train if a != "--"] if args.train[:1] == ["--"] else args.train
    records: list[dict] = []
    _wrap(records, args.warmup)
    import tempfile

    from mpi4py import MPI

    from flodl_mpi.cli.main import main as flodl_main

    comm = MPI.COMM_WORLD
    run_dir = comm.bcast(tempfile.mkdtemp(prefix="flodl-probe-") if comm.rank == 0 else None, root=0)
    rc = flodl_main(["train", *train, "--run-dir", str(Path(run_dir) / "run")])
    if rc:
        raise SystemExit(rc)
    if comm.rank != 0:
        return
    from flodl_mpi.outputs.metrics import read_table

    ep = read_table(Path(run_dir) / "run" / "metrics.h5", "epochs")
    rounds = read_table(Path(run_dir) / "run" / "metrics.h5", "rounds")
    lr = float(train[train.index("--lr") + 1]) if "--lr" in train else 1e-3
    window = int(train[train.index("--window") + 1]) if "--window" in train else 1
    for r in records:
        r["rms_g_per_step"] = r["rms_g"] / (window * lr)
    from flodl_mpi.outputs.checkpoint import latest_checkpoint, load_state_dict

    state = load_state_dict(latest_checkpoint(Path(run_dir) / "run" / "checkpoints"))
    norm = float(np.sqrt(sum(float((t.double() ** 2).sum()) for k, t in state.items() if t.is_floating_point()
                             and "running" not in k)))
    out = {"train": train, "warmup": args.warmup, "param_norm": norm, "steps": records, "rounds": int(len(rounds["round"])),
           "bytes_per_rank": int(np.sum(rounds["bytes"])),
           "epochs": {k: [float(x) for x in ep[k]] for k in ("test_accuracy", "test_loss", "avg_loss")}}
    Path(args.out).write_text(json.dumps(out) + "\n")
    import shutil

    shutil.rmtree(run_dir, ignore_errors=True)
    s = records
    for lo, hi in ((0, 5), (5, 20), (20, 40), (40, len(s))):
        part = s[lo:hi]
        if part:
            print(f"outer steps {lo + 1}-{hi}: |g| {np.mean([r['g'] for r in part]):.4f} |v| "
                  f"{np.mean([r['v'] for r in part]):.4f} |step| {np.mean([r['move'] for r in part]):.4f} gain "
                  f"{np.mean([r['gain'] for r in part]):.2f} cos(g, v_prev) {np.mean([r['cos'] for r in part]):+.2f} "
                  f"rms(g)/(H lr) {np.mean([r['rms_g_per_step'] for r in part]):.3f}")
    print(f"final test accuracy {out['epochs']['test_accuracy'][-1]:.4f}, test loss lowest "
          f"{min(out['epochs']['test_loss']):.3f} -> last {out['epochs']['test_loss'][-1]:.3f}")


if __name__ == "__main__":
    main()
