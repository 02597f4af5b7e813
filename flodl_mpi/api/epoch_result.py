"""What an epoch's end gives back to your loop, identical on every rank, and the evaluation sums it takes.

Invariant: an `EpochResult` holds only gathered values (the cohort's), so every rank reads the
same; the sums a rank gives are checked (`check_metrics`) before any collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["EpochResult", "check_metrics", "fill_test"]


@dataclass
class EpochResult:
    """The cohort's view of one epoch, identical on every rank.

    Attributes:
        epoch: counted from 1.
        summary: :class:`flodl_mpi.protocol.epoch_report.EpochSummary` (``avg_loss``,
            per-rank batches and throughput, ``test_loss`` / ``test_accuracy``
            when evaluation sums named ``loss`` / ``accuracy`` were given, ...).
        scalars: ``{name: value}``: :func:`flodl_mpi.record_scalar` values, the
            batch-weighted mean of the ranks' means (SPEC §5).
        metrics: ``{name: Σ sum / Σ count}`` of the evaluation sums every rank gave.
        intents: the intents any rank raised (``"eval"``, ``"checkpoint"``).
        checkpoint: path of the checkpoint saved at this boundary (rank 0), or None.
    """

    epoch: int
    summary: object
    scalars: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    intents: tuple[str, ...] = ()
    checkpoint: str | None = None


def check_metrics(metrics) -> dict[str, tuple[float, float]]:
    """A rank's evaluation sums as :meth:`flodl_mpi.Averager.end_epoch` takes them: ``{name: (sum, count)}``
    of floats (a one-element tensor is read with ``.item()``); None: ``{}``.

    Raises:
        TypeError: ``metrics`` is not a dict of ``(sum, count)`` pairs of numbers.
    """
    if metrics is None:
        return {}
    if not isinstance(metrics, dict):
        raise TypeError(f"metrics must be a dict {{name: (sum, count)}}, got {type(metrics).__name__}")
    out = {}
    for name, pair in metrics.items():
        try:
            s, c = pair
            out[str(name)] = (float(s.item() if hasattr(s, "item") else s), float(c.item() if hasattr(c, "item")
                                                                                   else c))
        except (TypeError, ValueError):
            raise TypeError(f"metrics[{name!r}] must be a (sum, count) pair of numbers, got {pair!r}") from None
    return out


def fill_test(report, sums: dict[str, tuple[float, float]]) -> None:
    """``loss`` / ``accuracy`` evaluation sums into the report's test columns (same count, or left out)."""
    if "loss" in sums:
        report.test_loss_sum, report.test_count = sums["loss"][0], int(sums["loss"][1])
        report.test_correct = float("nan")  # no accuracy measured: NaN, not 0 correct
        if "accuracy" in sums and int(sums["accuracy"][1]) == report.test_count:
            report.test_correct = round(sums["accuracy"][0])
