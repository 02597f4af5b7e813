"""A world of one (no launcher) against a plain PyTorch loop: same model, data, batch size and optimizer.

Run in one process, no launcher (issue 26 item 10)::

    python benchmarks/world_of_one.py [--epochs 6] [--repeats 5] [--threads 1]

Each repeat runs, one after the other and each in a fresh process, four loops over
the built-in digits (1437 training samples, batch 32: 45 batches an epoch) with the
built-in MLP and Adam at lr 1e-3, every epoch evaluated on the test set:

- ``plain``: a plain PyTorch loop (zero_grad, forward, cross-entropy, backward,
  step, ``loss.item()``; the epoch's permutation from
  ``flodl_mpi.training.data.epoch_permutation``), then the test set's loss and accuracy;
- ``cli``: ``python -m flodl_mpi train --threads T`` with a run dir (metrics rows,
  a checkpoint every epoch, the watchdog: everything a run does);
- ``fit``: ``flodl_mpi.fit(epochs=E, threads=T, run_dir=...)``, the Python API;
- ``averager``: the plain loop with ``flodl_mpi.Averager(model, optimizer=opt,
  run_dir=...)``: ``avg.step(loss)`` after each optimizer step and
  ``avg.end_epoch({...})`` after the evaluation; ``averager-bare`` without a run
  dir, ``averager-nockpt`` with ``checkpoint_every=0`` (asked by ``--variants``).

An epoch's time is the whole cycle, training and evaluation (and for ours the
epoch's exchange, metrics rows and checkpoint): the gaps between consecutive epoch
ends (``time_s`` of ``metrics.h5``'s epochs for ``cli``; measured in the script for
the others), the first epoch left out (warm-up). Prints per variant the median
epoch (ms) and samples/s over the repeats, and the ratio of ours to plain's
throughput: the median of the repeats' ratios (each repeat's runs are neighbours
in time; the machine is shared, so single runs are noisy).
"""

from __future__ import annotations

import argparse
import json
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


def _data_and_model(seed: int):
    import torch

    from flodl_mpi.training.data import default_digits_path, ensure_digits, load_dataset
    from flodl_mpi.training.models import build_model

    path = default_digits_path()
    ensure_digits(path)
    data = load_dataset(path)
    torch.manual_seed(seed)
    return data, build_model(None, data.input_shape, data.num_classes)


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
              checkpoint_every: int = 1) -> list:
    """The plain loop (``averaged``: with an Averager); the wall time of each epoch's end, seconds."""
    import torch
    from torch import nn

    from flodl_mpi.training.data import batch_indices, epoch_permutation, num_batches

    torch.set_num_threads(threads)
    data, model = _data_and_model(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    avg = None
    if averaged:
        import flodl_mpi

        avg = flodl_mpi.Averager(model, optimizer=opt, run_dir=run_dir, checkpoint_every=checkpoint_every)
    n_batches = num_batches(data.train.n, batch_size)
    ends = [time.perf_counter()]
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
        ends.append(time.perf_counter())
    if avg is not None:
        avg.close()
    return ends


def _fit(epochs: int, batch_size: int, threads: int, seed: int, run_dir: str) -> list:
    import flodl_mpi

    ends = [time.perf_counter()]
    run = flodl_mpi.fit(epochs=epochs, batch_size=batch_size, optimizer="adam", lr=1e-3, seed=seed,
                        threads=threads, run_dir=run_dir)
    for _ in run:
        ends.append(time.perf_counter())
    run.close()
    return ends


def _cli_ends(run_dir: Path) -> list:
    import h5py

    with h5py.File(run_dir / "metrics.h5", "r") as f:
        return [0.0, *f["epochs"]["time_s"][:].tolist()]


def run_variant(variant: str, args) -> dict:
    """One run of ``variant`` in a fresh process; ``{"epoch_s": [...]}`` (each epoch's whole cycle)."""
    with tempfile.TemporaryDirectory(prefix="world-of-one-") as tmp:
        run_dir = Path(tmp) / "run"
        if variant == "cli":
            cmd = [sys.executable, "-m", "flodl_mpi", "train", "--epochs", str(args.epochs), "--batch-size",
                   str(args.batch_size), "--threads", str(args.threads), "--seed", str(args.seed), "--run-dir",
                   str(run_dir), "-q"]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            ends = _cli_ends(run_dir)
        else:
            cmd = [sys.executable, __file__, "--child", variant, "--epochs", str(args.epochs), "--batch-size",
                   str(args.batch_size), "--threads", str(args.threads), "--seed", str(args.seed), "--run-dir",
                   str(run_dir)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            ends = json.loads(out.strip().splitlines()[-1])
    return {"epoch_s": [b - a for a, b in zip(ends, ends[1:])]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=6, help="epochs per run (the first is left out)")
    ap.add_argument("--repeats", type=int, default=5, help="runs of each variant, interleaved")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch threads, every variant alike")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma-separated, of " + ",".join(VARIANTS + SPLIT))
    ap.add_argument("--child", choices=("plain", "fit", "averager") + SPLIT, help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        if args.child == "fit":
            ends = _fit(args.epochs, args.batch_size, args.threads, args.seed, args.run_dir)
        else:
            ends = _own_loop(args.epochs, args.batch_size, args.threads, args.seed,
                             None if args.child == "averager-bare" else args.run_dir,
                             averaged=args.child != "plain", checkpoint_every=0 if args.child == "averager-nockpt" else 1)
        print(json.dumps(ends))
        return 0
    if args.epochs < 2:
        ap.error("--epochs must be >= 2 (the first epoch is left out)")
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS + SPLIT))
    if unknown:
        ap.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS + SPLIT)}")
    if "plain" not in variants:
        variants.insert(0, "plain")
    from flodl_mpi.training.data import default_digits_path, ensure_digits, load_dataset

    ensure_digits(default_digits_path())
    n = load_dataset(default_digits_path()).train.n
    epoch_ms: dict[str, list[float]] = {v: [] for v in variants}
    ratios: dict[str, list[float]] = {v: [] for v in variants if v != "plain"}
    for rep in range(args.repeats):
        this = {}
        for v in variants:
            this[v] = 1e3 * statistics.median(run_variant(v, args)["epoch_s"][1:])
            epoch_ms[v].append(this[v])
        for v in ratios:
            ratios[v].append(this["plain"] / this[v])
        print(f"repeat {rep + 1}/{args.repeats}: " + ", ".join(f"{v} {this[v]:.0f} ms" for v in variants),
              flush=True)
    print(f"\nworld of one, digits ({n} samples, batch {args.batch_size}), built-in MLP, Adam, {args.threads} torch "
          f"thread(s), {args.epochs} epochs (first left out); medians of {args.repeats} repeats:")
    print(f"{'variant':>9} {'epoch ms':>9} {'samples/s':>10} {'ours/plain':>11}")
    for v in variants:
        ms = statistics.median(epoch_ms[v])
        ratio = f"{statistics.median(ratios[v]):.3f}" if v in ratios else "1"
        print(f"{v:>9} {ms:9.1f} {1e3 * n / ms:10.0f} {ratio:>11}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
