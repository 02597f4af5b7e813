"""A world of one (no launcher) against a plain PyTorch loop: same model, data, batch size and optimizer.

Run in one process, no launcher (issue 26 item 10)::

    python benchmarks/world_of_one.py [--epochs 6] [--repeats 5] [--threads 1] [--hidden 128]

Each repeat runs, one after the other and each in a fresh process, four loops over
the built-in digits (1437 training samples, batch 32: 45 batches an epoch) with the
built-in MLP (``--hidden``: the width of its two hidden layers, 128 by default; a wider
one is a larger step, over which the fixed costs amortise) and Adam at lr 1e-3, every
epoch evaluated on the test set:

- ``plain``: a plain PyTorch loop (zero_grad, forward, cross-entropy, backward,
  step, ``loss.item()``; the epoch's permutation from
  ``flodl_mpi.training.data.epoch_permutation``), then the test set's loss and accuracy;
- ``cli``: ``flodl-mpi train --threads T`` with a run dir (metrics rows, a checkpoint
  every epoch, the watchdog: everything a run does), its ``main`` called in the child
  process (what ``python -m flodl_mpi train`` runs) with a ``batch`` hook
  (`flodl_mpi.runtime.hooks`) that reads the clocks at each epoch's first batch;
- ``fit``: ``flodl_mpi.fit(epochs=E, threads=T, run_dir=...)``, the Python API;
- ``averager``: the plain loop with ``flodl_mpi.Averager(model, optimizer=opt,
  run_dir=...)``: ``avg.step(loss)`` after each optimizer step and
  ``avg.end_epoch({...})`` after the evaluation; ``averager-bare`` without a run
  dir, ``averager-nockpt`` with ``checkpoint_every=0`` (asked by ``--variants``).

An epoch's time is the whole cycle, training and evaluation (and for ours the
epoch's exchange, metrics rows and checkpoint): the gaps between consecutive epoch
ends (for ``cli``, between consecutive epochs' first batches: one cycle fewer), the
first epoch left out (warm-up). Each is read on two clocks: wall
(``time.perf_counter``) and the process's CPU time (``time.process_time``: every
thread of the process, the bridge's and the metrics writer's too; on a shared
machine it counts what the process did, not the time other processes took its
core). Prints per variant the median epoch (ms, wall and CPU) and samples/s over
the repeats, and the ratio of ours to plain's throughput on each clock: the median
of the repeats' ratios (each repeat's runs are neighbours in time; the machine is
shared, so single runs are noisy).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VARIANTS = ("plain", "cli", "fit", "averager")
#: The averager's split (``--variants plain,averager-bare,averager-nockpt,averager``): no run dir
#: (rounds only), and a run dir with ``checkpoint_every=0`` (rows, no checkpoint but the last).
SPLIT = ("averager-bare", "averager-nockpt")
#: The hidden width, for :func:`wide_mlp` in the CLI's and fit's processes (``--model FILE:wide_mlp``).
HIDDEN_ENV = "WORLD_OF_ONE_HIDDEN"


def _clocks() -> tuple[float, float]:
    """(wall, CPU) seconds: ``time.perf_counter()`` and ``time.process_time()`` (every thread of the process)."""
    return time.perf_counter(), time.process_time()


def wide_mlp(input_shape, num_classes):
    """The built-in MLP with hidden width ``$WORLD_OF_ONE_HIDDEN`` (the CLI's and fit's ``--model``)."""
    from flodl_mpi.training.models import digits_mlp

    return digits_mlp(input_shape, num_classes, hidden=int(os.environ[HIDDEN_ENV]))


def _data_and_model(seed: int, hidden: int):
    import torch

    from flodl_mpi.training.data import default_digits_path, ensure_digits, load_dataset
    from flodl_mpi.training.models import digits_mlp

    path = default_digits_path()
    ensure_digits(path)
    data = load_dataset(path)
    torch.manual_seed(seed)
    return data, digits_mlp(data.input_shape, data.num_classes, hidden=hidden)


def _evaluate(model, split, batch_size: int = 1024) -> tuple[float, float]:
    """Test loss and accuracy over the whole split (eval mode, no grad), as the CLI's evaluation."""
    import torch
    from torch import nn

    model.eval()
    loss_sum, correct = 0.0, 0
    with torch.no_grad():
        for start in range(0, split.n, batch_size):
            x = torch.from_numpy(split.x[start:start + batch_size])
            y = torch.from_numpy(split.y[start:start + batch_size])
            logits = model(x)
            loss_sum += float(nn.functional.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(dim=1) == y).sum())
    model.train()
    return loss_sum / split.n, correct / split.n


def _own_loop(epochs: int, batch_size: int, threads: int, seed: int, run_dir: str | None, averaged: bool,
              checkpoint_every: int = 1, hidden: int = 128) -> list:
    """The plain loop (``averaged``: with an Averager); the (wall, CPU) clocks at each epoch's end, seconds."""
    import torch
    from torch import nn

    from flodl_mpi.training.data import batch_indices, epoch_permutation, num_batches

    torch.set_num_threads(threads)
    data, model = _data_and_model(seed, hidden)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    avg = None
    if averaged:
        import flodl_mpi

        avg = flodl_mpi.Averager(model, optimizer=opt, run_dir=run_dir, checkpoint_every=checkpoint_every)
    n_batches = num_batches(data.train.n, batch_size)
    ends = [_clocks()]
    for epoch in range(epochs):
        perm = epoch_permutation(data.train.n, seed, epoch)
        for b in range(n_batches):
            idx = batch_indices(perm, batch_size, b)
            x, y = torch.from_numpy(data.train.x[idx]), torch.from_numpy(data.train.y[idx])
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            value = loss.item()
            if avg is not None:
                avg.step(value, samples=len(idx))
        test_loss, test_acc = _evaluate(model, data.test)
        if avg is not None:
            avg.end_epoch({"loss": (test_loss * data.test.n, data.test.n),
                           "accuracy": (test_acc * data.test.n, data.test.n)})
        ends.append(_clocks())
    if avg is not None:
        avg.close()
    return ends


def _fit(epochs: int, batch_size: int, threads: int, seed: int, run_dir: str, hidden: int) -> list:
    import flodl_mpi

    ends = [_clocks()]
    model = wide_mlp if hidden != 128 else None
    run = flodl_mpi.fit(model=model, epochs=epochs, batch_size=batch_size, optimizer="adam", lr=1e-3, seed=seed,
                        threads=threads, run_dir=run_dir)
    for _ in run:
        ends.append(_clocks())
    run.close()
    return ends


def _cli(epochs: int, batch_size: int, threads: int, seed: int, run_dir: str, hidden: int) -> list:
    """``flodl-mpi train`` in this process; the clocks at each epoch's first batch (a ``batch`` hook)."""
    import contextlib
    import io

    from flodl_mpi.cli.main import main
    from flodl_mpi.runtime import hooks
    from flodl_mpi.training.data import default_digits_path, load_dataset, num_batches

    per_epoch = num_batches(load_dataset(default_digits_path()).train.n, batch_size)
    seen: list = []

    def batch(trainer) -> None:
        if len(seen) % per_epoch == 0:
            seen.append(_clocks())
        else:
            seen.append(None)

    hooks.register("batch", batch)
    argv = ["train", "--epochs", str(epochs), "--batch-size", str(batch_size), "--threads", str(threads),
            "--seed", str(seed), "--run-dir", run_dir, "-q"]
    if hidden != 128:
        argv += ["--model", f"{Path(__file__).resolve()}:wide_mlp"]
    with contextlib.redirect_stdout(io.StringIO()):
        rc = main(argv)
    if rc:
        raise SystemExit(f"flodl-mpi train exited {rc}")
    return [c for c in seen if c is not None]


def run_variant(variant: str, args) -> dict:
    """One run of ``variant`` in a fresh process: ``{"wall_s": [...], "cpu_s": [...]}``, each epoch's whole cycle."""
    with tempfile.TemporaryDirectory(prefix="world-of-one-") as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, __file__, "--child", variant, "--epochs", str(args.epochs), "--batch-size",
               str(args.batch_size), "--threads", str(args.threads), "--seed", str(args.seed), "--run-dir",
               str(run_dir), "--hidden", str(args.hidden)]
        env = {**os.environ, HIDDEN_ENV: str(args.hidden)}
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
        ends = json.loads(out.strip().splitlines()[-1])
    return {"wall_s": [b[0] - a[0] for a, b in zip(ends, ends[1:])],
            "cpu_s": [b[1] - a[1] for a, b in zip(ends, ends[1:])]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=6, help="epochs per run (the first is left out)")
    ap.add_argument("--repeats", type=int, default=5, help="runs of each variant, interleaved")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch threads, every variant alike")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=128, help="the MLP's hidden width (128: the built-in model)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma-separated, of " + ",".join(VARIANTS + SPLIT))
    ap.add_argument("--child", choices=VARIANTS + SPLIT, help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        if args.child in ("fit", "cli"):
            ends = (_fit if args.child == "fit" else _cli)(args.epochs, args.batch_size, args.threads, args.seed,
                                                          args.run_dir, args.hidden)
        else:
            ends = _own_loop(args.epochs, args.batch_size, args.threads, args.seed,
                             None if args.child == "averager-bare" else args.run_dir,
                             averaged=args.child != "plain", checkpoint_every=0 if args.child == "averager-nockpt" else 1,
                             hidden=args.hidden)
        print(json.dumps(ends))
        return 0
    if args.epochs < 3:
        ap.error("--epochs must be >= 3 (the first epoch is left out; the CLI's is read one cycle short)")
    if args.hidden < 1:
        ap.error("--hidden must be >= 1")
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS + SPLIT))
    if unknown:
        ap.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS + SPLIT)}")
    if "plain" not in variants:
        variants.insert(0, "plain")
    from flodl_mpi.training.data import default_digits_path, ensure_digits, load_dataset

    ensure_digits(default_digits_path())
    n = load_dataset(default_digits_path()).train.n
    clocks = ("wall", "cpu")
    epoch_ms = {c: {v: [] for v in variants} for c in clocks}
    ratios = {c: {v: [] for v in variants if v != "plain"} for c in clocks}
    for rep in range(args.repeats):
        this = {c: {} for c in clocks}
        for v in variants:
            run = run_variant(v, args)
            for c in clocks:
                this[c][v] = 1e3 * statistics.median(run[f"{c}_s"][1:])
                epoch_ms[c][v].append(this[c][v])
        for c in clocks:
            for v in ratios[c]:
                ratios[c][v].append(this[c]["plain"] / this[c][v])
        print(f"repeat {rep + 1}/{args.repeats}: "
              + ", ".join(f"{v} {this['wall'][v]:.1f} ms (cpu {this['cpu'][v]:.1f})" for v in variants), flush=True)
    print(f"\nworld of one, digits ({n} samples, batch {args.batch_size}), MLP hidden {args.hidden}, Adam, "
          f"{args.threads} torch thread(s), {args.epochs} epochs (first left out); medians of {args.repeats} repeats:")
    print(f"{'variant':>15} {'epoch ms':>9} {'cpu ms':>8} {'samples/s':>10} {'ours/plain':>11} {'cpu ratio':>10}")
    for v in variants:
        ms, cpu = statistics.median(epoch_ms["wall"][v]), statistics.median(epoch_ms["cpu"][v])
        ratio = [f"{statistics.median(ratios[c][v]):.3f}" if v in ratios[c] else "1" for c in clocks]
        print(f"{v:>15} {ms:9.1f} {cpu:8.1f} {1e3 * n / ms:10.0f} {ratio[0]:>11} {ratio[1]:>10}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
