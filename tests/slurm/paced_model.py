"""The built-in digits MLP, paced for tests/slurm/check.sh: ``--model paced_model.py:paced_mlp``.

Each training forward pass sleeps ``PACE_S`` seconds, so a run lasts at least
``PACE_S`` x batches per rank, however fast the machine: long enough that a
signal Slurm sends within its 30 s time-limit check lands before the last epoch.
Only the first ``FLODL_PACED_ATTEMPTS`` attempts of a job are paced (default 1;
``SLURM_RESTART_COUNT`` counts the requeues): a resumed attempt, which no signal
needs to catch, runs at full speed, so the test is shorter. Same parameters,
data and rounds as the built-in model otherwise.

With ``FLODL_STATE_DIR`` set (tests/slurm/check_two_nodes.sh), each rank writes
``$FLODL_STATE_DIR/rank<R>.npz`` (R: the launcher's rank, ``flodl_mpi.runtime.launcher.launcher_rank``) when its process exits: the model's
state dict as that rank holds it (the job script runs plain ``flodl-mpi train``,
so this is where a test can see every rank's final model), and ``host`` /
``node`` (its host name, ``SLURMD_NODENAME``). Each attempt of a requeued job
overwrites the one before.
"""

from __future__ import annotations

import atexit
import os
import socket
import time
from pathlib import Path

import numpy as np

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


def dump_at_exit(model: nn.Module, directory: str) -> None:
    """At exit, write ``model``'s state dict (name -> array) and this rank's host and node to
    ``directory/rank<R>.npz``, R the launcher's rank (through a temporary name, then a rename)."""

    def dump() -> None:
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        from flodl_mpi.runtime.launcher import launcher_rank

        rank = launcher_rank()
        state = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
        tmp = out / f".rank{rank}.tmp.npz"
        np.savez(tmp, host=np.array(socket.gethostname()), node=np.array(os.environ.get("SLURMD_NODENAME", "")),
                 **{f"state/{k}": v for k, v in state.items()})
        os.replace(tmp, out / f"rank{rank}.npz")

    atexit.register(dump)


def paced_mlp(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """``digits_mlp(input_shape, num_classes)``, paced (see the module docstring)."""
    model = Paced(digits_mlp(input_shape, num_classes), pace_s())
    if os.environ.get("FLODL_STATE_DIR"):
        dump_at_exit(model, os.environ["FLODL_STATE_DIR"])
    return model
