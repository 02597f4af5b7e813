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

import os
import shutil
import sys
import time
from typing import TextIO

__all__ = ["LAUNCHERS", "EpochProgress", "stdout_is_terminal", "write_above_bars"]

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


def stdout_is_terminal(stream: TextIO | None = None) -> bool:
    """Whether output written to ``stream`` (default stdout) ends up on a terminal.

    True when the stream itself is a tty, or when it is a pipe to an MPI launcher
    (`LAUNCHERS`) whose own stdout is a tty: ``mpiexec -n 4 flodl-mpi train`` typed
    in a terminal. False under ``srun``/``sbatch``, with output redirected to a
    file, and wherever ``/proc`` is not there to ask.
    """
    stream = sys.stdout if stream is None else stream
    try:
        if stream.isatty():
            return True
    except (AttributeError, ValueError):
        return False
    pid = os.getppid()
    for _ in range(4):  # rank -> proxy -> launcher (-> wrapper)
        info = _proc(pid)
        if info is None or info[0] not in LAUNCHERS:
            return False
        try:
            target = os.readlink(f"/proc/{pid}/fd/1")
        except OSError:
            return False
        if target.startswith(("/dev/pts/", "/dev/tty")):
            return True
        pid = info[1]
    return False


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
                         ncols=shutil.get_terminal_size().columns, mininterval=self.mininterval)
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
