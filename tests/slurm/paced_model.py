"""The built-in digits MLP, paced for tests/slurm/check.sh: ``--model paced_model.py:paced_mlp``.

Each training forward pass sleeps ``PACE_S`` seconds, so a run lasts at least
``PACE_S`` x batches per rank, however fast the machine: long enough that a
signal Slurm sends within its 30 s time-limit check lands before the last epoch.
Same parameters, data and rounds as the built-in model otherwise.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from flodl_mpi.models import digits_mlp

#: Seconds each training batch waits (about 23 batches per rank and epoch at 2 ranks).
PACE_S = 0.4


class Paced(nn.Module):
    """``inner`` with a ``PACE_S`` sleep before each forward pass in training mode."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            time.sleep(PACE_S)
        return self.inner(x)


def paced_mlp(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """``digits_mlp(input_shape, num_classes)``, paced (see the module docstring)."""
    return Paced(digits_mlp(input_shape, num_classes))
