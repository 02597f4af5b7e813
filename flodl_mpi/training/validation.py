"""The validation split (``--val-fraction``): held out of the training set once, from the run's seed.

Invariant: the split is a function of the training set's size, the fraction and ``--seed``
only, so every rank holds the same one, a resume finds the same one, and the batch plan
then runs over the training samples left; the held-out samples are never trained on. No MPI.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from flodl_mpi.training.data import Dataset, Split

__all__ = ["VAL_STREAM", "split_validation", "validation_counts"]

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
    train = Split(x=np.ascontiguousarray(data.train.x[~held]), y=data.train.y[~held])
    return dataclasses.replace(
        data, train=train, val=Split(x=np.ascontiguousarray(data.train.x[held]), y=data.train.y[held])
    )
