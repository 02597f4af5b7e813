"""Features read from the HDF5 file on demand, a rank's batches read ahead in a thread (issue 22 item 1).

Invariant: a :class:`H5Rows` returns, for any rows, exactly the float32 values the in-memory
path holds for them (the same cast of the same stored values), so a streamed run trains on the
same numbers, bit for bit, as a run that loaded the file whole; it reads only the rows asked
for (runs of consecutive rows as one read each), and what the read-ahead thread reads is
what the training thread asked it to read, in that order, at most `READ_AHEAD` batches ahead.
"""

from __future__ import annotations

import collections
import os
import queue
import threading
from collections.abc import Callable, Sequence

import h5py
import numpy as np

__all__ = ["READ_AHEAD", "H5Rows", "float32_bytes", "memory_available", "row_index"]

#: Batches the read-ahead thread holds read before the training thread takes them, at most.
READ_AHEAD = 8


def memory_available() -> int | None:
    """Bytes of memory available to new allocations (``MemAvailable`` of /proc/meminfo), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def float32_bytes(shape: Sequence[int]) -> int:
    """Bytes of an array of ``shape`` as float32 (what the in-memory path holds for features)."""
    return 4 * int(np.prod(shape, dtype=np.int64))


class _Done:
    pass


def row_index(key, n: int, owner: str, unit: str) -> np.ndarray:
    """``key`` (a 1-D integer index array, negative counting from the end) as int64 positions in ``[0, n)``.

    Raises:
        TypeError: not a 1-D integer array (``owner`` names the reader that was indexed).
        IndexError: a position outside ``[-n, n)`` (``unit``: "row", "item").
    """
    idx = np.asarray(key)
    if idx.dtype.kind not in "iu" or idx.ndim != 1:
        raise TypeError(f"{owner} takes a slice or a 1-D integer index array, got {idx.dtype} {idx.shape}")
    idx = idx.astype(np.int64, copy=False)
    if len(idx) and (idx.min() < -n or idx.max() >= n):
        raise IndexError(f"{unit} index out of range for {n} {unit}s")
    return np.where(idx < 0, idx + n, idx)


class H5Rows:
    """The rows of one HDF5 dataset of features as float32, read when indexed; array-like for the trainer.

    ``rows[i:j]`` and ``rows[idx]`` (int array, any order, repeats allowed) return C-contiguous
    float32 ``(k, *feature_shape)``; consecutive rows are read in one ``h5py`` read each, others one
    by one, nothing else. :meth:`prefetch` hands the read-ahead thread the batches the training
    thread will ask for next; an index array that is the next one handed over is served from it.

    Args:
        path: the HDF5 file (opened read-only, kept open until :meth:`close`).
        name: the dataset inside it (numeric ``(N, *features)``, checked by the caller).
        check: ``(values float32, first_row int64 array) -> values``: the caller's check of what
            was read (finite values; its error names the file row), given the file rows read.

    Attributes:
        shape: ``(N, *features)``. dtype: float32. reads: ``h5py`` reads so far. rows_read: rows
            read so far (a row read twice counts twice).
    """

    dtype = np.dtype(np.float32)

    def __init__(self, path: str, name: str, check: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> None:
        self._file = h5py.File(path, "r")
        self._ds = self._file[name]
        self.shape = tuple(int(s) for s in self._ds.shape)
        # A contiguous, unfiltered dataset is the file's bytes at one offset: a run of rows is one
        # os.pread (no HDF5 selection machinery, the GIL released), the stored bytes as h5py reads them.
        self._stored = self._ds.dtype
        offset = self._ds.id.get_offset()
        self._fd, self._offset = None, None
        if self._ds.chunks is None and offset is not None and self._ds.dtype.kind in "biuf":
            self._fd, self._offset = os.open(path, os.O_RDONLY), int(offset)
            self._row_bytes = self._ds.dtype.itemsize * int(np.prod(self.shape[1:], dtype=np.int64))
        self.ndim = len(self.shape)
        self._check = check
        self._lock = threading.Lock()  # one reader at a time (h5py serializes anyway); the counts stay exact
        self.reads = 0
        self.rows_read = 0
        self._queue: queue.Queue | None = None
        self._pending: list[np.ndarray] = []
        self._thread: threading.Thread | None = None
        self._cancel = threading.Event()
        self._work: collections.deque = collections.deque()  # batches handed over, not read yet
        self._work_lock = threading.Lock()
        self._reading = False  # a read-ahead thread is running (it clears this under _work_lock as it ends)

    def __len__(self) -> int:
        return self.shape[0]

    # ---- reading --------------------------------------------------------------------------

    def _read_into(self, out: np.ndarray, start: int, stop: int) -> None:
        """Rows ``start:stop`` as stored (the dataset's dtype) into ``out``: one read."""
        if self._fd is not None:
            size = (stop - start) * self._row_bytes
            got = os.preadv(self._fd, [memoryview(out).cast("B")], self._offset + start * self._row_bytes)
            if got != size:
                raise OSError(
                    f"short read: {got} of {size} bytes at row {start} of {self._ds.name!r} (the file "
                    "changed while training?)"
                )
        else:
            self._ds.read_direct(out, np.s_[start:stop])
        self.reads += 1
        self.rows_read += stop - start

    def _float32(self, raw: np.ndarray, rows: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):  # out of float32's range: inf, named by the check
            return self._check(np.ascontiguousarray(raw, dtype=np.float32), rows)

    def _read_rows(self, idx: np.ndarray) -> np.ndarray:
        """Rows ``idx`` (int64, any order) in that order: each run of consecutive distinct rows one read."""
        rows, inverse = np.unique(idx, return_inverse=True)
        raw = np.empty((len(rows), *self.shape[1:]), dtype=self._stored)
        if len(rows):
            breaks = np.flatnonzero(np.diff(rows) != 1) + 1
            with self._lock:
                for lo, hi in zip(np.r_[0, breaks].tolist(), np.r_[breaks, len(rows)].tolist()):
                    self._read_into(raw[lo:hi], int(rows[lo]), int(rows[hi - 1]) + 1)
        out = self._float32(raw, rows)
        return out[inverse.reshape(-1)] if len(rows) != len(idx) or (np.diff(idx) < 0).any() else out

    def __getitem__(self, key) -> np.ndarray:
        if isinstance(key, slice):
            start, stop, step = key.indices(self.shape[0])
            if step != 1:
                return self._read_rows(np.arange(start, stop, step, dtype=np.int64))
            if stop <= start:
                return np.empty((0, *self.shape[1:]), dtype=np.float32)
            raw = np.empty((stop - start, *self.shape[1:]), dtype=self._stored)
            with self._lock:
                self._read_into(raw, start, stop)
            return self._float32(raw, np.arange(start, stop, dtype=np.int64))
        idx = row_index(key, self.shape[0], "H5Rows", "row")
        if self._pending and np.array_equal(self._pending[0], idx):
            self._pending.pop(0)
            got = self._queue.get()
            if isinstance(got, BaseException):  # the read-ahead's error, raised where the batch is taken
                raise got
            return got
        self._drop_read_ahead()  # asked for something else: what was read ahead is not wanted
        return self._read_rows(idx)

    # ---- read-ahead -------------------------------------------------------------------------

    def prefetch(self, batches: Sequence[np.ndarray]) -> None:
        """Read ``batches`` (index arrays, in the order they will be asked for) in a background thread.

        At most `READ_AHEAD` of them are held read before they are taken. When the batches handed
        over earlier and not taken yet are the first of ``batches``, the thread goes on with the
        rest (a window, then the next one planned); otherwise those are dropped first (their reads
        are lost, never served late).
        """
        batches = [np.asarray(b, dtype=np.int64) for b in batches]
        k = len(self._pending)
        if self._queue is None or k > len(batches) or not all(map(np.array_equal, self._pending, batches)):
            self._drop_read_ahead()
            k = 0
            self._queue = queue.Queue(maxsize=READ_AHEAD)
            self._cancel = threading.Event()
        new = batches[k:]
        if not new:
            return
        self._pending += new
        with self._work_lock:
            self._work.extend(new)
            if not self._reading:  # the thread decides to end under this lock: no batch is left unread
                self._reading = True
                self._thread = threading.Thread(
                    target=self._read_ahead, args=(self._queue, self._cancel), name="flodl-read-ahead", daemon=True
                )
                self._thread.start()

    def _read_ahead(self, out: queue.Queue, cancel: threading.Event) -> None:
        while not cancel.is_set():
            with self._work_lock:
                if not self._work:
                    self._reading = False
                    return
                b = self._work.popleft()
            try:
                item = self._read_rows(b)
            except BaseException as exc:  # crosses to the training thread with the batch it was for
                item = exc
            while not cancel.is_set():
                try:
                    out.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                break
        with self._work_lock:
            self._reading = False

    def _drop_read_ahead(self) -> None:
        if self._thread is not None:
            self._cancel.set()
            self._thread.join()
        with self._work_lock:
            self._work.clear()
            self._reading = False
        self._thread, self._queue, self._pending = None, None, []

    def close(self) -> None:
        """Stop the read-ahead thread and close the file (idempotent)."""
        self._drop_read_ahead()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._file.id.valid:
            self._file.close()
