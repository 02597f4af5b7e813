"""Runs trained once per test session and shared by the report/inspect/export tests (and, copied,
by the tests that need a finished run to resume or refuse), and a synthetic metrics.h5 whose
numbers are known exactly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from flodl_mpi.outputs.metrics import MetricsFile, table_schema
from tests.conftest import run_flodl

#: name -> (the run's arguments, its run dir, what it printed on stdout)
_CACHE: dict[str, tuple[tuple, Path, str]] = {}


def trained_run(tmp_path_factory, name: str, *args: str, ranks: int = 2) -> Path:
    """``mpiexec -n ranks flodl-mpi train --run-dir <tmp>/name ARGS``, once per session."""
    if name not in _CACHE:
        run_dir = tmp_path_factory.mktemp("runs") / name
        proc = run_flodl(ranks, "train", "--run-dir", str(run_dir), *args, timeout=400)  # generous: a loaded machine
        assert proc.returncode == 0, proc.stdout + proc.stderr
        _CACHE[name] = ((ranks, *args), run_dir, proc.stdout)
    assert _CACHE[name][0] == (ranks, *args), f"run {name} was trained with {_CACHE[name][0]}"
    return _CACHE[name][1]


def trained_stdout(name: str) -> str:
    """What the session's run ``name`` (`trained_run`, already trained) printed on stdout."""
    return _CACHE[name][2]


#: The finished run several modules share: ``mpiexec -n 2 flodl-mpi train --epochs 5`` (the defaults:
#: Adam, window 1, gamma 1; 1437 digits samples, batch 32: 45 batches, 23 rounds an epoch at 2 ranks;
#: the newest 3 checkpoints kept). It is test_end_to_end's 2-rank case, read by the report, export
#: and round-profile tests and copied by the tests that resume or refuse a finished run.
RUN_A_EPOCHS = 5
RUN_A = ("A", "--epochs", str(RUN_A_EPOCHS))


def session_run_a(tmp_path_factory) -> Path:
    """The session's run `RUN_A` (trained on first use; its stdout: ``trained_stdout("A")``). Read it; never
    change what it holds (``flodl-mpi report`` adds its plots/ there, as it does in any run dir)."""
    return trained_run(tmp_path_factory, *RUN_A)


def copy_of_run_a(tmp_path_factory, dest: Path) -> Path:
    """A copy at ``dest`` of `session_run_a`, for a test that resumes it or writes into it (the shared run
    stays as trained). A resume does not compare the run dir's path (`flodl_mpi.training.train.RESUME_MUST_MATCH`),
    so the copy resumes as the run would in place."""
    shutil.copytree(session_run_a(tmp_path_factory), dest)
    return dest


#: The session's window-policy run: the report's second run, and test_end_to_end's fixed-window case
#: (3 epochs at window 4 and gamma 0.5: its asserted windows, masses and accuracy are for these).
RUN_B = ("B", "--epochs", "3", "--window", "4", "--gamma", "0.5")


def session_run_b(tmp_path_factory) -> Path:
    """The session's run `RUN_B` (trained on first use; its stdout: ``trained_stdout("B")``): read it only."""
    return trained_run(tmp_path_factory, *RUN_B)


#: The session's async run: test_async_buffers' (3 epochs, the defaults otherwise: Adam, its state averaged
#: ``auto``), read by it and by test_async_state's ``auto`` case (which was a 1-epoch run of its own).
RUN_ASYNC = ("async", "--policy", "async", "--epochs", "3")


def session_run_async(tmp_path_factory) -> Path:
    """The session's run `RUN_ASYNC` (trained on first use): read it only."""
    return trained_run(tmp_path_factory, *RUN_ASYNC)


def synthetic_rows(world_size: int, rounds: int, epochs: int, skip: tuple[str, ...] = ()) -> dict[str, dict]:
    """Rows for every column of every table, from simple closed forms (see the tests)."""
    schema = table_schema(world_size)
    W, R, E = world_size, rounds, epochs
    r = np.arange(R)
    rows = {
        "rounds": {
            "round": r, "version": r + 1, "time_s": 0.5 * (r + 1), "skipped": r % 5 == 4,
            "steps": np.ones((R, W), np.int64), "mass": np.ones((R, W)),
            "divergence": 0.01 / (1 + r[:, None]) * (1 + np.arange(W)), "pre_norm": np.ones((R, W)),
            "post_norm": np.ones(R),
            "pack_ms": np.full((R, W), 10.0), "allreduce_ms": np.full((R, W), 30.0), "unpack_ms": np.full((R, W), 10.0),
            "bytes": np.full(R, 1000, np.int64), "window": np.ones((R, W), np.int64), "anchor": np.ones(R, np.int64),
            "guard": np.where(r == 3, 1, 0).astype(np.int8), "quarantined": np.zeros((R, W), bool),
            "outer_ms": np.zeros((R, W)), "quota": np.ones((R, W), np.int64), "batch_ms": np.full((R, W), 20.0),
            "round_ms": np.full((R, W), 50.0), "wait_ms": np.full((R, W), 61.0),
            "bridge_ms": np.full((R, W), 60.0), "control_ms": np.full((R, W), 2.0),
            "snapshot_ms": np.full((R, W), 1.0), "adopt_ms": np.full((R, W), 1.5),
            # 8 MB per rank over 2 ranks in 20 ms: 0.4 GB/s · 2(2 − 1)/2 = 0.4 GB/s
            "link_bytes": np.full(R, 8_000_000, np.int64), "link_ranks": np.full(R, 2, np.int64),
            "link_ms": np.full((R, W), 20.0), "busbw_gbs": np.full((R, W), 0.4),
        },
        "epochs": {
            "epoch": np.arange(E) + 1, "time_s": (R * 0.5) * (np.arange(E) + 1) / E, "rounds": (np.arange(E) + 1) * R // E,
            "avg_loss": 1.0 / (np.arange(E) + 1), "epoch_ms": np.full(E, 1000.0), "batches": np.full(E, 10 * W),
            "per_rank_loss": np.ones((E, W)), "per_rank_batches": np.tile(np.arange(1, W + 1) * 2, (E, 1)),
            "per_rank_samples": np.full((E, W), 320),
            "per_rank_throughput": np.tile(100.0 * (np.arange(W) + 1), (E, 1)),
            "per_rank_batch_share": np.full((E, W), 1.0 / W), "per_rank_epoch_ms": np.full((E, W), 1000.0),
            "per_rank_compute_ms": np.full((E, W), 600.0), "per_rank_data_ms": np.full((E, W), 50.0),
            "per_rank_share_complete_ms": np.full((E, W), 650.0),
            "test_loss": 2.0 / (np.arange(E) + 2),
            "test_accuracy": np.array([0.5, 0.9, 0.8][:E] + [0.85] * max(0, E - 3)),
            "nonfinite_batches": np.zeros(E, dtype=np.int64),
            "val_loss": np.full(E, np.nan), "val_accuracy": np.full(E, np.nan),  # (no validation set)
        },
        "batches": {c: np.zeros((1,), dtype=dt) for c, (dt, _) in schema["batches"].items()},
    }
    for spec in skip:
        table, col = spec.split("/")
        rows[table].pop(col)
    return rows


def write_synthetic(run_dir: Path, world_size: int = 2, rounds: int = 20, epochs: int = 3,
                    config: dict | None = None, attrs: dict | None = None) -> Path:
    """A run dir holding a metrics.h5 of `synthetic_rows` (every column) and config.json."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = {"epochs": epochs, "policy": "sync", "window": 1, "gamma": 1.0, "lr": 0.001, "run_dir": str(run_dir),
           **(config or {})}
    attrs = {"config": cfg, "policy": cfg["policy"], **(attrs or {})}
    with MetricsFile(run_dir / "metrics.h5", world_size, attrs) as m:
        for table, cols in synthetic_rows(world_size, rounds, epochs).items():
            m.append(table, cols)
    (run_dir / "config.json").write_text(json.dumps(cfg))
    return run_dir
