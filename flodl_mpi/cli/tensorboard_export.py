"""``flodl-mpi report --tensorboard DIR``: a run's metrics as TensorBoard event files.

Invariant: the events are written by TensorBoard's own writer
(``torch.utils.tensorboard.SummaryWriter``, which needs the ``tensorboard``
package: the ``tensorboard`` extra), one sub-directory per run, so runs overlay in
TensorBoard's charts as they do in the report's plots. Only reads metrics.h5.

Tags (step = epoch counted from 1, or the round index):
``epoch/train_loss``, ``epoch/test_loss``, ``epoch/test_accuracy``,
``epoch/throughput_rank<r>`` (samples/s), ``epoch/batches_done_rank<r>`` (the rank's
share of the epoch's batches done) and ``epoch/allocation_rank<r>`` (the policy's
allocation, ``per_rank_batch_share``: one name, one quantity, as the report's),
``round/divergence_rank<r>``, ``round/<phase>_ms`` (mean over ranks) for pack,
allreduce, unpack, and ``round/anchor`` when the column is there.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from flodl_mpi.outputs.run_reader import Run

__all__ = ["scalars", "write_events"]


def _rows_of(present: np.ndarray | None, y: np.ndarray) -> np.ndarray:
    """`Run.present`'s mask for ``y`` (every row when the file gives none of that shape)."""
    return present if present is not None and present.shape == y.shape else np.ones(y.shape, dtype=bool)


def scalars(run: Run) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """tag -> (steps int64 (n,), values float64 (n,)) of one run; absent columns give no tag."""
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    epochs = run.column("epochs", "epoch")
    if epochs is not None:
        step = epochs.astype(np.int64)  # metrics.h5 counts epochs from 1, as train.log does
        for tag, col in (("train_loss", "avg_loss"), ("test_loss", "test_loss"), ("test_accuracy", "test_accuracy")):
            y = run.column("epochs", col)
            if y is not None:
                out[f"epoch/{tag}"] = (step, y.astype(np.float64))
        present = run.present("epochs")
        done = run.per_rank("epochs", "per_rank_batches")
        if done is not None:
            with np.errstate(invalid="ignore", divide="ignore"):
                total = np.nansum(done, axis=1, keepdims=True)
                done = np.where(total > 0, done / np.where(total > 0, total, 1.0), np.nan)
        for tag, col in (("throughput", "per_rank_throughput"), ("batches_done", None),
                         ("allocation", "per_rank_batch_share")):
            y = done if col is None else run.per_rank("epochs", col)
            if y is not None:
                keep = _rows_of(present, y)
                for r in range(y.shape[1]):  # only the epochs whose world had rank r (a resume may change it)
                    out[f"epoch/{tag}_rank{r}"] = (step[keep[:, r]], y[keep[:, r], r])
    rounds = run.column("rounds", "round")
    if rounds is not None:
        step = rounds.astype(np.int64)
        present = run.present("rounds")
        div = run.per_rank("rounds", "divergence")
        if div is not None:
            keep = _rows_of(present, div)
            for r in range(div.shape[1]):
                out[f"round/divergence_rank{r}"] = (step[keep[:, r]], div[keep[:, r], r])
        for phase in ("pack_ms", "allreduce_ms", "unpack_ms"):
            y = run.per_rank("rounds", phase)
            if y is not None:  # the mean over the ranks the round's world had
                with np.errstate(invalid="ignore"), warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)  # a round no rank timed: NaN
                    out[f"round/{phase}"] = (step, np.nanmean(y, axis=1))
        anchor = run.column("rounds", "anchor")
        if anchor is not None:
            out["round/anchor"] = (step, anchor.astype(np.float64))
    return out


def write_events(runs: Sequence[Run], log_dir: Path) -> list[Path]:
    """Write each run's `scalars` under ``log_dir/<run label>``; returns those directories.

    Raises:
        ImportError: tensorboard is not installed.
    """
    import tensorboard  # noqa: F401  (fail here with a clear ImportError, before torch's wrapper does)
    from torch.utils.tensorboard import SummaryWriter

    dirs = []
    for run in runs:
        d = Path(log_dir) / run.label
        with SummaryWriter(log_dir=str(d)) as writer:
            for tag, (steps, values) in scalars(run).items():
                for s, v in zip(steps.tolist(), values.tolist()):
                    writer.add_scalar(tag, v, global_step=s)
        dirs.append(d)
    return dirs
