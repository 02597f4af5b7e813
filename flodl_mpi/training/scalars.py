"""The user's scalars (``record_scalar``) and the cohort's epoch boundary of the Python API.

Invariant: every rank records into its own book (sum and count per name, drained
per epoch); at the epoch boundary one allgather carries every rank's book, its
batches and its intents, so the aggregate — the batch-weighted mean of the ranks'
means (SPEC §5) — and the intents' effect are the same on every rank.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "INTENTS",
    "Boundary",
    "ScalarBook",
    "batch_weighted",
    "exchange",
    "pool_metrics",
    "record_scalar",
    "request",
    "scalar_rows",
]

#: What a rank may ask of the cohort for the next epoch boundary.
INTENTS = ("eval", "checkpoint")
#: Longest scalar name, UTF-8 bytes (the ``scalars/name`` column of metrics.h5).
MAX_NAME_BYTES = 64


class ScalarBook:
    """One rank's recorded scalars of the current epoch, and its pending intents (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sums: dict[str, list[float]] = {}
        self._intents: set[str] = set()

    def record(self, name: str, value) -> None:
        """Add ``value`` (a float, or a one-element tensor or array) under ``name``.

        Raises:
            TypeError: ``name`` is not a str, or ``value`` is not a real number.
            ValueError: ``name`` is empty or longer than 64 UTF-8 bytes.
        """
        if not isinstance(name, str):
            raise TypeError(f"record_scalar: name must be a str, got {type(name).__name__}")
        if not name or len(name.encode()) > MAX_NAME_BYTES:
            raise ValueError(f"record_scalar: name must be 1 to {MAX_NAME_BYTES} UTF-8 bytes, got {name!r}")
        try:
            v = float(value.item() if hasattr(value, "item") else value)
        except (TypeError, ValueError):
            raise TypeError(f"record_scalar({name!r}, ...): value must be a real number or a one-element tensor, "
                            f"got {type(value).__name__}") from None
        with self._lock:
            entry = self._sums.setdefault(name, [0.0, 0])
            entry[0] += v
            entry[1] += 1

    def request(self, intent: str) -> None:
        """Ask the cohort for ``intent`` (one of :data:`INTENTS`) at the next epoch boundary.

        Raises:
            ValueError: an unknown intent.
        """
        if intent not in INTENTS:
            raise ValueError(f"intent must be one of {', '.join(INTENTS)}, got {intent!r}")
        with self._lock:
            self._intents.add(intent)

    def drain(self) -> tuple[dict[str, tuple[float, int]], tuple[str, ...]]:
        """This epoch's ``{name: (sum, count)}`` and the pending intents; both are reset."""
        with self._lock:
            sums = {k: (float(s), int(c)) for k, (s, c) in self._sums.items()}
            intents = tuple(sorted(self._intents))
            self._sums.clear()
            self._intents.clear()
        return sums, intents

    def restore(self, sums: Mapping[str, tuple[float, int]], intents: Sequence[str] = ()) -> None:
        """Add ``{name: (sum, count)}`` and ``intents`` to the book: an epoch's state saved before a stop.

        A resumed epoch goes on from the sums its checkpoint holds, so its value adds
        the same numbers in the same order as an uninterrupted epoch's.
        """
        with self._lock:
            for name, (s, c) in sums.items():
                entry = self._sums.setdefault(str(name), [0.0, 0])
                entry[0] += float(s)
                entry[1] += int(c)
            self._intents.update(i for i in intents if i in INTENTS)


_active: list[ScalarBook] = []


def activate(book: ScalarBook | None) -> None:
    """Make ``book`` the one :func:`record_scalar` writes to (None: none)."""
    _active[:] = [] if book is None else [book]


def record_scalar(name: str, value) -> None:
    """Record one value of a named scalar on this rank, e.g. a loss term of the train step.

    Each rank keeps the sum and count per name; at the end of each epoch the
    cohort's value is the batch-weighted mean of the ranks' means,
    ``Σ_r b_r·(s_r / c_r) / Σ_r b_r`` over the ranks that recorded it (``b_r``:
    batches rank r trained in the epoch; SPEC §5), identical on every rank, and
    one row per name lands in ``metrics.h5``'s ``scalars`` table.

    Args:
        name: 1 to 64 UTF-8 bytes, e.g. ``"physics_residual"``.
        value: a real number (float, int, or a one-element tensor: ``.item()``
            is called, a sync point on a GPU).

    Raises:
        RuntimeError: no :func:`flodl_mpi.fit` run or :class:`flodl_mpi.Averager` is active.
        TypeError, ValueError: see :meth:`ScalarBook.record`.
    """
    if not _active:
        raise RuntimeError("record_scalar needs an active flodl_mpi.fit(...) run or an open flodl_mpi.Averager")
    _active[0].record(name, value)


def request(intent: str) -> None:
    """Ask for an evaluation (``"eval"``) or a checkpoint (``"checkpoint"``) at the next epoch boundary.

    Any rank may ask; the whole cohort acts at the same epoch boundary.

    Raises:
        RuntimeError: nothing is active. ValueError: an unknown intent.
    """
    if not _active:
        raise RuntimeError("request needs an active flodl_mpi.fit(...) run or an open flodl_mpi.Averager")
    _active[0].request(intent)


def batch_weighted(entries: Sequence[tuple[int, Mapping[str, tuple[float, int]]]]) -> dict[str, tuple[float, int]]:
    """The cohort's value of each scalar: the batch-weighted mean of the ranks' means (SPEC §5).

    Args:
        entries: per rank, ``(batches, {name: (sum, count)})``.

    Returns:
        ``{name: (value, total count)}``, names sorted. ``value = Σ_r b_r·m_r / Σ_r b_r``
        over the ranks r that recorded the name (``m_r = sum_r / count_r``); when
        none of those trained a batch (a value recorded outside training), the
        pooled mean ``Σ sum / Σ count``.
    """
    names = sorted({k for _, book in entries for k in book})
    out = {}
    for name in names:
        got = [(b, *book[name]) for b, book in entries if name in book and book[name][1] > 0]
        weight = sum(b for b, _, _ in got)
        if weight > 0:
            value = sum(b * (s / c) for b, s, c in got) / weight
        else:
            value = sum(s for _, s, _ in got) / max(sum(c for _, _, c in got), 1)
        out[name] = (float(value), int(sum(c for _, _, c in got)))
    return out


@dataclass
class Boundary:
    """What the cohort decided at one epoch boundary; identical on every rank.

    Attributes:
        scalars: ``{name: value}`` of :func:`batch_weighted`.
        counts: ``{name: total count}``.
        per_rank: ``{name: (means (W,), counts (W,))}``: NaN / 0 where a rank did not record it.
        intents: the intents any rank raised, sorted.
        asked_by: ``{intent: ranks that raised it}``.
        books: per rank, the ``{name: (sum, count)}`` it drained (what a mid-epoch checkpoint keeps).
    """

    scalars: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    per_rank: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    intents: tuple[str, ...] = ()
    asked_by: dict[str, tuple[int, ...]] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    metric_counts: dict[str, float] = field(default_factory=dict)
    books: list[dict[str, tuple[float, int]]] = field(default_factory=list)

    @property
    def eval_values(self) -> dict[str, float]:
        """The evaluation metrics as ``scalars`` table rows: ``eval/<name>``."""
        return {f"eval/{k}": v for k, v in self.metrics.items()}

    @property
    def eval_counts(self) -> dict[str, int]:
        return {f"eval/{k}": int(c) for k, c in self.metric_counts.items()}


def exchange(allgather, book: ScalarBook, batches: int,
             metrics: Mapping[str, tuple[float, float]] | None = None) -> Boundary:
    """Drain ``book`` and exchange it with every rank's (one allgather); decide identically everywhere.

    Collective: every rank calls it at the same epoch boundary.

    Args:
        allgather: ``obj -> list of W objects`` (``Bridge.allgather``).
        book: this rank's book.
        batches: batches this rank trained in the epoch (the scalars' weight).
        metrics: this rank's evaluation sums ``{name: (sum, count)}``; the cohort's
            value is ``Σ sum / Σ count`` over the ranks (NaN when the counts sum to 0).
    """
    sums, intents = book.drain()
    gathered = allgather((int(batches), sums, intents, dict(metrics or {})))
    totals = pool_metrics([m for *_, m in gathered])
    gathered = [g[:3] for g in gathered]
    W = len(gathered)
    agg = batch_weighted([(b, s) for b, s, _ in gathered])
    per_rank = {}
    for name in agg:
        means, counts = np.full(W, np.nan), np.zeros(W, dtype=np.int64)
        for r, (_, s, _) in enumerate(gathered):
            if name in s and s[name][1] > 0:
                means[r], counts[r] = s[name][0] / s[name][1], s[name][1]
        per_rank[name] = (means, counts)
    asked = {i: tuple(r for r, (_, _, mine) in enumerate(gathered) if i in mine) for i in INTENTS}
    return Boundary(
        scalars={k: v for k, (v, _) in agg.items()}, counts={k: c for k, (_, c) in agg.items()}, per_rank=per_rank,
        intents=tuple(i for i in INTENTS if asked[i]), asked_by={i: r for i, r in asked.items() if r},
        metrics={k: v for k, (v, _) in totals.items()}, metric_counts={k: c for k, (_, c) in totals.items()},
        books=[dict(s) for _, s, _ in gathered],
    )


def pool_metrics(books: Sequence[Mapping[str, tuple[float, float]]]) -> dict[str, tuple[float, float]]:
    """``{name: (Σ sum / Σ count, Σ count)}`` over the ranks' evaluation sums; NaN where the counts sum to 0."""
    out = {}
    for name in sorted({k for b in books for k in b}):
        s = sum(b[name][0] for b in books if name in b)
        c = sum(b[name][1] for b in books if name in b)
        out[name] = (float(s / c) if c else math.nan, float(c))
    return out


def scalar_rows(epoch: int, values: Mapping[str, float], counts: Mapping[str, int],
                per_rank: Mapping[str, tuple[np.ndarray, np.ndarray]], world_size: int) -> dict[str, np.ndarray] | None:
    """Rows of ``metrics.h5``'s ``scalars`` table for one epoch (counted from 1); None when there are none."""
    names = sorted(values)
    if not names:
        return None
    nan_w, zero_w = np.full(world_size, np.nan), np.zeros(world_size, dtype=np.int64)
    return {
        "epoch": np.full(len(names), int(epoch), dtype=np.int64),
        "name": np.array([n.encode() for n in names], dtype="S64"),
        "value": np.array([values[n] for n in names], dtype=np.float64),
        "count": np.array([counts.get(n, 0) for n in names], dtype=np.int64),
        "per_rank_mean": np.stack([per_rank.get(n, (nan_w, zero_w))[0] for n in names]).astype(np.float64),
        "per_rank_count": np.stack([per_rank.get(n, (nan_w, zero_w))[1] for n in names]).astype(np.int64),
    }

