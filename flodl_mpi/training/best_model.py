"""The best epoch so far and early stopping (``--keep-best METRIC``, ``--early-stop PATIENCE``).

Invariant: fed only the cohort's epoch summaries (identical on every rank), so every rank
reaches the same verdict at the same epoch, and a decision that ends the run or forces a
save is the same everywhere; its state travels in each checkpoint's meta (`meta`,
`restore`), so a resumed run decides as the uninterrupted one would. No MPI, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["BestWatch", "META_KEYS"]

#: The checkpoint meta keys of the watch's state (`BestWatch.meta`).
META_KEYS = ("best_metric", "best_value", "best_epoch", "bad_epochs", "early_stopped", "is_best", "keep_best")


@dataclass
class BestWatch:
    """Tracks the best value of a validation metric over complete epochs.

    Args:
        metric: ``"val_loss"`` (lower is better) or ``"val_accuracy"`` (higher is better).
        patience: ``--early-stop``: the run ends after this many complete epochs in a row
            without a better value; None: never.
        keep: ``--keep-best``: the best epoch's checkpoint is kept (`is_best` marks it).

    Attributes:
        best: the best value so far (NaN: none yet). best_epoch: its epoch, 1-based (0: none).
        bad_epochs: complete epochs since the best. early_stopped: the patience ran out.
        is_best: the latest observed epoch is the best so far.
    """

    metric: str
    patience: int | None = None
    keep: bool = False
    best: float = math.nan
    best_epoch: int = 0
    bad_epochs: int = 0
    early_stopped: bool = False
    is_best: bool = False

    def observe(self, epoch: int, value: float) -> bool:
        """A complete epoch's value (``epoch`` 1-based); True when it is a new best (strictly better).

        A NaN value (nothing measured) is never better: it counts toward the patience.
        """
        lower = self.metric.endswith("loss")
        better = math.isfinite(value) and (math.isnan(self.best) or (value < self.best if lower else value > self.best))
        if better:
            self.best, self.best_epoch, self.bad_epochs = float(value), int(epoch), 0
        else:
            self.bad_epochs += 1
        self.is_best = better
        self.early_stopped = self.patience is not None and self.bad_epochs >= self.patience
        return better

    def may_stop_next(self) -> bool:
        """Whether the next complete epoch may end the run (one more epoch without a better value)."""
        return self.patience is not None and self.bad_epochs + 1 >= self.patience

    def meta(self) -> dict[str, Any]:
        """The state as checkpoint meta values (`META_KEYS`; ``best_value`` NaN: none yet)."""
        return {
            "best_metric": self.metric,
            "best_value": float(self.best),
            "best_epoch": int(self.best_epoch),
            "bad_epochs": int(self.bad_epochs),
            "early_stopped": bool(self.early_stopped),
            "is_best": bool(self.is_best),
            "keep_best": bool(self.keep),
        }

    def restore(self, meta: dict[str, Any]) -> bool:
        """Take the state a checkpoint's ``meta`` holds for the same metric; False: it holds none (kept as is)."""
        if meta.get("best_metric") != self.metric:
            return False
        self.best, self.best_epoch = float(meta["best_value"]), int(meta["best_epoch"])
        self.bad_epochs, self.is_best = int(meta["bad_epochs"]), bool(meta["is_best"])
        # this run's patience decides (a resume may give more): the saved verdict is the saved patience's
        self.early_stopped = self.patience is not None and self.bad_epochs >= self.patience
        return True
