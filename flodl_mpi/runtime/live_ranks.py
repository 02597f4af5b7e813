"""``R/ranks.json``: which processes are the ranks of the launch that trains in a run dir.

Invariant: rank 0 writes the file once per launch, after the run dir's lock is held
and metrics.h5 is open, under a temporary name then renamed (``os.replace``), so a
reader sees a whole file of one launch or of the one before, never a mix. Each rank
is named by its host, its pid and its process's start (clock ticks after boot, field
22 of ``/proc/<pid>/stat``, as the kernel keeps it: exact, whatever the wall clock
does): a reader on that host tells a live rank from a dead one whose pid was reused.
``flodl-mpi inject-failure`` reads it to find the ranks it kills; nothing in training
reads it.

Format (JSON): ``{"version": 1, "launch": "<host>:<pid>:<start>" (rank 0's, unique per
launch), "world_size": W, "written": <time.time()>, "ranks": [{"rank": r, "host": str,
"pid": int, "start": int or null}, ...]}`` (``start`` null where ``/proc`` cannot be read).
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FILE_NAME", "LiveRank", "Launch", "gather_ranks", "write_launch", "read_launch", "process_start"]

#: The file's name in the run dir.
FILE_NAME = "ranks.json"


def _stat_fields(pid: int | str) -> list[str] | None:
    """``/proc/<pid>/stat``'s fields from field 3 (state) on, or None (no such process, no ``/proc``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()  # comm (field 2) may hold blanks and parentheses


def process_start(pid: int | str = "self") -> int | None:
    """Process ``pid``'s start, in clock ticks after boot (``/proc/<pid>/stat`` field 22), or None."""
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[22 - 3])


@dataclass(frozen=True)
class LiveRank:
    """One rank of a launch: its rank, host name, pid and process start (clock ticks after boot, or None)."""

    rank: int
    host: str
    pid: int
    start: int | None

    def alive(self) -> bool:
        """Whether this rank's process still runs (checked on its own host only; another host's: False).

        A process with the pid but another start (the pid reused) is not it, nor one that has
        ended and waits to be reaped (state Z or X).
        """
        if self.host != socket.gethostname():
            return False
        fields = _stat_fields(self.pid)
        if fields is None or fields[0] in ("Z", "X"):
            return False
        return self.start is None or int(fields[22 - 3]) == self.start


@dataclass(frozen=True)
class Launch:
    """One launch's ranks, as ``R/ranks.json`` records them."""

    launch: str
    world_size: int
    written: float
    ranks: tuple[LiveRank, ...]

    def alive(self) -> list[LiveRank]:
        """The ranks whose processes still run (on this host)."""
        return [r for r in self.ranks if r.alive()]


def gather_ranks(comm) -> list[dict] | None:
    """Every rank's ``{"rank", "host", "pid", "start"}``, gathered to rank 0 (collective; None elsewhere)."""
    me = {"rank": comm.rank, "host": socket.gethostname(), "pid": os.getpid(), "start": process_start()}
    return comm.gather(me, root=0)


def write_launch(run_dir: str | os.PathLike, ranks: list[dict]) -> Path:
    """Write ``run_dir/ranks.json`` for this launch (rank 0; ``ranks`` from `gather_ranks`); returns its path.

    Written as ``.ranks.json.tmp-<pid>``, flushed to disk, then renamed over the old one.

    Raises:
        OSError: the file could not be written (the temporary file is removed).
    """
    path = Path(run_dir) / FILE_NAME
    first = ranks[0]
    record = {
        "version": 1,
        "launch": f"{first['host']}:{first['pid']}:{first['start']}",
        "world_size": len(ranks),
        "written": time.time(),
        "ranks": ranks,
    }
    tmp = path.with_name(f".{FILE_NAME}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    return path


def read_launch(run_dir: str | os.PathLike) -> Launch | None:
    """The launch ``run_dir/ranks.json`` names, or None when there is none yet (or it is not such a file)."""
    try:
        record = json.loads((Path(run_dir) / FILE_NAME).read_text())
        ranks = tuple(
            LiveRank(int(r["rank"]), str(r["host"]), int(r["pid"]), None if r.get("start") is None else int(r["start"]))
            for r in record["ranks"]
        )
        return Launch(str(record["launch"]), int(record["world_size"]), float(record["written"]), ranks)
    except (OSError, ValueError, KeyError, TypeError):
        return None
