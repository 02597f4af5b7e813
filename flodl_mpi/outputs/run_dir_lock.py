"""One run at a time in a run directory: rank 0 holds an exclusive lock on ``<run_dir>/.lock``.

The lock is an ``fcntl.flock`` on an open file, taken without blocking before
anything in the run directory is read for a resume, cleaned up or written. It is
held until the run ends (or this process exits: the operating system releases a
``flock`` when its holder's process ends, also on ``kill -9``, so a killed run
leaves no stale lock). The file itself is never removed (removing a lock file
races with a process that has just opened it).

A ``flock`` on a network file system is only as good as that file system's
support for it: NFSv4 and Lustre mounted with ``-o flock`` make it cluster-wide;
Lustre mounted with ``localflock`` makes it node-local, so two jobs on
different nodes would not see each other's lock there; where ``flock`` fails
outright (Lustre's ``noflock``: ENOSYS) a warning says so and the run goes on
without the lock.
"""

from __future__ import annotations

import errno
import fcntl
import os
import sys
import time
from pathlib import Path

__all__ = ["LOCK_NAME", "RunDirInUse", "claim", "in_use", "release"]

#: The lock file's name inside a run directory.
LOCK_NAME = ".lock"

#: Seconds :func:`claim` keeps trying a held lock before it calls the directory in use. A run
#: holds the lock for its whole length; :func:`in_use` (``flodl-mpi report``) holds it for
#: microseconds while it probes, and a run starting in that instant must not be refused for it
#: (a requeued Slurm job refused with exit 2 would not be requeued again).
CLAIM_PATIENCE_S = 2.0

#: errno values of a file system that does not do ``flock`` (Lustre's ``noflock``: ENOSYS).
_NO_FLOCK = {errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL}

#: Locks this process holds: resolved run dir -> open file descriptor.
_HELD: dict[str, int] = {}


class RunDirInUse(ValueError):
    """Another process (another run) holds the run directory's lock: bad input, exit status 2."""


def _key(run_dir: Path) -> str:
    return os.path.realpath(run_dir)


def in_use(run_dir: str | os.PathLike) -> bool:
    """Whether some process holds ``run_dir``'s lock now (False without a lock file).

    Probes with a non-blocking shared-free try: opens the lock file read-only,
    tries the exclusive lock and lets it go at once (a run claiming the directory
    in that instant waits the probe out: :data:`CLAIM_PATIENCE_S`). A lock this
    process holds counts as in use.
    """
    run_dir = Path(run_dir)
    if _key(run_dir) in _HELD:
        return True
    try:
        fd = os.open(run_dir / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
    finally:
        os.close(fd)  # closing drops the probe's lock
    return False


def claim(run_dir: str | os.PathLike, shown: str | None = None) -> None:
    """Take ``run_dir``'s exclusive lock for this process, without waiting for a run that holds it.

    A lock held only briefly (:func:`in_use`'s probe from ``flodl-mpi report``) is
    waited out: the lock is tried again every 20 ms for up to :data:`CLAIM_PATIENCE_S`.

    Args:
        run_dir: an existing directory.
        shown: how messages name it (default ``str(run_dir)``).

    Raises:
        RunDirInUse: another process holds the lock (another run uses the directory).
        OSError: the lock file cannot be created (permissions, a read-only file
            system). A file system without ``flock`` gets a warning on stderr, no lock.
    """
    run_dir = Path(run_dir)
    key = _key(run_dir)
    release(run_dir)  # a run of this process that ended in this directory: its lock is this one's now
    fd = os.open(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        _flock_patiently(fd)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise RunDirInUse(f"--run-dir {shown or str(run_dir)!r} is in use by another run (it holds "
                              f"{LOCK_NAME}); wait for it to end or choose another directory "
                              "(nothing in it was touched)") from None
        if exc.errno in _NO_FLOCK:  # e.g. Lustre mounted without flock: run as before, unguarded, and say so
            print(f"flodl-mpi: warning: {run_dir / LOCK_NAME}: this file system does not support flock "
                  f"({exc.strerror}); the run goes on without the run dir lock", file=sys.stderr, flush=True)
            return
        raise
    _HELD[key] = fd


def _flock_patiently(fd: int) -> None:
    """``flock(LOCK_EX | LOCK_NB)``, retried for :data:`CLAIM_PATIENCE_S` while another holds it."""
    give_up = time.monotonic() + CLAIM_PATIENCE_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES) or time.monotonic() >= give_up:
                raise
        time.sleep(0.02)


def release(run_dir: str | os.PathLike) -> None:
    """Let go of ``run_dir``'s lock if this process holds it (else nothing)."""
    fd = _HELD.pop(_key(Path(run_dir)), None)
    if fd is not None:
        os.close(fd)
