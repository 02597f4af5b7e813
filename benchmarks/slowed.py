"""A slowed rank for tests and benchmarks: models whose forward sleeps, by rank (no product flag).

Used through ``--model``, like any model::

    FLODL_SLOW_MS=4 FLODL_SLOW_FACTORS=1,4 mpiexec -n 2 flodl-mpi train --policy cadence \\
        --model benchmarks/slowed.py:slowed_mlp

Each training forward of rank ``r`` sleeps ``FLODL_SLOW_MS * factor[r]`` milliseconds
(``FLODL_SLOW_FACTORS``, comma-separated, one per rank; missing ranks take 1; default
``FLODL_SLOW_MS`` 4), standing in for a device that computes that much slower: with
the sleep well above the real compute, rank 1 at factor 4 takes about 4x as long per
batch as rank 0 at factor 1. Evaluation (``model.eval()``) does not sleep. The rank
comes from the launcher's environment (``PMI_RANK``, ``OMPI_COMM_WORLD_RANK``,
``SLURM_PROCID``), so the same factory serves flodl-mpi and ``ddp_baseline.py``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

__all__ = ["Slowed", "rank_sleep_s", "slowed_mlp", "slowed_mnist1d_cnn"]


def rank_sleep_s(rank: int | None = None) -> float:
    """Seconds a training forward of ``rank`` (default: this process's launcher rank) sleeps.

    Raises:
        ValueError: ``FLODL_SLOW_MS`` or a factor is not a number >= 0.
    """
    if rank is None:
        rank = next((int(os.environ[k]) for k in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")
                     if k in os.environ), 0)
    base = float(os.environ.get("FLODL_SLOW_MS", "4"))
    factors = [float(f) for f in os.environ.get("FLODL_SLOW_FACTORS", "").split(",") if f.strip()]
    factor = factors[rank] if rank < len(factors) else 1.0
    if not (base >= 0 and factor >= 0):
        raise ValueError(f"FLODL_SLOW_MS {base} and FLODL_SLOW_FACTORS {factors} must be numbers >= 0")
    return base * factor / 1e3


class Slowed(nn.Module):
    """Wraps ``inner``; a forward in training mode sleeps ``sleep_s`` seconds first.

    Args:
        inner: the model; its parameters and buffers live under ``inner.``.
        sleep_s: seconds per training forward, >= 0.
    """

    def __init__(self, inner: nn.Module, sleep_s: float) -> None:
        super().__init__()
        if sleep_s < 0:
            raise ValueError(f"sleep_s must be >= 0, got {sleep_s!r}")
        self.inner = inner
        self.sleep_s = float(sleep_s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.sleep_s:
            time.sleep(self.sleep_s)  # the slow device's extra time, per batch
        return self.inner(x)


def slowed_mlp(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """flodl-mpi's built-in MLP (``flodl_mpi.training.models.digits_mlp``), slowed by rank."""
    from flodl_mpi.training.models import digits_mlp

    return Slowed(digits_mlp(input_shape, num_classes), rank_sleep_s())


def slowed_mnist1d_cnn(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The MNIST-1D paper's CNN (``benchmarks/models.py``), slowed by rank."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from models import mnist1d_cnn

    return Slowed(mnist1d_cnn(input_shape, num_classes), rank_sleep_s())
