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

from flodl_mpi.outputs.metrics import table_schema
from flodl_mpi.protocol.control import ACK
from flodl_mpi.protocol.epoch_report import BATCH_COLUMNS, EpochSummary
from flodl_mpi.protocol.membership import Membership, MembershipChange

__all__ = ["COHORT_ACKS", "NoRecorder", "Recorder", "batch_columns", "keyed_by_id", "membership_row", "recorder_for"]

#: The acks stored as one value for the whole cohort, rank 0's, a scalar column: ``post_norm``
#: is the same on every rank; ``bytes`` is what rank 0 put on the wire (in a hierarchical round
#: across nodes a node leader also sends the leaders' exchange, so another rank's may differ). Every other `flodl_mpi.protocol.control.ACK` column is stored per rank,
#: ``(W,)``, under its own name: a new ack column needs only its ``rounds`` column in
#: `flodl_mpi.outputs.metrics.table_schema` (and its line in docs/file-formats.rst).
#: ``link_bytes`` and ``link_ranks`` are planned from the model and the world, the same on every rank.
COHORT_ACKS = ("post_norm", "bytes", "link_bytes", "link_ranks")


class NoRecorder:
    """The recorder of a rank that writes nothing (every rank but 0)."""

    def round(self, **record) -> None:
        """Keep a round's record until its acks arrive (nothing to keep here)."""

    def acks(self, acks: Mapping[str, np.ndarray], verdict: int | None) -> None:
        """Complete the pending round's record with the gathered acks (nothing here)."""

    def epoch(self, summary: EpochSummary, batch_table: np.ndarray | None, time_s: float) -> None:
        """Write an epoch's row and its batch records (nothing here)."""

    def membership(self, change: MembershipChange, members: Membership) -> None:
        """Write a membership change's row and key later rows by stable id (nothing here)."""


class Recorder(NoRecorder):
    """Rank 0's recorder over a ``MetricsWriter`` (its ``append(table, rows)`` and ``append_held(table, row)``).

    Args:
        writer: rank 0's metrics writer; ``append`` validates and queues, the writer
            thread writes (so no disk I/O happens on the bridge thread).
    """

    def __init__(self, writer) -> None:
        self._writer = writer
        self._pending: dict | None = None
        #: The membership rows are keyed by once it changed (None: the launch ranks, rank = id).
        self._members: Membership | None = None

    def membership(self, change: MembershipChange, members: Membership) -> None:
        """Append ``change``'s ``membership`` row; from here on every row's per-rank values are keyed by
        the stable ids of ``members`` (the membership after the change), `keyed_by_id`.

        The pending round (the one the change cut off: its acks never come) is dropped. The
        writer's per-rank width must be ``members.width`` (`MetricsWriter`'s ``width``; a newcomer's
        id widens it: `MetricsWriter.take_over`).
        """
        self._pending = None
        self._members = members
        self._writer.append("membership", membership_row(change, members))

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
                   link_bytes=_int_or_fill(acks["link_bytes"][0]), link_ranks=_int_or_fill(acks["link_ranks"][0]),
                   guard=0 if verdict is None else int(verdict))
        if self._members is not None:
            rec = keyed_by_id("rounds", rec, self._members)
        # Held by the writer and appended in blocks (a round may come every few ms): the values are
        # copies or views of this round's gathered matrix, which nothing writes again.
        self._writer.append_held("rounds", rec)
        self._pending = None

    def epoch(self, summary: EpochSummary, batch_table: np.ndarray | None, time_s: float) -> None:
        """Append the gathered batch records ``(k, len(BATCH_COLUMNS))`` and the epoch's row."""
        batches, row = None, _epoch_row(summary, time_s)
        if batch_table is not None and len(batch_table):
            batches = batch_columns(batch_table)
        if self._members is not None:
            row = keyed_by_id("epochs", row, self._members, rows=True)
            if batches is not None:  # a batch's rank becomes its stable id
                batches["rank"] = np.asarray(self._members.ids, dtype=np.int32)[batches["rank"]]
        if batches is not None:
            self._writer.append("batches", batches)
        self._writer.append("epochs", row)


def batch_columns(batch_table: np.ndarray) -> dict[str, np.ndarray]:
    """The ``batches`` table's columns of gathered batch records, float64 ``(k, len(BATCH_COLUMNS))``."""
    cols = {name: batch_table[:, i] for i, name in enumerate(BATCH_COLUMNS)}
    for name in ("rank", "epoch", "step"):
        cols[name] = cols[name].astype(np.int64)
    cols["rank"] = cols["rank"].astype(np.int32)
    return cols


def _int_or_fill(v: float) -> int:
    """An integer ack as stored: its value, or -1 (the integer columns' padding) for NaN (no value)."""
    return -1 if np.isnan(v) else int(v)


def _fill(dtype: np.dtype):
    """metrics.h5's padding of a slot with no value: NaN (floats), False (booleans), -1 (integers)."""
    return np.nan if dtype.kind == "f" else (False if dtype.kind == "b" else -1)


def keyed_by_id(table: str, row: dict, members: Membership, rows: bool = False) -> dict:
    """``row`` with each per-rank value (index = rank) widened to ``(members.width,)`` (index = stable id).

    The slots of ids that are not ranks now hold the padding (`_fill`), so readers see
    them as absent (`flodl_mpi.outputs.run_reader.Run.per_rank`). ``rows``: the values
    carry a leading row axis (``(1, W)``, as `_epoch_row`'s).
    """
    out = dict(row)
    for name, (dtype, shape) in table_schema(1)[table].items():
        if shape and name in out:
            v = np.asarray(out[name])
            out[name] = members.scatter(v[0], _fill(v.dtype))[None] if rows else members.scatter(v, _fill(v.dtype))
    return out


def membership_row(change: MembershipChange, members: Membership) -> dict[str, np.ndarray]:
    """The ``membership`` table's row of ``change`` (one row, per-id columns ``(1, members.width)``).

    ``members`` is the membership after the change: its ranks give the ``rank`` column.

    Raises:
        ValueError: an id of ``change`` beyond ``members.width``, or ``change.world_size`` not
            ``members.world_size``.
    """
    width = members.width
    if any(i >= width for i in (*change.left, *change.joined)) or change.world_size != members.world_size:
        raise ValueError(f"the change (left {list(change.left)}, joined {list(change.joined)}, world size "
                         f"{change.world_size}) does not fit the membership (ids {list(members.ids)}, width {width})")
    left, joined = np.zeros((1, width), bool), np.zeros((1, width), bool)
    left[0, list(change.left)] = True
    joined[0, list(change.joined)] = True
    steps = np.zeros((1, width), np.int64)
    steps[0, list(change.left)] = change.steps_lost
    rank = members.scatter(np.arange(members.world_size, dtype=np.int32), -1)[None]
    return {"round": np.asarray([change.round]), "time_s": np.asarray([change.time_s]), "left": left,
            "joined": joined, "steps_lost": steps, "rank": rank, "world_size": np.asarray([change.world_size]),
            "detection_ms": np.asarray([change.detection_ms]), "recovery_ms": np.asarray([change.recovery_ms])}


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

