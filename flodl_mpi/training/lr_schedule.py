"""The learning rate at a cohort step: warm-up, the linear scaling rule, the decay (``--lr-schedule``).

Invariant: the factor is a pure function of the cohort step (the cohort's optimizer
steps so far: ``epoch × steps per epoch + step index``) and of the config and the
world size, never of state a rank carries; so every rank uses the same learning rate
at the same step, a resume goes on exactly where the run stopped, and a run at
another world size follows the same curve over the same cohort steps. No torch, no MPI.
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["decay_factor", "learning_rate_factor", "warmup_factor"]


def warmup_factor(cohort_step: int, warmup_steps: int, world_size: int, scale_lr: bool) -> float:
    """The warm-up and the linear scaling rule: the factor before any decay.

    The peak is ``W`` with ``scale_lr`` at ``W > 1`` ranks (the linear scaling rule),
    else 1. Over the first ``warmup_steps`` cohort steps the factor rises linearly to
    the peak, ``ramp = min(1, (step + 1) / warmup_steps)``: from 1 (the lr as given) with
    ``scale_lr`` (Goyal et al. 2017, "Accurate, Large Minibatch SGD", arXiv:1706.02677,
    §2.2: ``1 + (W - 1)·ramp``), from 0 without it (``ramp``: the step-0 factor is
    ``1 / warmup_steps``, torch.optim.lr_scheduler.LinearLR's ``start_factor``).

    Args:
        cohort_step: >= 0. warmup_steps: >= 0 (0: no warm-up). world_size: >= 1.

    Returns:
        float in (0, W].
    """
    ramp = 1.0 if warmup_steps <= 0 else min(1.0, (cohort_step + 1) / warmup_steps)
    if scale_lr and world_size > 1:
        return 1.0 + (world_size - 1) * ramp
    if scale_lr:  # a world of one: the scaled lr is the lr as given, nothing to warm up to
        return 1.0
    return ramp


def decay_factor(
    name: str, cohort_step: int, total_steps: int, warmup_steps: int, step_size: int | None = None, gamma: float = 0.1
) -> float:
    """A named schedule's factor after the warm-up, over ``t = step - warmup_steps`` of ``T = total - warmup_steps``.

    The closed forms of torch.optim.lr_scheduler (its documentation's formulas):

    * ``constant``: 1.
    * ``cosine``: ``(1 + cos(π t / T)) / 2`` (CosineAnnealingLR, ``eta_min`` 0, ``T_max = T``).
    * ``step``: ``gamma ** (t // step_size)`` (StepLR).
    * ``linear``: ``1 - t / T`` (LinearLR, ``start_factor`` 1, ``end_factor`` 0, ``total_iters = T``).

    During the warm-up (``t < 0``) the factor is 1.

    Args:
        name: one of `flodl_mpi.config.LR_SCHEDULES`.
        cohort_step: >= 0. total_steps: the run's cohort steps (``epochs × steps per epoch``),
            > ``warmup_steps`` for ``cosine`` and ``linear``.
        step_size, gamma: ``step``'s.

    Raises:
        ValueError: an unknown name; ``cosine`` or ``linear`` without a step after the warm-up;
            ``step`` without ``step_size``.
    """
    t = cohort_step - warmup_steps
    if name == "constant":
        return 1.0
    if name == "step":
        if step_size is None or step_size < 1:
            raise ValueError(f"the step schedule needs a step size >= 1, got {step_size!r}")
        return 1.0 if t < 0 else float(gamma) ** (t // step_size)
    if name not in ("cosine", "linear"):
        raise ValueError(f"unknown learning-rate schedule {name!r}")
    span = total_steps - warmup_steps
    if span <= 0:
        raise ValueError(f"the {name} schedule has no step after the warm-up ({warmup_steps} of {total_steps} steps)")
    if t < 0:
        return 1.0
    if name == "cosine":
        return (1.0 + math.cos(math.pi * t / span)) / 2.0
    return max(0.0, 1.0 - t / span)


def learning_rate_factor(
    cohort_step: int, world_size: int, scale_lr: bool, warmup_steps: int, schedule: Callable[[int], float] | None
) -> float:
    """The factor on each param group's initial learning rate at a cohort step.

    ``warmup_factor(...) × schedule(cohort_step)`` (1 without a schedule). ``schedule``
    is a named one (`decay_factor`, bound by the task to the run's length) or
    :func:`flodl_mpi.fit`'s ``lr_schedule`` callable. The cohort step counts the cohort's
    optimizer steps, i.e. global steps: ``epoch × steps per epoch + step index``, the
    number a single process training on the same steps would reach.

    Raises:
        ValueError: the schedule returned a non-finite or negative factor.
    """
    factor = warmup_factor(cohort_step, warmup_steps, world_size, scale_lr)
    if schedule is not None:
        s = float(schedule(cohort_step))
        if not (s >= 0.0 and s < float("inf")):
            raise ValueError(f"lr_schedule({cohort_step}) returned {s!r}; it must be a finite factor >= 0")
        factor *= s
    return factor
