"""The built-in digits MLP, paced for tests/slurm/check.sh: ``--model paced_model.py:paced_mlp``.

Each training forward pass sleeps ``PACE_S`` seconds, so a run lasts at least
``PACE_S`` x batches per rank, however fast the machine: long enough that a
signal Slurm sends within its 30 s time-limit check lands before the last epoch.
Only the first ``FLODL_PACED_ATTEMPTS`` attempts of a job are paced (default 1;
``SLURM_RESTART_COUNT`` counts the requeues): a resumed attempt, which no signal
needs to catch, runs at full speed, so the test is shorter. Same parameters,
data and rounds as the built-in model otherwise.
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn

from flodl_mpi.training.models import digits_mlp

#: Seconds each training batch waits (about 23 batches per rank and epoch at 2 ranks).
PACE_S = 0.4


def pace_s() -> float:
    """``PACE_S`` in the first ``FLODL_PACED_ATTEMPTS`` attempts of the job, else 0."""
    restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    return PACE_S if restarts < int(os.environ.get("FLODL_PACED_ATTEMPTS") or 1) else 0.0


class Paced(nn.Module):
    """``inner`` with a ``pace`` s sleep before each forward pass in training mode."""

    def __init__(self, inner: nn.Module, pace: float) -> None:
        super().__init__()
        self.inner = inner
        self.pace = pace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.pace:
            time.sleep(self.pace)
        return self.inner(x)


def paced_mlp(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """``digits_mlp(input_shape, num_classes)``, paced (see the module docstring)."""
    return Paced(digits_mlp(input_shape, num_classes), pace_s())
