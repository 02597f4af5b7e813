"""New HDF5 files written so that a failed write is an ``OSError``, never a broken HDF5 library.

Invariant: HDF5 never sees a write fail. `new_file` hands h5py a `WriteSink` (its
``fileobj`` driver): the sink writes to the file with ``os.pwrite`` and records the
first ``OSError`` (ENOSPC, EDQUOT, EFBIG, EIO ...); from then on it keeps what HDF5
writes in memory, so every later read sees what HDF5 wrote and the library's state
stays whole. The file is closed normally, then the recorded error is raised, with
its errno, in the caller's thread; the caller removes the file.

Why: when a write failed under the default driver, closing a dataset failed too
(its chunk cache could not be written) and HDF5 (2.0, through h5py 3.16) kept that
dataset's ID after its file was gone; the next walk over every dataset ID (closing
*another* file, metrics.h5 at the end of the writer thread, or the library's own
end at exit) dereferenced it: rank 0 died of SIGSEGV with no message (trial 7,
finding 1; gdb: ``H5_term_library -> H5I_clear_type -> H5D_close``).

Not covered: metrics.h5's appends (SWMR needs the default driver). A chunk there is
allocated rarely (64 KiB of rows), and the checkpoint before it fails first in practice.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import Any, Iterator

import h5py

__all__ = ["WriteSink", "new_file", "free_bytes", "check_room", "size_words"]


class WriteSink:
    """A file-like object for h5py's ``fileobj`` driver that records write errors instead of raising them.

    h5py calls ``seek``, ``tell``, ``read``, ``write``, ``truncate`` and ``flush``;
    ``write`` never raises: the first ``OSError`` is kept in ``error``, and that
    write and every later one go to an in-memory overlay that ``read`` applies (the
    overlay holds at most what HDF5 writes after the failure: callers stop adding
    objects once ``error`` is set, see `new_file`).

    Args:
        path: the file to create (truncated if it exists), mode 0o644.

    Raises:
        OSError: the file cannot be created.
    """

    #: ``os.pwrite``; a test replaces it to make the disk refuse writes.
    _pwrite = staticmethod(os.pwrite)

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        self._pos = 0
        self._size = 0  # the file's logical size: what HDF5 wrote, on disk or in the overlay
        #: The first write error, or None.
        self.error: OSError | None = None
        self._overlay: list[tuple[int, bytes]] = []  # (offset, data) in write order, after the failure

    # -- the file-like protocol h5py's fileobj driver uses

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._pos = offset if whence == os.SEEK_SET else self._pos + offset if whence == os.SEEK_CUR \
            else self._size + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, size: int = -1) -> bytes:
        if size < 0:
            size = max(0, self._size - self._pos)
        start = self._pos
        buf = bytearray(os.pread(self._fd, size, start).ljust(size, b"\0"))  # past the end: zeros, as sec2 reads
        for offset, data in self._overlay:
            lo, hi = max(start, offset), min(start + size, offset + len(data))
            if lo < hi:
                buf[lo - start:hi - start] = data[lo - offset:hi - offset]
        self._pos += size
        return bytes(buf)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n, start = len(view), self._pos
        done = 0
        if self.error is None:
            try:
                while done < n:
                    wrote = self._pwrite(self._fd, view[done:], start + done)
                    if wrote == 0:  # no progress and no errno: call it what it is
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
                    done += wrote
            except OSError as exc:
                self.error = exc if exc.filename else OSError(exc.errno, exc.strerror, str(self.path))
        if done < n:
            self._overlay.append((start + done, bytes(view[done:])))
        self._pos = start + n
        self._size = max(self._size, self._pos)
        return n

    def truncate(self, size: int | None = None) -> int:
        size = self._pos if size is None else size
        if self.error is None:
            try:
                os.ftruncate(self._fd, size)
            except OSError as exc:
                self.error = OSError(exc.errno, exc.strerror, str(self.path))
        self._size = size
        return size

    def flush(self) -> None:
        """Nothing to flush: every write went to the operating system (`fsync` makes it durable)."""

    # -- the caller's side

    def fsync(self) -> None:
        """Raise the recorded write error, else fsync the file (its data on disk before a rename).

        Raises:
            OSError: the first write error, or fsync's own (a delayed write error surfaces here).
        """
        if self.error is not None:
            raise self.error
        try:
            os.fsync(self._fd)
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, str(self.path)) from None

    def close(self) -> None:
        """Close the descriptor (idempotent); the overlay is dropped."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._overlay = []


@contextlib.contextmanager
def new_file(path: str | os.PathLike, **kwargs: Any) -> Iterator[tuple[h5py.File, WriteSink]]:
    """Create the HDF5 file ``path`` through a `WriteSink`; on leaving, close it, fsync it, raise a write error.

    Yields ``(file, sink)``; a caller that writes many objects checks
    ``sink.error`` between them and stops early (raising it) rather than hand HDF5
    more to write into memory. On leaving normally, the file is closed (HDF5's
    last writes included), then the first write error is raised, or the file is
    fsynced. On any exception the file is closed and the exception propagates. The
    file itself is left in place either way: the caller renames or removes it.

    Example::

        with new_file(tmp, libver=("v108", "v110")) as (f, sink):
            f.create_dataset("x", data=x)
        os.replace(tmp, final)

    Args:
        path: the file to create.
        kwargs: h5py.File's (``libver``, ``track_order`` ...); ``mode`` is "w".

    Raises:
        OSError: the file cannot be created, or a write or the fsync failed
            (``errno``: ENOSPC, EDQUOT, EFBIG, EIO ...; ``filename``: ``path``).
    """
    sink = WriteSink(path)
    try:
        f = h5py.File(sink, "w", **kwargs)
        try:
            yield f, sink
        finally:
            f.close()
        sink.fsync()
    finally:
        sink.close()


def free_bytes(directory: str | os.PathLike) -> int | None:
    """Bytes an unprivileged user may still write under ``directory`` (``statvfs``: ``f_bavail * f_frsize``).

    A quota is not seen. Returns None when the file system does not say (no
    blocks reported, or ``statvfs`` failed), so the caller checks nothing.
    """
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    if st.f_blocks == 0 or st.f_frsize == 0:
        return None
    return st.f_bavail * st.f_frsize


def size_words(n: int) -> str:
    """Bytes for a message: ``342.1 MB`` (decimal units, as ``df -H``), ``17 kB``, ``512 B``."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def check_room(directory: str | os.PathLike, need: int, what: str) -> None:
    """Refuse a write that clearly does not fit: ``need`` bytes against `free_bytes` of ``directory``.

    Args:
        directory: where the file goes (exists).
        need: bytes the file needs at least (its arrays alone).
        what: the file, for the message (``checkpoint ckpt-e000003-r000069.h5``).

    Raises:
        OSError: ``errno`` ENOSPC, ``filename`` ``directory``, ``detail`` ``"<what> needs
            about N MB, <directory> has M MB free"``; nothing is written. A file
            system that does not report its free space is not checked.
    """
    free = free_bytes(directory)
    if free is not None and free < need:
        exc = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))
        exc.detail = f"{what} needs about {size_words(need)}, {directory} has {size_words(free)} free"
        raise exc
