"""Rounds at real size: a round's cost against the step's compute, per policy, at 11 M and 100 M parameters.

Issue 24 item 5. Run under the MPICH wheel's environment, two ranks (each launched here)::

    python benchmarks/lm/rounds_at_size.py [--sizes medium large] [--steps 6] [--batch-size 2]
                                           [--methods ddp sync window async] [--window 3]

For each model size (``benchmarks/lm/model.py``: ``medium`` 10.9 M, ``large`` 99.7 M parameters,
byte vocabulary, context 128) it writes a data file of GCIDE text (``corpus.py``; Debian's
``dict-gcide``) holding exactly ``2 x steps x batch`` training sequences, so one epoch is
``--steps`` optimizer steps per rank, and trains one epoch with Adam at 2 ranks, once per method:

- ``ddp``: the peer, ``benchmarks/ddp_baseline.py`` (DistributedDataParallel over gloo: its
  gradient all-reduce each step, overlapped with the backward);
- ``sync``: ``flodl-mpi train --policy sync`` (a round after every step);
- ``window``: ``--policy window --window H`` (a round every H steps);
- ``async``: ``--policy async`` (the round runs while the next window trains).

What it reads back, per method (ours from metrics.h5, the rows every run writes):

- ``step ms``: the epoch's training wall time over its steps (ours: ``epochs/per_rank_epoch_ms``
  holds the test evaluation too, so the batches' time: the sum of ``batches/batch_ms`` and
  ``rounds/wait_ms`` per rank over its steps, the slower rank's; DDP: rank 0's training loop's wall
  time over its steps, the evaluation excluded);
- ``compute ms``: ours, the median ``batches/batch_ms`` (forward, backward, optimizer step);
- ``round ms``: ours, the median of the rounds' ``round_ms`` (the bridge's time in a round after the
  control gather: pack, reduce, unpack) and their ``bytes`` per rank;
- ``blocked``: ours, the training thread's time waiting for consensus (``rounds/wait_ms``, summed)
  as a share of the steps' time: what the averaging costs the training, per policy;
- ``peak RSS``: each rank's peak resident memory (``ru_maxrss`` of the rank's process), max over the
  ranks; the averaging's addition is ours less DDP's at the same size (DDP holds its own gradient
  buckets, about one model's worth), beside the model's float32 bytes for scale.

Every figure is one run of a few steps on a shared machine: the load is printed with each size.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))
from benchmarks.runs import MPIEXEC, ROOT, _env  # noqa: E402  (the benchmarks' own launcher and environment)

RANKS = 2
CONTEXT = 128
METHODS = ("ddp", "sync", "window", "async")


def peak_rss_child(out_dir: str, argv: list[str]) -> int:
    """Run ``argv`` (this rank's process: it inherits the launcher's environment) and write its peak resident
    memory (KiB, ``ru_maxrss`` of the children) to ``out_dir/rss-<rank>``; returns its exit status."""
    status = subprocess.call(argv, close_fds=False)  # the launcher's PMI socket too (MPICH's PMI_FD)
    rank = os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or "0"
    Path(out_dir, f"rss-{rank}").write_text(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))
    return status


def make_data(path: Path, steps: int, batch: int) -> int:
    """A GCIDE data file with exactly ``RANKS x steps x batch`` training sequences and ``RANKS x batch`` test
    ones, context `CONTEXT`; returns the training rows. Raises SystemExit without dict-gcide."""
    full = path.with_suffix(".full.h5")
    need = RANKS * steps * batch
    proc = subprocess.run([sys.executable, str(HERE / "corpus.py"), str(full), "--train-bytes",
                           str(4 * need * (CONTEXT + 1)), "--context", str(CONTEXT), "--block-bytes", "4096"],
                          capture_output=True, text=True, env=_env(), check=False)
    if proc.returncode != 0:
        raise SystemExit(f"benchmarks/lm/rounds_at_size.py: corpus.py failed: {proc.stderr.strip()[-500:]}")
    with h5py.File(full, "r") as src, h5py.File(path, "w") as dst:
        for key, value in src.attrs.items():
            dst.attrs[key] = value
        for split, n in (("train", need), ("test", RANKS * batch)):
            for part in ("x", "y"):
                ds = src[f"{split}/{part}"]
                if len(ds) < n:
                    raise SystemExit(f"{full}: {split}/{part} has {len(ds)} rows, fewer than {n}")
                dst[f"{split}/{part}"] = ds[:n]
                for key, value in ds.attrs.items():
                    dst[f"{split}/{part}"].attrs[key] = value
    full.unlink()
    return need


def _launch(argv: list[str], rss_dir: Path) -> subprocess.CompletedProcess:
    rss_dir.mkdir(parents=True, exist_ok=True)
    cmd = [MPIEXEC, "-n", str(RANKS), sys.executable, str(Path(__file__).resolve()), "--peak-rss", str(rss_dir),
           "--", *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:6])} ... exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return proc


def _peak_mib(rss_dir: Path) -> float:
    return max(int(p.read_text()) for p in rss_dir.glob("rss-*")) / 1024


def run_ours(method: str, size: str, data: Path, batch: int, window: int, base: Path) -> dict:
    """One epoch of ``flodl-mpi train`` under ``method``'s policy; the figures of the module docstring."""
    from flodl_mpi.outputs.metrics import read_table

    run_dir = base / f"{size}-{method}"
    policy = {"sync": ["--policy", "sync"], "window": ["--policy", "window", "--window", str(window)],
              "async": ["--policy", "async"]}[method]
    _launch([sys.executable, "-m", "flodl_mpi", "train", "--model", f"{HERE / 'model.py'}:{size}", "--data",
             str(data), "--epochs", "1", "--batch-size", str(batch), "--optimizer", "adam", "--lr", "3e-4",
             *policy, "-q", "--run-dir", str(run_dir)], base / f"rss-{size}-{method}")
    rounds = read_table(run_dir / "metrics.h5", "rounds")
    batches = read_table(run_dir / "metrics.h5", "batches")
    steps = int(np.sum(batches["rank"] == 0))
    done = ~rounds["skipped"]
    wait = np.nansum(rounds["wait_ms"], axis=0)  # per rank
    busy = np.array([batches["batch_ms"][batches["rank"] == r].sum() for r in range(RANKS)])
    return {"steps": steps, "rounds": int(done.sum()),
            "step_ms": float(np.max((busy + wait) / steps)),
            "compute_ms": float(np.median(batches["batch_ms"])),
            "round_ms": float(np.nanmedian(rounds["round_ms"][done])) if done.any() else float("nan"),
            "bytes": int(np.median(rounds["bytes"][done])) if done.any() else 0,
            "blocked": float(np.max(wait / (busy + wait))),
            "peak_mib": _peak_mib(base / f"rss-{size}-{method}")}


def run_ddp(size: str, data: Path, batch: int, base: Path) -> dict:
    """One epoch of ``benchmarks/ddp_baseline.py``: its steps' wall time per step and the ranks' peak RSS."""
    out = base / f"ddp-{size}.json"
    t0 = time.monotonic()
    _launch([sys.executable, str(ROOT / "benchmarks" / "ddp_baseline.py"), "--model", f"{HERE / 'model.py'}:{size}",
             "--data", str(data), "--epochs", "1", "--batch-size", str(batch), "--optimizer", "adam", "--lr", "3e-4",
             "--out", str(out)], base / f"rss-{size}-ddp")
    wall = time.monotonic() - t0
    got = json.loads(out.read_text())
    epoch = got["epochs"][0]
    steps = int(epoch["steps"])
    return {"steps": steps, "rounds": steps, "step_ms": 1000 * float(epoch["train_s"]) / steps,
            "compute_ms": float("nan"), "round_ms": float("nan"), "bytes": int(got["bytes_per_rank"]) // steps,
            "blocked": float("nan"), "peak_mib": _peak_mib(base / f"rss-{size}-ddp"), "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--peak-rss"]:  # a rank's wrapper: --peak-rss DIR -- ARGV
        return peak_rss_child(argv[1], argv[3:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["medium", "large"], choices=["tiny", "small", "medium", "large"])
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per rank (one epoch)")
    p.add_argument("--batch-size", type=int, default=2, help="sequences of 128 bytes per step and rank")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--window", type=int, default=3, help="H of the window method")
    p.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    args = p.parse_args(argv)
    sys.path.insert(0, str(HERE))
    import model as lm_model

    table = {}
    base = Path(tempfile.mkdtemp(prefix="flodl-rounds-at-size-"))
    try:
        for size in args.sizes:
            params = lm_model.count_parameters(lm_model.gpt((CONTEXT,), 256, size))
            data = base / f"{size}.h5"
            make_data(data, args.steps, args.batch_size)
            load = os.getloadavg()[0]
            rows = {}
            for method in args.methods:
                rows[method] = (run_ddp(size, data, args.batch_size, base) if method == "ddp" else
                                run_ours(method, size, data, args.batch_size, args.window, base))
                for f in base.glob(f"{size}-{method}/checkpoints/*.h5"):
                    f.unlink()  # a large model's checkpoint is 1.2 GB: one at a time on disk
            table[size] = {"params": params, "load": [load, os.getloadavg()[0]], "rows": rows}
            print(f"\n{size}: {params / 1e6:.1f} M parameters ({4 * params / 2**20:.0f} MiB float32), {RANKS} ranks, "
                  f"batch {args.batch_size} x {CONTEXT} tokens, {args.steps} steps, load "
                  f"{load:.1f}-{os.getloadavg()[0]:.1f}")
            print(f"{'method':<8} {'steps':>5} {'rounds':>6} {'step ms':>9} {'compute ms':>10} {'round ms':>9} "
                  f"{'MiB/round':>9} {'blocked':>8} {'peak RSS MiB':>12}")
            for method, r in rows.items():
                name = f"window {args.window}" if method == "window" else method
                print(f"{name:<8} {r['steps']:>5} {r['rounds']:>6} {r['step_ms']:>9.0f} {r['compute_ms']:>10.0f} "
                      f"{r['round_ms']:>9.0f} {r['bytes'] / 2**20:>9.0f} {r['blocked']:>8.1%} {r['peak_mib']:>12.0f}")
            if "ddp" in rows:
                for method in (m for m in rows if m != "ddp"):
                    print(f"  {method}: step time {rows[method]['step_ms'] / rows['ddp']['step_ms']:.2f}x DDP's; "
                          f"peak RSS {rows[method]['peak_mib'] - rows['ddp']['peak_mib']:+.0f} MiB against DDP's")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
