"""Gradient accumulation (``--accumulate K``): one optimizer step over K micro-batches.

Invariant: the batch plan's unit is the optimizer step of ``batch_size × K`` samples
(``TrainConfig.step_samples``), cut by the plan's own rules
(`flodl_mpi.training.data.num_batches`, ``batch_indices``); a step's samples are then
cut into micro-batches of ``batch_size`` by the same rules (a lone left-over sample
joins the micro-batch before it). So the epoch's coverage is the plan's, exactly, and
the summed, sample-weighted micro-batch losses are the step's mean loss: the gradient
is the one a batch of ``batch_size × K`` gives. No torch, no MPI.
"""

from __future__ import annotations

import numpy as np

from flodl_mpi.training.data import batch_indices, num_batches, smallest_batch

__all__ = ["micro_batches", "smallest_micro_batch"]


def micro_batches(step: np.ndarray, batch_size: int) -> list[tuple[np.ndarray, float]]:
    """The micro-batches of one optimizer step's sample indices, each with its loss weight.

    Args:
        step: the step's sample indices, shape (m,), m >= 1.
        batch_size: samples per micro-batch, >= 1.

    Returns:
        ``[(indices, weight), ...]``: views of ``step`` covering it once, in order, each of
        ``batch_size`` samples (the last may hold fewer, or ``batch_size + 1``: the plan's
        rule), ``weight = len(indices) / m`` (the weights sum to 1). A step of at most
        ``batch_size + 1`` samples is one micro-batch of weight 1.0 exactly.
    """
    m = len(step)
    count = num_batches(m, batch_size)
    if count == 1:
        return [(step, 1.0)]
    return [(part, len(part) / m) for part in (batch_indices(step, batch_size, j) for j in range(count))]


def smallest_micro_batch(n_samples: int, batch_size: int, accumulate: int, drop_last: bool = False) -> int:
    """The fewest samples any micro-batch of an epoch holds (0: ``drop_last`` leaves no step).

    With ``accumulate`` 1 this is `flodl_mpi.training.data.smallest_batch`. Otherwise every
    step holds ``batch_size × accumulate`` samples but the last (``drop_last``: every one),
    whose micro-batches are cut by `micro_batches`.
    """
    if accumulate == 1:
        return smallest_batch(n_samples, batch_size, drop_last)
    step = batch_size * accumulate
    steps = num_batches(n_samples, step, drop_last)
    if steps == 0:
        return 0
    last = step if drop_last else n_samples - (steps - 1) * step
    smallest = smallest_batch(last, batch_size)
    return min(batch_size, smallest) if steps > 1 else smallest
