"""The validation split (``--val-fraction``): held out of the training set once, from the run's seed.

Invariant: the split is a function of the training set's size, the fraction and ``--seed``
only, so every rank holds the same one, a resume finds the same one, and the batch plan
then runs over the training samples left; the held-out samples are never trained on. No MPI.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from flodl_mpi.training.data import Dataset, Split

__all__ = ["VAL_STREAM", "settle_validation", "split_validation", "validation_counts"]

#: The seed sequence's second word for the split's draw (``[seed, VAL_STREAM]``), apart from the
#: epochs' orders (`flodl_mpi.training.data.epoch_permutation`).
VAL_STREAM = 0x76616C


def validation_counts(n: int, fraction: float) -> tuple[int, int]:
    """``(train, val)`` samples of ``n`` with ``round(fraction × n)`` held out (at least 1 each).

    Raises:
        ValueError: ``n`` < 2 (nothing to split) — one line naming the option.
    """
    if n < 2:
        raise ValueError(f"--val-fraction {fraction:g}: the training set has {n} sample(s), too few to split")
    val = min(max(1, round(fraction * n)), n - 1)
    return n - val, val


def split_validation(data: Dataset, fraction: float | None, seed: int) -> Dataset:
    """``data`` with ``fraction`` of its training samples moved to ``val`` (None: ``data`` as it is).

    The held-out samples are ``permutation[:val]`` of ``np.random.default_rng([seed, VAL_STREAM])``;
    both parts keep the file's order (sorted indices). ``x`` stays float32 C-contiguous.

    Raises:
        ValueError: as `validation_counts`.
    """
    if fraction is None:
        return data
    n = data.train.n
    _, val = validation_counts(n, fraction)
    held = np.zeros(n, dtype=bool)
    held[np.random.default_rng([int(seed), VAL_STREAM]).permutation(n)[:val]] = True
    return dataclasses.replace(data, train=_part(data.train, ~held), val=_part(data.train, held))


def _part(split: Split, mask: np.ndarray) -> Split:
    """The rows of ``split`` where ``mask``: copied from in-memory features, a view of streamed ones
    (`flodl_mpi.training.rows.RowsView`: still read only as they are indexed)."""
    if isinstance(split.x, np.ndarray):
        return Split(x=np.ascontiguousarray(split.x[mask]), y=split.y[mask])
    from flodl_mpi.training.rows import RowsView

    return Split(x=RowsView(split.x, np.flatnonzero(mask)), y=split.y[mask])


def settle_validation(data: Dataset, cfg) -> Dataset:
    """The run's data with its validation set: ``cfg.val_fraction`` split off, or the data's own.

    The data's own is a ``val/`` group of the HDF5 file (`flodl_mpi.training.data.load_dataset`)
    or :func:`flodl_mpi.fit`'s validation split; ``--val-fraction`` beside one is refused, and
    so are the options that choose on a validation set without one.

    Raises:
        ValueError: one line (exit 2): both a fraction and the data's own, or ``--keep-best``,
            ``--early-stop``, ``--test-every-epoch`` without a validation set.
    """
    if cfg.val_fraction is not None and data.val is not None:
        raise ValueError(
            f"--val-fraction {cfg.val_fraction:g}: {data.source!r} holds a validation set "
            f"already ({data.val.n} samples); use one or the other"
        )
    data = split_validation(data, cfg.val_fraction, cfg.seed)
    if data.val is None:
        asked = [
            f"--{n.replace('_', '-')}"
            for n in ("test_every_epoch", "keep_best", "early_stop")
            if getattr(cfg, n) not in (None, False)
        ]
        if asked:
            raise ValueError(
                f"{', '.join(asked)} need{'s' if len(asked) == 1 else ''} a validation set: add "
                "--val-fraction F or a val/ group to the data (the test set is not for choosing a model)"
            )
    return data
