"""Rank 0's progress within an epoch: a tqdm bar on a terminal, nothing extra in a log.

Invariant: progress output never decides anything and never talks to other ranks;
it only draws what the training thread already knows (batches of the epoch done,
rank 0's running loss, the round count). Off a terminal the per-epoch log line is
the whole record (Slurm logs stay one line per epoch); tqdm is imported only when a
bar is drawn.

Under ``mpiexec`` a rank's stdout is a pipe to the launcher, never a terminal, so
"stdout is a terminal" is asked of the launcher: `stdout_is_terminal` follows the
parent processes while they are MPI launcher processes (Linux ``/proc``).
"""

from __future__ import annotations

import io
import os
import sys
import time
from typing import TextIO

__all__ = ["LAUNCHERS", "EpochProgress", "bar_columns", "launcher_terminal", "stdout_is_terminal",
           "terminal_columns", "write_above_bars"]

#: Process names of MPI launchers and their per-node proxies, whose stdout a rank's
#: output goes to (MPICH hydra, Open MPI / PRRTE).
LAUNCHERS = frozenset({"mpiexec", "mpiexec.hydra", "mpirun", "hydra_pmi_proxy", "orterun", "orted", "prterun",
                       "prted"})


def _proc(pid: int) -> tuple[str, int] | None:
    """(name, parent pid) of a process from /proc, or None."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return None
    name = stat[stat.index("(") + 1 : stat.rindex(")")]
    return name, int(stat[stat.rindex(")") + 2 :].split()[1])


def launcher_terminal(stream: TextIO | None = None) -> str | None:
    """The terminal that output written to ``stream`` (default stdout) ends up on, or None.

    ``stream``'s own tty when it is one (its ``/proc`` name, or ``""`` where that is not
    known); else the tty of the MPI launcher (`LAUNCHERS`) it is a pipe to, asked of the
    parent processes: ``mpiexec -n 4 flodl-mpi train`` typed in a terminal. None under
    ``srun``/``sbatch``, with output redirected to a file, and wherever ``/proc`` is not
    there to ask.
    """
    stream = sys.stdout if stream is None else stream
    try:
        if stream.isatty():
            try:
                return os.ttyname(stream.fileno())
            except (OSError, AttributeError, ValueError, io.UnsupportedOperation):
                return ""
    except (AttributeError, ValueError):
        return None
    pid = os.getppid()
    for _ in range(4):  # rank -> proxy -> launcher (-> wrapper)
        info = _proc(pid)
        if info is None or info[0] not in LAUNCHERS:
            return None
        try:
            target = os.readlink(f"/proc/{pid}/fd/1")
        except OSError:
            return None
        if target.startswith(("/dev/pts/", "/dev/tty")):
            return target
        pid = info[1]
    return None


def stdout_is_terminal(stream: TextIO | None = None) -> bool:
    """Whether output written to ``stream`` (default stdout) ends up on a terminal (`launcher_terminal`)."""
    return launcher_terminal(stream) is not None


def terminal_columns(path: str) -> int | None:
    """The width in columns of the terminal device ``path`` (``/dev/pts/3``), or None if it cannot be asked."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOCTTY", 0) | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        columns = os.get_terminal_size(fd).columns
    except OSError:
        return None
    finally:
        os.close(fd)
    return columns if columns > 0 else None


def bar_columns(stream: TextIO | None = None) -> int | None:
    """The width to draw rank 0's bar in: the terminal's, wherever it can be learnt, else None.

    In order: ``stream``'s own terminal; the MPI launcher's terminal (a rank's stdout is a
    pipe to it, issue 26 item 9: ``shutil.get_terminal_size`` answered 80 there, which left
    a bar of one character); ``$COLUMNS``. None: not known, and tqdm draws its bar 10
    characters wide, the line as long as it needs.
    """
    stream = sys.stdout if stream is None else stream
    try:
        return os.get_terminal_size(stream.fileno()).columns or None
    except (OSError, AttributeError, ValueError, io.UnsupportedOperation):
        pass
    path = launcher_terminal(stream)
    columns = terminal_columns(path) if path else None
    if columns is not None:
        return columns
    try:
        columns = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        return None
    return columns if columns > 0 else None


#: Bars drawn now (rank 0 has at most one): a log line printed meanwhile goes above them.
_OPEN: set = set()


def write_above_bars(text: str, stream: TextIO) -> bool:
    """Print ``text`` above the open progress bar, if one is drawn (tqdm clears, prints, redraws);
    False when none is, and nothing was written. A plain write would land inside the bar's line."""
    if not _OPEN:
        return False
    from tqdm import tqdm

    tqdm.write(text, file=stream)
    return True


class EpochProgress:
    """A progress bar over one epoch's batches (all ranks'), drawn by rank 0.

    Shows batches done of the epoch, rank 0's mean training loss so far, averaging
    rounds per second and tqdm's ETA. Disabled (every method a no-op) on other ranks,
    off a terminal, and with ``-q``.

    Args:
        enabled: draw a bar.
        stream: where to draw (default stdout).
        mininterval: seconds between redraws, at least.

    Example (rank 0, in the epoch loop)::

        progress.start("epoch 3/10", total=n_batches, done=cursor, rounds=bridge.version)
        ...                                   # after each round:
        progress.update(cursor, loss_sum / batches, bridge.version)
        progress.close()                      # before the epoch's log line
    """

    def __init__(self, enabled: bool = False, stream: TextIO | None = None, mininterval: float = 0.25):
        self.enabled = bool(enabled)
        self.stream, self.mininterval = stream, mininterval
        self._bar = None
        self._t0, self._rounds0 = 0.0, 0

    def start(self, desc: str, total: int, done: int = 0, rounds: int = 0) -> None:
        """Open the bar at ``done`` of ``total`` batches; ``rounds`` is the round count now."""
        if not self.enabled:
            return
        from tqdm import tqdm  # lazy: the training path imports tqdm only to draw

        self.close()
        stream = self.stream if self.stream is not None else sys.stdout
        self._bar = tqdm(total=total, initial=done, desc=desc, unit="batch", leave=False, file=stream,
                         ncols=bar_columns(stream), mininterval=self.mininterval)
        _OPEN.add(self)
        self._t0, self._rounds0 = time.monotonic(), rounds

    def update(self, done: int, loss: float, rounds: int) -> None:
        """Move to ``done`` batches; ``loss`` rank 0's mean loss so far, ``rounds`` the round count."""
        if self._bar is None:
            return
        dt = time.monotonic() - self._t0
        rate = (rounds - self._rounds0) / dt if dt > 0 else 0.0
        self._bar.set_postfix_str(f"loss {loss:.4f}, {rate:.1f} rounds/s", refresh=False)
        self._bar.update(done - self._bar.n)

    def close(self) -> None:
        """Remove the bar (the epoch's log line takes its place)."""
        if self._bar is not None:
            _OPEN.discard(self)
            self._bar.close()
            self._bar = None
