"""A warning when a run with an outer optimizer is going wrong (issue 26 item 11).

Invariant: the rule reads only the cohort's epoch summaries (the same on every rank), so
it decides nothing any collective depends on; rank 0 says it, once per run.

The rule: with ``--outer slowmo`` or ``nesterov``, the epoch's training loss (the cohort's
mean, ``epochs/avg_loss``) has undone at least `UNDONE` of the progress the run made since
its first epoch, ``(loss − lowest) / (first − lowest)``, in each of the last `EPOCHS`
epochs. Why the training loss and not the test loss: on MNIST-1D healthy outer runs
(nesterov at windows 50 and 200, slowmo at 200: 0.89-0.90 test accuracy, as plain
averaging) overfit, their test loss doubling while the training loss goes on falling;
why a share of the progress and not a run of rises: at training losses near 0.05 those
runs rise three epochs in a row by noise. Measured (``python benchmarks/outer.py
--datasets mnist1d-adam ... --outer-momentum 0.9``, docs/benchmarks.rst, "Outer optimizers, measured"): SlowMo at Adam
4e-3, window 50, which falls from 0.70 test accuracy at epoch 10 to 0.38 at 40, undoes
12-17 % from epoch 13 on (the warning comes at epoch 15); of the healthy runs none undoes more than
6 % two epochs in a row (slowmo at window 50 undoes 10 % once, at epoch 3, early noise). Every diverging
SGD outer run of that table warns, at epoch 5 to 15.
A resumed run's watch starts again at its first epoch after the resume.
"""

from __future__ import annotations

import math

__all__ = ["EPOCHS", "UNDONE", "OuterWatch"]

#: The share of the progress since the first epoch that counts as undone.
UNDONE = 0.10
#: Epochs in a row that must each have undone it.
EPOCHS = 3


class OuterWatch:
    """Feed it each epoch's training loss; it answers once with a warning line when the rule holds.

    Args:
        kind: ``--outer`` (``avg``: never warns).
        lr, momentum: the outer step's settings in effect (for the line).
        api: word the options as :func:`flodl_mpi.fit`'s keywords.
    """

    def __init__(self, kind: str, lr: float, momentum: float, api: bool = False) -> None:
        self.kind, self.lr, self.momentum, self.api = kind, float(lr), float(momentum), api
        self.first: float | None = None
        self.lowest, self.lowest_epoch = math.inf, 0
        self.run = 0  # epochs in a row at or above UNDONE
        self.warned = False

    def undone(self, loss: float) -> float:
        """``(loss − lowest) / (first − lowest)``: 0 at the lowest so far, 1 back at the first epoch's (0 before
        any progress)."""
        progress = (self.first or 0.0) - self.lowest
        return (loss - self.lowest) / progress if progress > 0 else 0.0

    def observe(self, epoch: int, loss: float) -> str | None:
        """One epoch (0-based ``epoch``, its cohort training loss); the warning line the first time the rule holds.

        A non-finite loss (every batch excluded) is skipped: it neither counts nor breaks the run of epochs.
        """
        if self.kind == "avg" or self.warned or not math.isfinite(loss):
            return None
        if self.first is None:
            self.first = loss
        share = self.undone(loss)
        if loss < self.lowest:
            self.lowest, self.lowest_epoch = loss, epoch
        self.run = self.run + 1 if share >= UNDONE else 0
        if self.run < EPOCHS:
            return None
        self.warned = True
        if self.api:
            outer, lower, avg = f"outer={self.kind!r}", "outer_lr= or lr=", "outer='avg'"
        else:
            outer, lower, avg = f"--outer {self.kind}", "--outer-lr or --lr", "--outer avg"
        return (f"warning: epoch {epoch + 1}: the training loss ({loss:.4f}) has undone {share:.0%} of the run's "
                f"progress (epoch 1 {self.first:.4f}, lowest {self.lowest:.4f} at epoch {self.lowest_epoch + 1}) "
                f"and {UNDONE:.0%} or more in each of the last {EPOCHS} epochs, with {outer} (lr {self.lr:g}, "
                f"momentum {self.momentum:g}): the run is going wrong; the outer step is likely too large for this "
                f"inner learning rate: lower {lower}, or use {avg}")
