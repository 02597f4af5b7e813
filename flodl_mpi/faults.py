"""Declarative fault injection for tests: ``KIND@RANK:ROUND`` (STYLE 34).

Kinds: ``bridge`` raises inside the bridge's params reduce; ``step`` raises in
the training step; ``hang`` blocks the training thread forever (the watchdog
must end the job); ``nan`` writes NaN into the rank's parameters before the
round; ``nanloss`` makes the rank's losses in the window before the round NaN
(so its gradients, and after the step its parameters, too);
``disk`` (rank 0) puts a file where the checkpoint directory was, so the
writer thread's next save fails. ``ROUND`` counts rounds from 0. Used through ``flodl-mpi train
--inject-fault``; never active unless asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KINDS", "Fault", "parse_fault"]

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
        raise ValueError(f"--inject-fault must look like KIND@RANK:ROUND (e.g. bridge@1:3), got {text!r}") from None
    if kind not in KINDS:
        raise ValueError(f"--inject-fault kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if rank < 0 or round_ < 0:
        raise ValueError(f"--inject-fault rank and round must be >= 0, got {text!r}")
    return Fault(kind, rank, round_)
