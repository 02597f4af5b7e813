"""Fault injection for the tests, declared as ``KIND@RANK:ROUND`` (STYLE 34), installed on the product's hooks.

Test machinery: the product knows nothing of it. :func:`install` registers one
fault on the named points of :mod:`flodl_mpi.runtime.hooks`; a launched run gets it
through ``tests/hooked_flodl.py --fault KIND@RANK:ROUND`` (``tests.conftest.run_flodl(...,
hooks=fault_hooks(spec))``), an in-process test through the ``inject_fault`` fixture
(``tests/conftest.py``).

Kinds: ``bridge`` raises inside the bridge's params reduce; ``step`` raises in the
training step; ``hang`` blocks the training thread forever (the watchdog must end
the job); ``nan`` writes NaN into the rank's parameters before the round;
``nanloss`` makes the rank's losses in the window before the round NaN (so its
gradients, and after the step its parameters, too); ``disk`` (rank 0) puts a file
where the checkpoint directory was, so the writer thread's next save fails (the
directory moves to ``checkpoints.moved-by-fault``); ``kill`` is a kill -9 of the rank
at the start of the round, its window trained (a death, for ``--on-rank-failure``).
``kill-reduce``, ``kill-epoch`` and ``kill-gather`` kill it on entering the bridge's
params reduce (mid-round, after the control gather), the epoch exchange's gather, or a
checkpoint's state gather. ``ROUND`` counts rounds from 0; the ``kill`` kinds' ``RANK``
is the launch rank.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from flodl_mpi.runtime import hooks

__all__ = ["KINDS", "Fault", "InjectedFault", "parse_fault", "install", "fault_hooks"]

#: The bridge's stages at which the ``kill-*`` kinds kill -9 the rank (its peers are in or near that call).
KILL_STAGES = {"kill-reduce": "params reduce", "kill-epoch": "epoch gather", "kill-gather": "state gather"}
KINDS = ("bridge", "step", "hang", "nan", "nanloss", "disk", "kill", *KILL_STAGES)


class InjectedFault(RuntimeError):
    """The error an injected fault raises."""


@dataclass(frozen=True)
class Fault:
    """One planned fault: ``kind`` on each rank of ``ranks`` at round ``round`` (several ranks: at once, e.g.
    two ranks killed in the same round)."""

    kind: str
    ranks: tuple[int, ...]
    round: int

    def fires(self, kind: str, rank: int, round_: int) -> bool:
        """Whether this fault fires for ``kind`` on ``rank`` at ``round_``."""
        return self.kind == kind and rank in self.ranks and self.round == round_


def parse_fault(text: str) -> Fault:
    """Parse ``KIND@RANK:ROUND`` or ``KIND@RANK,RANK...:ROUND``, e.g. ``bridge@1:3``, ``kill@1,2:10``.

    Raises:
        ValueError: malformed text or unknown kind.
    """
    try:
        kind, where = text.split("@")
        ranks, round_ = where.split(":")
        ranks, round_ = tuple(int(v) for v in ranks.split(",")), int(round_)
    except ValueError:
        raise ValueError(f"--fault must look like KIND@RANK:ROUND (e.g. bridge@1:3), got {text!r}") from None
    if kind not in KINDS:
        raise ValueError(f"--fault kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if min(ranks) < 0 or round_ < 0 or len(set(ranks)) != len(ranks):
        raise ValueError(f"--fault ranks (distinct) and round must be >= 0, got {text!r}")
    return Fault(kind, ranks, round_)


def fault_hooks(spec: str) -> tuple[str, ...]:
    """``tests/hooked_flodl.py``'s options for a launched run with the fault ``spec`` (``KIND@RANK:ROUND``)."""
    return ("--fault", spec)


def _fault_hook(fault: Fault, kind: str, trainer) -> None:
    """The trainer's faults (``step``, ``hang``, ``nan``, ``disk``, ``kill``) at their points; named in the hang's
    stacks. ``kill``'s rank is the launch rank (after a shrink the ranks move down; the fault fires once)."""
    rank = trainer.rank
    if kind == "kill":
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.rank
    if not fault.fires(kind, rank, trainer.bridge.version):
        return
    if kind == "step":
        raise InjectedFault(f"injected fault in the training step (rank {trainer.rank}, round {fault.round})")
    if kind == "hang":
        print(f"injected fault: rank {trainer.rank} hangs in round {fault.round}", file=sys.stderr, flush=True)
        while True:  # the peers' watchdogs must end the job
            time.sleep(1.0)
    if kind == "kill":
        _kill_here(f"at round {fault.round}")
    if kind == "nan":
        import torch

        with torch.no_grad():
            trainer.replica.params[0].fill_(math.nan)
    writer = getattr(trainer, "writer", None)
    if kind == "disk" and writer is not None:
        writer.flush_wait()  # what was queued before the fault is written, however slow the writer
        moved = writer.checkpoint_dir.with_name("checkpoints.moved-by-fault")
        writer.checkpoint_dir.rename(moved)
        writer.checkpoint_dir.write_text("not a directory (injected fault)\n")


def _kill_here(what: str) -> None:
    import os
    import signal

    from mpi4py import MPI

    print(f"injected fault: rank {MPI.COMM_WORLD.rank} is killed (SIGKILL) {what}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def install(fault: Fault) -> Callable[[], None]:
    """Register ``fault`` on the product's hooks (:mod:`flodl_mpi.runtime.hooks`); returns its remover."""
    if fault.kind in KILL_STAGES:
        from mpi4py import MPI

        def kill_at_stage(bridge, stage: str) -> None:
            if stage == KILL_STAGES[fault.kind] and fault.fires(fault.kind, MPI.COMM_WORLD.rank, bridge.version):
                _kill_here(f"in the {stage} at round {fault.round}")

        return hooks.register("bridge_stage", kill_at_stage)
    if fault.kind == "bridge":

        def bridge_stage(bridge, stage: str) -> None:
            if stage == "params reduce" and fault.fires("bridge", bridge.rank, bridge.version):
                raise InjectedFault(f"injected fault in the bridge (rank {bridge.rank}, round {bridge.version})")

        return hooks.register("bridge_stage", bridge_stage)
    if fault.kind == "nanloss":

        def loss(value, trainer):
            if fault.fires("nanloss", trainer.rank, trainer.bridge.version):
                return value * math.nan  # a non-finite loss, and so NaN gradients
            return value

        return hooks.register("loss", loss)
    point = "batch" if fault.kind in ("step", "hang") else "round_start"  # (kill: at the round's start)
    return hooks.register(point, lambda trainer: _fault_hook(fault, fault.kind, trainer))
