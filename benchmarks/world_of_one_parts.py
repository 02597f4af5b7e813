"""The fixed costs of a world of one, each on its own: CPU time, in this process, no training between calls.

Run in one process, no launcher (issue 26 item 10; ``world_of_one.py`` measures the whole loop)::

    python benchmarks/world_of_one_parts.py [--steps 2000] [--epochs 40] [--hidden 128]

Prints, on ``time.process_time`` (every thread of the process):

- ``metrics epoch``: ms to append one epoch of a world of one to a fresh metrics.h5
  (``flodl_mpi.outputs.metrics.MetricsFile``): 45 ``rounds`` rows, 45 ``batches`` rows and an
  ``epochs`` row (52 columns), averaged over ``--epochs`` epochs;
- ``step + round``: us per ``Averager.step()`` with its round (policy ``sync``), without and
  with a run dir (``checkpoint_every=0``: the round's metrics row held and written), averaged
  over ``--steps`` calls after one trained step of the built-in MLP (``--hidden`` wide);
- ``checkpoint``: ms to write one checkpoint of that run (``write_checkpoint``) and to prune to 3
  (``prune_checkpoints``: it opens each kept one), averaged over 10.

Compare runs of the same machine and load only; each figure is one mean, not a median of repeats.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def metrics_epoch_ms(epochs: int) -> float:
    """CPU ms per epoch appended (45 rounds rows, 45 batch rows, 1 epoch row; world size 1)."""
    import numpy as np

    from flodl_mpi.outputs.metrics import MetricsFile, table_schema

    schema = table_schema(1)
    rows = {t: {c: np.zeros((45 if t != "epochs" else 1, *shape), dtype=dtype) for c, (dtype, shape) in cols.items()}
            for t, cols in schema.items() if t in ("rounds", "batches", "epochs")}
    with tempfile.TemporaryDirectory() as d, MetricsFile(Path(d) / "metrics.h5", 1, {"config": "{}"}) as f:
        t0 = time.process_time()
        for _ in range(epochs):
            for table, r in rows.items():
                f.append(table, r)
        return 1e3 * (time.process_time() - t0) / epochs


def step_round_us(steps: int, hidden: int, run_dir: bool) -> tuple[float, float, float]:
    """CPU us per Averager.step() with its round; with ``run_dir`` also the checkpoint's write and prune, ms."""
    import torch

    import flodl_mpi
    from flodl_mpi.api import averager_checkpoint
    from flodl_mpi.outputs import checkpoint
    from world_of_one import _data_and_model

    torch.set_num_threads(1)
    data, model = _data_and_model(0, hidden)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with tempfile.TemporaryDirectory() as d:
        avg = flodl_mpi.Averager(model, optimizer=opt, run_dir=Path(d) / "run" if run_dir else None,
                                 checkpoint_every=0)
        x, y = torch.from_numpy(data.train.x[:32]), torch.from_numpy(data.train.y[:32])
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        t0 = time.process_time()
        for _ in range(steps):
            avg.step(0.5, samples=32, realized=True)
        per_step = 1e6 * (time.process_time() - t0) / steps
        write_ms = prune_ms = float("nan")
        if run_dir:
            args = averager_checkpoint.contents_of(avg, None, "checkpoint",
                                                   [averager_checkpoint.this_rank_state(avg)]).format_args()
            t0 = time.process_time()
            for i in range(10):
                checkpoint.write_checkpoint(Path(d) / f"ckpt-{i}.h5", **args)
            write_ms = 1e2 * (time.process_time() - t0)
            t0 = time.process_time()
            for _ in range(10):
                checkpoint.prune_checkpoints(d, 3)
            prune_ms = 1e2 * (time.process_time() - t0)
        avg.close()
    return per_step, write_ms, prune_ms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000, help="step() calls timed")
    ap.add_argument("--epochs", type=int, default=40, help="metrics.h5 epochs timed")
    ap.add_argument("--hidden", type=int, default=128, help="the MLP's hidden width")
    args = ap.parse_args()
    print(f"metrics epoch: {metrics_epoch_ms(args.epochs):.2f} ms CPU")
    bare, _, _ = step_round_us(args.steps, args.hidden, run_dir=False)
    with_dir, write_ms, prune_ms = step_round_us(args.steps, args.hidden, run_dir=True)
    print(f"step + round: {bare:.1f} us CPU without a run dir, {with_dir:.1f} us with one")
    print(f"checkpoint: write {write_ms:.2f} ms CPU, prune to 3 {prune_ms:.2f} ms CPU")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
