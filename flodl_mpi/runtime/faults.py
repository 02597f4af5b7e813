"""Fault injection for tests: the environment variable ``FLODL_MPI_FAULT=KIND@RANK:ROUND``.

Test machinery, not a user option: it is read here only (:func:`active_fault`),
never appears among the command's options, in ``config.json`` or in checkpoints,
and nothing fires unless the variable is set. Kinds: ``bridge`` raises inside the
bridge's params reduce; ``step`` raises in the training step; ``hang`` blocks the
training thread forever (the watchdog must end the job); ``nan`` writes NaN into
the rank's parameters before the round; ``nanloss`` makes the rank's losses
in the window before the round NaN (so its gradients, and after the step its
parameters, too); ``disk`` (rank 0) puts a file where the
checkpoint directory was, so the writer thread's next save fails. ``ROUND``
counts rounds from 0. A test sets it for one run, e.g.
``FLODL_MPI_FAULT=bridge@1:3 mpiexec -n 2 flodl-mpi train``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["ENV_VAR", "KINDS", "Fault", "InjectedFault", "active_fault", "parse_fault"]

#: The one test-only hook: ``KIND@RANK:ROUND``, unset (or empty) in real runs.
ENV_VAR = "FLODL_MPI_FAULT"

KINDS = ("bridge", "step", "hang", "nan", "nanloss", "disk")


class InjectedFault(RuntimeError):
    """The error an injected fault raises."""


@dataclass(frozen=True)
class Fault:
    """One planned fault: ``kind`` on rank ``rank`` at round ``round``."""

    kind: str
    rank: int
    round: int

    def fires(self, kind: str, rank: int, round_: int) -> bool:
        """Whether this fault fires for ``kind`` on ``rank`` at ``round_``."""
        return self.kind == kind and self.rank == rank and self.round == round_


def parse_fault(text: str) -> Fault:
    """Parse ``KIND@RANK:ROUND``, e.g. ``bridge@1:3``.

    Raises:
        ValueError: malformed text or unknown kind.
    """
    try:
        kind, where = text.split("@")
        rank, round_ = (int(v) for v in where.split(":"))
    except ValueError:
        raise ValueError(f"{ENV_VAR} must look like KIND@RANK:ROUND (e.g. bridge@1:3), got {text!r}") from None
    if kind not in KINDS:
        raise ValueError(f"{ENV_VAR} kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if rank < 0 or round_ < 0:
        raise ValueError(f"{ENV_VAR} rank and round must be >= 0, got {text!r}")
    return Fault(kind, rank, round_)


def active_fault(environ: Mapping[str, str] | None = None) -> Fault | None:
    """The fault ``FLODL_MPI_FAULT`` asks for, or None when it is unset or empty.

    Args:
        environ: the environment to read (default ``os.environ``).

    Raises:
        ValueError: the variable is set but malformed (see :func:`parse_fault`).
    """
    text = (os.environ if environ is None else environ).get(ENV_VAR, "")
    return parse_fault(text) if text else None
