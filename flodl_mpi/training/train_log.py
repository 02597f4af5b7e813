"""Rank 0's lines: stdout from the start of setup, ``train.log`` in the run dir, and why a run failed.

Invariant: one logger (``flodl_mpi``) for the CLI, :func:`flodl_mpi.fit` and the
``Averager``; rank 0 alone prints or writes, the other ranks' copies go nowhere; a
disk or a reader that refuses the lines silences its handler, never the run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from pathlib import Path

from flodl_mpi.errors import CohortError
from flodl_mpi.outputs.metrics import disk_error
from flodl_mpi.training.progress import write_above_bars

__all__ = ["StdoutHandler", "TrainLogHandler", "close_train_log", "log", "log_to_stdout", "note_failure",
           "open_train_log", "say_once", "verbosity"]

log = logging.getLogger("flodl_mpi")


def say_once(run_dir: Path, line: str | None) -> None:
    """Rank 0, before train.log's handler exists: ``line`` as a warning (stdout) and at the end of
    ``run_dir/train.log`` (the handler added later appends after it)."""
    if line is None:
        return
    log.warning(line)
    path = (run_dir / "train.log").resolve()
    if any(isinstance(h, logging.FileHandler) and Path(h.baseFilename) == path for h in log.handlers):
        return  # logged there already
    with contextlib.suppress(OSError):
        with open(path, "a") as fh:
            fh.write(f"{time.strftime('%H:%M:%S')} {line}\n")



def note_failure(run_dir: Path, rank: int, exc: BaseException) -> None:
    """Append why the run failed to ``train.log``, so the run directory tells later.

    A cohort error is written once, by rank 0; a local error by the rank that had it.
    """
    if isinstance(exc, CohortError) and rank != 0:
        return
    who = "run" if isinstance(exc, CohortError) else f"rank {rank}"
    line = f"{time.strftime('%H:%M:%S')} {who} failed: {type(exc).__name__}: {exc}\n"
    with contextlib.suppress(OSError):  # the run dir itself may be the problem; stderr has it
        with open(run_dir / "train.log", "a") as fh:
            fh.write(line)


def verbosity(args) -> int:
    """``-v`` count minus ``-q``: -1 quiet (warnings only), 0 default, 1 details."""
    return int(getattr(args, "verbose", 0) or 0) - int(bool(getattr(args, "quiet", False)))


class TrainLogHandler(logging.FileHandler):
    """train.log's handler: a disk that refuses its lines (full, a quota, the file size limit) silences it with
    one warning on stderr, instead of logging's traceback for every line; the run goes on (stdout has the lines,
    and a checkpoint that no longer fits ends the run with its own one line)."""

    def handleError(self, record: logging.LogRecord) -> None:
        disk = disk_error(sys.exc_info()[1])
        if disk is None:
            super().handleError(record)
            return
        self.setLevel(logging.CRITICAL + 1)
        print(f"flodl-mpi: warning: {self.baseFilename}: {disk.strerror}: its lines are no longer written "
              "(stdout has them)", file=sys.stderr, flush=True)


class StdoutHandler(logging.StreamHandler):
    """Rank 0's lines on stdout. A reader that went away (``flodl-mpi train | head -1``) ends the
    printing, not the run: the handler falls silent, stdout goes to /dev/null (so the exit's flush
    raises nothing), and train.log keeps every line."""

    flodl_stdout = True

    def emit(self, record: logging.LogRecord) -> None:
        try:  # a line in mid-epoch (a quarantine, a warning) goes above rank 0's progress bar, not into it
            if write_above_bars(self.format(record), self.stream):
                return
        except Exception:  # noqa: BLE001 - logging's contract: a failed emit goes to handleError
            self.handleError(record)
            return
        super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        if not isinstance(sys.exc_info()[1], BrokenPipeError):
            super().handleError(record)
            return
        self.setLevel(logging.CRITICAL + 1)
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())
            os.close(devnull)


def log_to_stdout(rank: int, level: int) -> None:
    """Rank 0 prints the log on stdout from the start of setup (before the run dir exists).

    The other ranks print nothing of it: a NullHandler keeps logging's last resort
    (bare warnings on stderr, for a logger with no handler) from printing their
    copy of rank 0's warnings.
    """
    log.setLevel(logging.DEBUG)
    log.propagate = False
    if rank != 0 and not any(type(h) is logging.NullHandler for h in log.handlers):
        log.addHandler(logging.NullHandler())
    if rank == 0 and not any(getattr(h, "flodl_stdout", False) for h in log.handlers):
        handler = StdoutHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        log.addHandler(handler)
    for h in log.handlers:
        if getattr(h, "flodl_stdout", False) and h.level <= logging.CRITICAL:  # not one silenced by a closed pipe
            h.setLevel(logging.WARNING if level < 0 else logging.DEBUG if level > 0 else logging.INFO)


def open_train_log(run_dir: Path, rank: int) -> logging.Handler | None:
    """``train.log`` in the run dir: the default lines whatever -v/-q say.

    Returns the handler added (rank 0), for `close_train_log` when the run ends
    inside a longer process (the Python API); None on other ranks, or when one
    writes to that file already.
    """
    path = (Path(run_dir) / "train.log").resolve()
    if rank != 0 or any(isinstance(h, logging.FileHandler) and Path(h.baseFilename) == path for h in log.handlers):
        return None
    handler = TrainLogHandler(path)
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    log.addHandler(handler)
    return handler


def close_train_log(handler: logging.Handler | None) -> None:
    """Detach and close a run's ``train.log`` handler, so a later run's lines do not land in it."""
    if handler is not None:
        log.removeHandler(handler)
        handler.close()


def close_train_logs(run_dir: Path) -> None:
    """Detach and close every handler writing ``run_dir/train.log`` (the run's own, and one a rank that took over
    rank 0's role after a shrink opened), so a later run in the same process does not write into it."""
    path = (Path(run_dir) / "train.log").resolve()
    for handler in list(log.handlers):
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename) == path:
            close_train_log(handler)


