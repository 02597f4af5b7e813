"""Errors that end a run, and how the job ends for each.

A :class:`CohortError` is raised on *every* rank at the same point, decided from
gathered values, so the ranks can leave together: rank 0 prints one line and
every rank exits with ``exit_code``. Any other exception is local to one rank
and ends the job through the world abort (:mod:`flodl_mpi.runtime.world`).
"""

from __future__ import annotations

__all__ = ["CohortError", "InputError", "NonFiniteError", "RankFailure", "RoundError", "Stopped", "EXIT_ERROR", "EXIT_INPUT",
           "EXIT_STALL", "EXIT_STOPPED"]

#: Exit status of a run that failed while training.
EXIT_ERROR = 1
#: Exit status of bad input: a flag, a file, a model (argparse uses 2 too).
EXIT_INPUT = 2
#: Exit status when the watchdog found a round stalled.
EXIT_STALL = 3
#: Exit status of a run stopped on request (SIGUSR1, SIGTERM, Ctrl-C) before its
#: last epoch, after its checkpoint was saved: not done, resumable with --resume.
#: Job scripts requeue on exactly this status.
EXIT_STOPPED = 4


class CohortError(Exception):
    """An error every rank raises identically (decided from gathered values)."""

    exit_code = EXIT_ERROR


class InputError(CohortError):
    """Bad input, agreed by every rank: one clear line, exit status 2."""

    exit_code = EXIT_INPUT


class NonFiniteError(CohortError):
    """The consensus holds NaN or infinity; names the ranks whose parameters did."""


class RoundError(RuntimeError):
    """A round failed on this rank (allocation, copy, gather, reduce, divergence).

    Local to the rank: the job ends through the world abort (SPEC §2 escape hatch).
    """


class RankFailure(RoundError):
    """A collective of the bridge failed because a peer died (ULFM's ``MPI_ERR_PROC_FAILED`` / ``MPI_ERR_REVOKED``).

    Raised on this rank only, under ``--on-rank-failure shrink``; the survivors then
    agree on the failed set (`flodl_mpi.runtime.elastic.shrink`) before anything else.

    Attributes:
        stage: the bridge's call that failed: ``"round"``, ``"epoch"`` (the epoch
            exchange), ``"gather"`` (a checkpoint's state gather), ...
        round: the round the bridge was in (rounds completed so far).
        started: ``time.monotonic()`` when this rank entered the failed call.
    """

    def __init__(self, message: str, stage: str, round: int, started: float) -> None:
        super().__init__(message)
        self.stage, self.round, self.started = stage, round, started


class Stopped(SystemExit):
    """The run stopped on request (SIGUSR1, SIGTERM, Ctrl-C): raised on every rank after the same round.

    The Python API's form of exit status 4: the checkpoint is saved (with a
    ``run_dir``) and the files are closed before it is raised, so uncaught it
    ends the script with status 4 (``EXIT_STOPPED``) and no traceback, as
    ``flodl-mpi train`` does; job scripts requeue on it. A ``SystemExit``, so an
    ``except Exception`` in the user's loop does not swallow it; catch
    ``flodl_mpi.Stopped`` to do something first (then exit with ``exc.code``).

    Attributes:
        code: 4.
        signal_name: the first stop signal's name (``"SIGTERM"``...).
        round: the round after which the cohort stopped.
    """

    def __init__(self, signal_name: str | None = None, round: int = 0) -> None:
        super().__init__(EXIT_STOPPED)
        self.signal_name, self.round = signal_name, round
