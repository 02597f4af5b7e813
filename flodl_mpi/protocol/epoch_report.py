"""Per-epoch reporting: the vector each rank contributes and the cohort aggregate (SPEC §5).

Invariant: the aggregate is a pure function of the gathered ``(W, k)`` matrix,
so every rank computes the same numbers and user code acting on them (an early
stop, say) acts identically everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

__all__ = ["EPOCH_FIELDS", "BATCH_COLUMNS", "EpochReport", "EpochSummary", "aggregate_epoch", "excluded_words"]

#: Columns of a per-batch record, in order (float64 on the wire).
BATCH_COLUMNS = ("rank", "epoch", "step", "batch_ms", "data_ms", "loss", "lr", "param_norm")


@dataclass
class EpochReport:
    """One rank's epoch, sent in the epoch exchange.

    Attributes (all per rank, this epoch): ``loss_sum`` (sum of the finite batch
    losses), ``batches`` (trained), ``nonfinite_batches`` (of them, those whose loss was
    NaN or infinite: left out of ``loss_sum``; the round quarantines such a rank), ``samples`` (-1: not recorded, an own loop whose ``step()``
    calls did not give ``samples=``), ``epoch_ms`` (wall ms of the epoch's windows and
    rounds, evaluation excluded), ``compute_ms`` (forward, backward, step), ``data_ms`` (waiting
    for batches), ``test_loss_sum``, ``test_correct`` and ``test_count`` (this
    rank's slice of the test set, evaluated on the consensus; ``test_correct`` is
    NaN when the evaluation measures no accuracy, e.g. a regression; ``test_count`` 0:
    not evaluated this epoch), and ``val_loss_sum``, ``val_correct``, ``val_count``, the
    same of the validation set (``--val-fraction``; count 0: none).
    """

    loss_sum: float = 0.0
    batches: int = 0
    samples: int = 0
    epoch_ms: float = 0.0
    compute_ms: float = 0.0
    data_ms: float = 0.0
    test_loss_sum: float = 0.0
    test_correct: float = 0.0
    test_count: int = 0
    nonfinite_batches: int = 0
    val_loss_sum: float = 0.0
    val_correct: float = 0.0
    val_count: int = 0

    def to_row(self) -> np.ndarray:
        """float64 ``(len(EPOCH_FIELDS),)``."""
        return np.array([float(getattr(self, f)) for f in EPOCH_FIELDS], dtype=np.float64)


EPOCH_FIELDS = tuple(f.name for f in fields(EpochReport))


@dataclass
class EpochSummary:
    """The cohort's epoch, identical on every rank (SPEC §5 table).

    Per-rank arrays have shape ``(W,)``. ``per_rank_throughput`` is samples per
    second of compute plus data wait (``per_rank_share_complete_ms``, SPEC §5);
    ``per_rank_batch_share`` is the policy's latest allocation, normalized (the
    balancer's quotas; for a fixed window ``1 / W`` each);
    ``per_rank_samples`` is -1 and ``per_rank_throughput`` NaN for a rank whose
    samples were not recorded; ``test_accuracy`` is correct / count over the whole
    test set, NaN when no accuracy was measured (a regression, an own loop's metrics
    without ``accuracy``).
    """

    epoch: int
    rounds: int
    avg_loss: float
    epoch_ms: float
    batches: int
    per_rank_loss: np.ndarray
    per_rank_batches: np.ndarray
    per_rank_samples: np.ndarray
    per_rank_throughput: np.ndarray
    per_rank_batch_share: np.ndarray
    per_rank_epoch_ms: np.ndarray
    per_rank_compute_ms: np.ndarray
    per_rank_data_ms: np.ndarray
    per_rank_share_complete_ms: np.ndarray
    test_loss: float
    test_accuracy: float
    test_count: int
    #: Batches whose loss was not finite, over all ranks: left out of the losses.
    nonfinite_batches: int = 0
    #: Per-batch records gathered for this exchange (set by the bridge).
    batch_records: int = 0
    #: The validation set's mean loss and accuracy (``--val-fraction``), as ``test_*``; NaN: none.
    val_loss: float = float("nan")
    val_accuracy: float = float("nan")
    val_count: int = 0


def excluded_words(nonfinite_batches: int) -> str:
    """The log's note after the epoch's loss: `` (1 non-finite batch excluded)``; empty for none."""
    n = int(nonfinite_batches)
    return f" ({n} non-finite batch{'es' if n != 1 else ''} excluded)" if n else ""


def aggregate_epoch(matrix: np.ndarray, epoch: int, rounds: int, allocation=None) -> EpochSummary:
    """Aggregate the gathered epoch reports.

    Args:
        matrix: float64 ``(W, len(EPOCH_FIELDS))``, row r = rank r's report.
        epoch: the epoch index (0-based).
        rounds: rounds completed so far in the run.
        allocation: the policy's latest quotas ``(W,)`` (the balancer's allocation);
            None: each rank's share of the epoch's batches.

    Returns:
        :class:`EpochSummary`: ``avg_loss = Σ loss_sum / Σ (batches - nonfinite_batches)``
        (the finite batch losses' mean; NaN when there is none); ``epoch_ms``
        is the slowest rank's; a rank with no batches gets NaN loss and zero
        throughput (SPEC §5); a rank whose samples are not recorded (-1) NaN
        throughput; ``test_accuracy`` NaN unless every rank that evaluated
        test samples measured its correct count.
    """
    col = {name: matrix[:, i] for i, name in enumerate(EPOCH_FIELDS)}
    batches = col["batches"].astype(np.int64)
    total = int(batches.sum())
    nonfinite = col["nonfinite_batches"].astype(np.int64)
    finite = batches - nonfinite  # the batches whose loss is in loss_sum
    with np.errstate(invalid="ignore", divide="ignore"):
        per_rank_loss = np.where(finite > 0, col["loss_sum"] / np.maximum(finite, 1), np.nan)
        busy_s = (col["compute_ms"] + col["data_ms"]) / 1e3
        throughput = np.where(busy_s > 0, col["samples"] / np.where(busy_s > 0, busy_s, 1.0), 0.0)
    throughput = np.where(col["samples"] < 0, np.nan, throughput)
    test_loss, test_accuracy, test_count = _evaluated(col, "test")
    val_loss, val_accuracy, val_count = _evaluated(col, "val")
    if allocation is not None:
        alloc = np.asarray(allocation, dtype=np.float64)
        share = alloc / alloc.sum()
    else:
        share = batches / total if total else np.zeros_like(col["batches"])
    return EpochSummary(
        epoch=int(epoch),
        rounds=int(rounds),
        avg_loss=float(col["loss_sum"].sum() / finite.sum()) if finite.sum() else float("nan"),
        epoch_ms=float(col["epoch_ms"].max()),
        batches=total,
        per_rank_loss=per_rank_loss,
        per_rank_batches=batches,
        per_rank_samples=col["samples"].astype(np.int64),
        per_rank_throughput=throughput,
        per_rank_batch_share=share,
        per_rank_epoch_ms=col["epoch_ms"].copy(),
        per_rank_compute_ms=col["compute_ms"].copy(),
        per_rank_data_ms=col["data_ms"].copy(),
        per_rank_share_complete_ms=col["compute_ms"] + col["data_ms"],
        test_loss=test_loss,
        test_accuracy=test_accuracy,
        test_count=test_count,
        nonfinite_batches=int(nonfinite.sum()),
        val_loss=val_loss,
        val_accuracy=val_accuracy,
        val_count=val_count,
    )


def _evaluated(col: dict[str, np.ndarray], split: str) -> tuple[float, float, int]:
    """``(mean loss, accuracy, count)`` of ``split`` ("test" or "val") over the ranks' slices; NaN when
    nothing was evaluated, the accuracy NaN unless every rank that evaluated samples measured it."""
    count = int(col[f"{split}_count"].sum())
    correct = col[f"{split}_correct"][col[f"{split}_count"] > 0]  # ranks without samples say nothing
    measured = count > 0 and bool(np.all(np.isfinite(correct)))
    loss = float(col[f"{split}_loss_sum"].sum() / count) if count else float("nan")
    return loss, float(correct.sum() / count) if measured else float("nan"), count
