"""Run flodl-mpi and its peer as a user would, and read back what they achieved.

Shared by the convergence benchmarks (``outer.py`` and friends): each run is a
separate ``mpiexec`` of the venv's own launcher, so the numbers are the ones a
user gets from the command line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or "mpiexec"


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def run_flodl(ranks: int, args: list[str], run_dir: str | os.PathLike | None = None) -> dict:
    """``mpiexec -n ranks python -m flodl_mpi train ARGS``; per-epoch test metrics and bytes.

    Returns:
        ``{"test_accuracy": [per epoch], "test_loss": [...], "train_loss": [...], "rounds": int,
        "bytes_per_rank": int (params and buffers put into Allreduce by one rank),
        "seconds": float (the run's clock at its last epoch)}``; ``train_loss`` is the cohort's
        ``epochs/avg_loss``.

    Raises:
        RuntimeError: the run failed (its stderr tail in the message).
    """
    from flodl_mpi.outputs.metrics import read_table

    own = run_dir is None
    run_dir = Path(tempfile.mkdtemp(prefix="flodl-bench-")) / "run" if own else Path(run_dir)
    proc = subprocess.run([MPIEXEC, "-n", str(ranks), sys.executable, "-m", "flodl_mpi", "train", *args,
                           "--run-dir", str(run_dir)], capture_output=True, text=True, env=_env())
    if proc.returncode != 0:
        raise RuntimeError(f"flodl-mpi {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    epochs = read_table(run_dir / "metrics.h5", "epochs")
    rounds = read_table(run_dir / "metrics.h5", "rounds")
    out = {
        "test_accuracy": [float(v) for v in epochs["test_accuracy"]],
        "test_loss": [float(v) for v in epochs["test_loss"]],
        "train_loss": [float(v) for v in epochs["avg_loss"]],
        "rounds": int(len(rounds["round"])),
        "bytes_per_rank": int(np.sum(rounds["bytes"])),
        "seconds": float(epochs["time_s"][-1]),
    }
    if own:
        shutil.rmtree(run_dir.parent, ignore_errors=True)
    return out


def run_ddp(ranks: int, args: list[str]) -> dict:
    """``benchmarks/ddp_baseline.py`` under ``mpiexec``; same keys as :func:`run_flodl`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ddp.json"
        proc = subprocess.run([MPIEXEC, "-n", str(ranks), sys.executable, str(ROOT / "benchmarks" / "ddp_baseline.py"),
                               *args, "--out", str(out)], capture_output=True, text=True, env=_env())
        if proc.returncode != 0:
            raise RuntimeError(f"ddp_baseline {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
        res = json.loads(out.read_text())
    ep = res["epochs"]
    return {
        "test_accuracy": [e["test_accuracy"] for e in ep],
        "test_loss": [e["test_loss"] for e in ep],
        "rounds": None,
        "bytes_per_rank": int(res["bytes_per_rank"]),
        "seconds": float(ep[-1]["time_s"]),
    }


def mnist1d_file(cache: str | os.PathLike | None = None) -> Path:
    """MNIST-1D as a data file, generated once (``benchmarks/mnist1d_data.py``)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from mnist1d_data import write_mnist1d

    path = Path(cache or os.environ.get("FLODL_MPI_DATA_DIR") or Path.home() / ".cache" / "flodl_mpi") / "mnist1d.h5"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_mnist1d(path)
    return path
