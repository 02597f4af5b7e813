"""Rank 0's recorder: turns the gathered control rows into ``metrics.h5`` rows for the writer thread.

Invariant: only rank 0 holds a :class:`Recorder`; every other rank holds a
:class:`NoRecorder`, whose methods do nothing, so the callers (the bridge) never check
which rank they are on. A round's row is complete only when its acks (divergence,
timings) arrive with the next control gather (SPEC §2 step 9), so the recorder keeps
one round pending; nothing here enters a collective.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from flodl_mpi.protocol.control import ACK
from flodl_mpi.protocol.epoch_report import BATCH_COLUMNS, EpochSummary

__all__ = ["COHORT_ACKS", "NoRecorder", "Recorder", "batch_columns", "recorder_for"]

#: The acks stored as one value for the whole cohort, rank 0's, a scalar column: ``post_norm``
#: is the same on every rank; ``bytes`` is what rank 0 put on the wire (in a hierarchical round
#: across nodes a node leader also sends the leaders' exchange, so another rank's may differ). Every other `flodl_mpi.protocol.control.ACK` column is stored per rank,
#: ``(W,)``, under its own name: a new ack column needs only its ``rounds`` column in
#: `flodl_mpi.outputs.metrics.table_schema` (and its line in docs/file-formats.rst).
COHORT_ACKS = ("post_norm", "bytes")


class NoRecorder:
    """The recorder of a rank that writes nothing (every rank but 0)."""

    def round(self, **record) -> None:
        """Keep a round's record until its acks arrive (nothing to keep here)."""

    def acks(self, acks: Mapping[str, np.ndarray], verdict: int | None) -> None:
        """Complete the pending round's record with the gathered acks (nothing here)."""

    def epoch(self, summary: EpochSummary, batch_table: np.ndarray | None, time_s: float) -> None:
        """Write an epoch's row and its batch records (nothing here)."""


class Recorder(NoRecorder):
    """Rank 0's recorder over a ``MetricsWriter`` (its ``append(table, rows)`` and ``append_held(table, row)``).

    Args:
        writer: rank 0's metrics writer; ``append`` validates and queues, the writer
            thread writes (so no disk I/O happens on the bridge thread).
    """

    def __init__(self, writer) -> None:
        self._writer = writer
        self._pending: dict | None = None

    def round(self, **record) -> None:
        """Hold one round's own facts (``rounds`` columns but the ack ones and ``guard``).

        The previous pending record, if its acks never came (the run ended), is dropped:
        a round's row needs its divergence.
        """
        self._pending = record

    def acks(self, acks: Mapping[str, np.ndarray], verdict: int | None) -> None:
        """Complete and append the pending record: per-rank acks (``ACK`` columns) and the
        guard's verdict on that round (None counts as stable: no round before it)."""
        if self._pending is None:
            return
        rec = dict(self._pending)
        per_rank = {n: acks[n] for n in ACK.names if n not in COHORT_ACKS}
        rec.update(per_rank, post_norm=float(acks["post_norm"][0]), bytes=int(acks["bytes"][0]),
                   guard=0 if verdict is None else int(verdict))
        # Held by the writer and appended in blocks (a round may come every few ms): the values are
        # copies or views of this round's gathered matrix, which nothing writes again.
        self._writer.append_held("rounds", rec)
        self._pending = None

    def epoch(self, summary: EpochSummary, batch_table: np.ndarray | None, time_s: float) -> None:
        """Append the gathered batch records ``(k, len(BATCH_COLUMNS))`` and the epoch's row."""
        if batch_table is not None and len(batch_table):
            self._writer.append("batches", batch_columns(batch_table))
        self._writer.append("epochs", _epoch_row(summary, time_s))


def batch_columns(batch_table: np.ndarray) -> dict[str, np.ndarray]:
    """The ``batches`` table's columns of gathered batch records, float64 ``(k, len(BATCH_COLUMNS))``."""
    cols = {name: batch_table[:, i] for i, name in enumerate(BATCH_COLUMNS)}
    for name in ("rank", "epoch", "step"):
        cols[name] = cols[name].astype(np.int64)
    cols["rank"] = cols["rank"].astype(np.int32)
    return cols


def recorder_for(rank: int, writer) -> NoRecorder:
    """Rank 0 with a writer (`MetricsWriter.writes`) records; every other rank holds a :class:`NoRecorder`."""
    return Recorder(writer) if rank == 0 and getattr(writer, "writes", False) else NoRecorder()


def _epoch_row(s: EpochSummary, time_s: float) -> dict[str, np.ndarray]:
    row = {
        # epoch counted from 1, as in the log and the checkpoint names
        "epoch": s.epoch + 1, "time_s": time_s, "rounds": s.rounds, "avg_loss": s.avg_loss,
        "epoch_ms": s.epoch_ms, "batches": s.batches, "per_rank_loss": s.per_rank_loss,
        "per_rank_batches": s.per_rank_batches, "per_rank_samples": s.per_rank_samples,
        "per_rank_throughput": s.per_rank_throughput, "per_rank_batch_share": s.per_rank_batch_share,
        "per_rank_epoch_ms": s.per_rank_epoch_ms, "per_rank_compute_ms": s.per_rank_compute_ms,
        "per_rank_data_ms": s.per_rank_data_ms, "per_rank_share_complete_ms": s.per_rank_share_complete_ms,
        "test_loss": s.test_loss, "test_accuracy": s.test_accuracy, "nonfinite_batches": s.nonfinite_batches,
        "val_loss": s.val_loss, "val_accuracy": s.val_accuracy,
    }
    return {k: np.asarray([v]) for k, v in row.items()}

