"""metrics.h5: append-only tables readable while the run writes, and rank 0's writer thread.

Invariant: every dataset exists before SWMR is switched on, and after that the file
only grows (one resize + one write + one flush per column per append), so a concurrent SWMR
reader always sees a consistent prefix. The schema is data (`table_schema`); docs/file-formats.rst documents it.

Layout: ``/<table>/<column>`` datasets of shape ``(rows, *per_row_shape)``. All columns
of a table are appended together, column after column, so a reader that catches an
append half-way sees some columns one append longer: use the shortest column length
(`read_table` does). SWMR forbids attribute changes once on, so there is no row-count
attribute; root attributes (config, world size, hosts, ...) are written at creation.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import queue
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import h5py
import numpy as np

from flodl_mpi.outputs import h5sink
from flodl_mpi.outputs.h5attrs import write_attrs

from . import best_checkpoint, checkpoint

if TYPE_CHECKING:
    from flodl_mpi.outputs.checkpoint_contents import CheckpointContents

__all__ = [
    "SCHEMA_VERSION",
    "LIBVER",
    "GUARD_VERDICTS",
    "table_schema",
    "MetricsFile",
    "read_table",
    "WriterError",
    "MetricsWriter",
    "NoMetricsWriter",
    "writer_or_none",
    "DISK_ERRNOS",
    "DISK_REMEDY",
    "disk_error",
    "disk_error_line",
    "disk_writer_error",
    "keep_before_restart",
    "HOLD_ROWS",
    "HOLD_S",
]

#: Version of the metrics.h5 layout, root attribute ``schema_version``; readers
#: refuse a newer one (a file without the attribute is version 1).
SCHEMA_VERSION = 1

#: Guard verdict codes of the ``rounds/guard`` column (SPEC §3), an HDF5 enum.
GUARD_VERDICTS = {"stable": 0, "suppress_growth": 1, "nudge_down": 2}

_I8, _I32, _I64 = np.dtype(np.int8), np.dtype(np.int32), np.dtype(np.int64)
_F64, _BOOL = np.dtype(np.float64), np.dtype(np.bool_)
#: A scalar's name in the ``scalars`` table: UTF-8, at most 64 bytes.
_NAME = np.dtype("S64")
_CHUNK_BYTES = 64 * 1024  # chunk size target: small appends, few chunk lookups


def table_schema(world_size: int) -> dict[str, dict[str, tuple[np.dtype, tuple[int, ...]]]]:
    """Table -> column -> (dtype, per-row shape) of metrics.h5 for ``world_size`` ranks.

    Per-rank columns have per-row shape ``(world_size,)``, indexed by rank. Times are
    ``time_s`` seconds since the run started and ``*_ms`` milliseconds; definitions of
    the epoch fields are SPEC §5; ``batches/param_norm`` is NaN when not measured.

    Raises:
        ValueError: ``world_size`` is not an int >= 1.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    W = (world_size,)
    guard = h5py.enum_dtype(GUARD_VERDICTS, basetype="i1")
    return {
        "rounds": {
            "round": (_I64, ()), "version": (_I64, ()), "time_s": (_F64, ()),
            "skipped": (_BOOL, ()), "steps": (_I64, W), "mass": (_F64, W),
            "quarantined": (_BOOL, W),  # rank sent mass 0: its loss or tensors were not finite
            "divergence": (_F64, W), "pre_norm": (_F64, W), "post_norm": (_F64, ()),
            "pack_ms": (_F64, W), "allreduce_ms": (_F64, W), "unpack_ms": (_F64, W),
            "outer_ms": (_F64, W),  # the outer optimizer's step on the consensus (0: none, or --outer avg)
            # where the round's time went (issue 9; the end-of-run profile sums these with
            # the timings below): the control gather, its wait for the slowest rank included
            "control_ms": (_F64, W),
            "bytes": (_I64, ()),   # bytes one rank put on the wire this round
            "window": (_I64, W),   # batches each rank ran in the window
            "quota": (_I64, W),    # batches the policy's plan gave each rank for the window (before an epoch's end)
            "anchor": (_I64, ()),  # the plan's anchor: the slowest rank's quota (fixed policies: the window)
            "batch_ms": (_F64, W),  # each rank's mean ms per batch in the window (the balancer's reading)
            "round_ms": (_F64, W),  # the round's time after its control gather (the balancer's overhead)
            "bridge_ms": (_F64, W),  # the bridge thread's whole time in the round, its control gather's wait included
            "wait_ms": (_F64, W),  # ms the training thread was blocked waiting for this round's consensus
            # the training thread's copies (issue 26 item 8): its values into the staging before
            # the round, the consensus back into its live values after it (NaN: not measured)
            "snapshot_ms": (_F64, W), "adopt_ms": (_F64, W),
            # the params reduce against its link (issue 25 item 4): its payload per rank S (bytes) on
            # an exchange of link_ranks ranks (the node leaders in a hierarchical round across nodes),
            # its wall time on each rank, and busbw = S / link_ms · 2(W − 1)/W in GB/s (nccl-tests' definition;
            # NaN: nothing moved; -1: no value)
            "link_bytes": (_I64, ()), "link_ranks": (_I64, ()), "link_ms": (_F64, W), "busbw_gbs": (_F64, W),
            "guard": (guard, ()),
        },
        "epochs": {
            "epoch": (_I64, ()), "time_s": (_F64, ()), "rounds": (_I64, ()),
            "avg_loss": (_F64, ()), "epoch_ms": (_F64, ()), "batches": (_I64, ()),
            "per_rank_loss": (_F64, W), "per_rank_batches": (_I64, W),
            "per_rank_samples": (_I64, W),
            "per_rank_throughput": (_F64, W),  # samples / s of compute + data wait
            "per_rank_batch_share": (_F64, W), "per_rank_epoch_ms": (_F64, W),
            "per_rank_compute_ms": (_F64, W), "per_rank_data_ms": (_F64, W),
            "per_rank_share_complete_ms": (_F64, W),  # compute + data wait (SPEC §5)
            "test_loss": (_F64, ()), "test_accuracy": (_F64, ()),  # NaN: the test set not evaluated
            "nonfinite_batches": (_I64, ()),  # batches whose loss was NaN/Inf: not in the losses
            "val_loss": (_F64, ()), "val_accuracy": (_F64, ()),  # the validation set's (NaN: none)
        },
        "batches": {
            "rank": (_I32, ()), "epoch": (_I64, ()), "step": (_I64, ()),
            "batch_ms": (_F64, ()), "data_ms": (_F64, ()), "loss": (_F64, ()),
            "lr": (_F64, ()), "param_norm": (_F64, ()),
        },
        # One row per epoch and name: the user's record_scalar values (batch-weighted
        # mean of the ranks' means, SPEC §5) and the Python API's named evaluation
        # metrics ("eval/<name>": sum over count). Long format, so names need not be
        # known when the file is created (SWMR adds no datasets later).
        "scalars": {
            "epoch": (_I64, ()), "name": (_NAME, ()), "value": (_F64, ()), "count": (_I64, ()),
            "per_rank_mean": (_F64, W), "per_rank_count": (_I64, W),
        },
        # One row per membership change (SPEC §9, the ledger; docs/elastic-records.rst). Its
        # per-rank columns, as every table's once a rank left or joined, are indexed by stable id
        # (`flodl_mpi.protocol.membership`): the launch rank, then a join counter.
        "membership": {
            "round": (_I64, ()),  # the abandoned round: the new world's first round has this number
            "time_s": (_F64, ()),
            "left": (_BOOL, W), "joined": (_BOOL, W),  # by stable id
            "steps_lost": (_I64, W),  # steps since the last adopted consensus of each id that left, never averaged
            "rank": (_I32, W),  # each id's rank after the change (-1: not a member)
            "world_size": (_I64, ()), "detection_ms": (_F64, ()), "recovery_ms": (_F64, ()),
        },
    }


def _check_rows(schema: Mapping, table: str, rows: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Validate one append against the schema; return the columns as stored-dtype arrays.

    Raises:
        ValueError: unknown table, missing or unknown column, wrong shape, k = 0 rows,
            columns with different row counts, an unknown guard code.
        TypeError: a value that cannot be cast to the column dtype without loss of kind
            (e.g. float into an int column).
    """
    if table not in schema:
        raise ValueError(f"unknown table {table!r}; expected one of {sorted(schema)}")
    columns = schema[table]
    if set(rows) != set(columns):
        raise ValueError(
            f"table {table!r}: missing columns {sorted(set(columns) - set(rows))}, "
            f"unknown columns {sorted(set(rows) - set(columns))}"
        )
    out, k = {}, None
    for name, (dtype, shape) in columns.items():
        arr = np.asarray(rows[name])
        if arr.ndim != 1 + len(shape) or arr.shape[1:] != shape or arr.shape[0] < 1:
            raise ValueError(
                f"table {table!r} column {name!r}: expected shape (k>=1, *{shape}), got {arr.shape}"
            )
        if k is not None and arr.shape[0] != k:
            raise ValueError(f"table {table!r} column {name!r}: {arr.shape[0]} rows, other columns {k}")
        k = arr.shape[0]
        if not np.can_cast(arr.dtype, dtype, casting="same_kind"):
            raise TypeError(f"table {table!r} column {name!r}: cannot store {arr.dtype} as {dtype}")
        values = h5py.check_enum_dtype(dtype)
        if values is not None and not np.isin(arr, list(values.values())).all():
            raise ValueError(f"table {table!r} column {name!r}: codes must be in {values}, got {arr}")
        out[name] = np.array(arr, dtype=dtype)  # a copy: the caller may reuse its arrays
    return out


#: HDF5 format bounds of metrics.h5: SWMR needs v110 as the low bound (superblock
#: version 3); v110 as the high bound keeps the file readable by HDF5 1.10 tools
#: (Debian's h5dump), which reject the object versions a newer library's "latest" writes.
LIBVER = ("v110", "v110")

def _step(step: str) -> None:
    """Test hook, called with a step name at each step of a rewrite of metrics.h5 (a
    test replaces it to kill the process there, proving every step crash-safe)."""


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _root_attrs(f: h5py.File) -> dict[str, Any]:
    """The root attributes of an open metrics.h5 as `MetricsFile` takes them: JSON ones decoded,
    numpy scalars as Python's, without those it writes itself (``json_attrs``, ``schema_version``,
    ``world_size_history``: the history is read from the file again)."""
    raw = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in f.attrs.items()}
    for key in json.loads(raw.pop("json_attrs", "[]")):
        if key in raw:
            raw[key] = json.loads(raw[key])
    for key in ("schema_version", "world_size_history"):
        raw.pop(key, None)
    return raw


def _pad(arr: np.ndarray, width: int) -> np.ndarray:
    """Per-rank rows ``(k, w)`` widened to ``(k, width)``: NaN for floats, -1 for integers."""
    if arr.shape[1] == width:
        return arr
    fill = np.nan if arr.dtype.kind == "f" else (False if arr.dtype.kind == "b" else -1)
    out = np.full((arr.shape[0], width, *arr.shape[2:]), fill, dtype=arr.dtype)
    out[:, : arr.shape[1]] = arr
    return out


class MetricsFile:
    """metrics.h5 opened for writing in SWMR mode; one writer, any number of readers.

    Args:
        path: the file to create; it must not exist.
        world_size: ranks in the run, >= 1 (per-rank column width).
        attrs: root attributes written before SWMR (config, hosts, devices, versions,
            ...); str/int/float/bool/ndarray as they are, dict/list/None as JSON
            strings (their keys listed in the ``json_attrs`` attribute, a JSON list).
            ``world_size`` and ``world_size_history`` are added.
        keep_rows: resume: table -> rows to keep (the rows a checkpoint had
            seen). Those rows of an existing file at ``path`` (even one a killed
            run left open for writing) are copied into a fresh file with
            ``attrs``; later rows are dropped (the resumed run redoes them).
            ``membership`` rows, unless counted here, are kept for the rounds
            kept (``round`` below ``keep_rows["rounds"]``).
        width: the per-rank columns' width the appends use (default ``world_size``):
            after a membership change, rows are indexed by stable id, up to
            `flodl_mpi.protocol.membership.Membership.width` wide; see `take_over`.

    The file is always built complete under a temporary name
    (``metrics.h5.resume-tmp``), closed, fsynced, reopened for appending in SWMR
    mode, then renamed over ``path`` (so a reader that opens ``path`` at once never
    locks the writer out), so a kill at any point leaves either the old file or
    the new one, whole. A resume first repairs what a killed resume of an older
    flodl-mpi left (``metrics.h5.before-resume`` beside a partial file: the
    former is the history) and drops stale temporaries; `recovered` says what it did.

    A resume at another world size widens the per-rank columns to the widest
    world size of the run; a row of a narrower world is padded with NaN (floats)
    and -1 (integers). ``world_size_history`` lists ``[first round, world size]``.

    Raises:
        FileExistsError: ``path`` exists and ``keep_rows`` is None (a second run in
            the same run directory).
        ValueError, TypeError: bad ``world_size`` or attribute values; on resume, a
            file with fewer rows than ``keep_rows``.
    """

    def __init__(self, path: str | os.PathLike, world_size: int, attrs: Mapping[str, Any],
                 keep_rows: Mapping[str, int] | None = None, width: int | None = None):
        self.path = Path(path)
        self.live_schema = table_schema(world_size if width is None else width)
        if "world_size" in attrs and attrs["world_size"] != world_size:
            raise ValueError(
                f"attrs['world_size']={attrs['world_size']!r} differs from world_size={world_size}"
            )
        #: Lines saying what a resume repaired (for the run's log).
        self.recovered: list[str] = []
        #: Rows each table kept (`take_over`'s); empty for a new file or a resume.
        self.rows: dict[str, int] = {}
        self._file: h5py.File | None = None
        history: list[list[int]] = [[0, world_size]]
        salvaged: dict[str, dict[str, np.ndarray]] = {}
        width = world_size
        if keep_rows is None:
            if self.path.exists():
                raise FileExistsError(f"{self.path} exists (a run in this directory already); resume it or use another")
        else:
            self._recover()
            if any(keep_rows.values()) and self.path.exists():
                # Read the rows the checkpoint saw with a SWMR reader (it also reads a
                # file a killed run left open for writing).
                salvaged, history, old_width = self._salvage(keep_rows)
                start = int(keep_rows.get("rounds", 0))
                history = [h for i, h in enumerate(history) if i == 0 or h[0] < start]
                if history[-1][1] != world_size:
                    history.append([start, world_size])
                width = max(old_width, *(w for _, w in history))
            _step("salvaged")
        width = max(width, self.live_schema["rounds"]["steps"][1][0])  # the appends' width fits too
        self.schema = table_schema(width)
        tmp = self.path.with_name(self.path.name + ".resume-tmp")
        tmp.unlink(missing_ok=True)
        try:
            self._build(tmp, {**attrs, "world_size": world_size, "world_size_history": history}, salvaged)
            _step("temp written")
            # Open to append before the file takes its name: once it is metrics.h5 a
            # reader (``flodl-mpi inspect`` or ``report`` while the run starts) may open
            # it, and a reader's lock would refuse this open (h5py: "unable to lock
            # file"). In SWMR mode the writer no longer needs the lock.
            self._open_writer(tmp)
            _step("writer open")
            os.replace(tmp, self.path)  # the old file is replaced only by a complete new one
        except BaseException:
            if self._file is not None:
                self._file.close()
            tmp.unlink(missing_ok=True)
            raise
        with contextlib.suppress(OSError):
            _fsync(self.path.parent)
        _step("replaced")

    @classmethod
    def take_over(cls, path: str | os.PathLike, width: int | None = None) -> MetricsFile:
        """Reopen a metrics.h5 another writer left (rank 0 died; SPEC §9): every row it had flushed, once.

        The lowest surviving rank calls it in one process. Each table keeps the rows
        every column of it holds (`read_table`: an append the dead writer left half done
        is dropped whole, so nothing is duplicated when the caller appends from there);
        the root attributes are kept as they are. The file is rebuilt as a resume's is
        (temp name, fsync, rename: a kill at any step leaves the old file or the new one,
        whole; a leftover temporary is removed by the next take-over or resume).
        `rows` says how many rows each table kept, so the caller appends what came
        after them (e.g. the rounds it holds that the dead writer had not flushed).

        Args:
            path: the metrics.h5 (it may still be flagged open by the dead writer).
            width: the per-rank width the new writer appends (default: the file's);
                the file is widened to it (a newcomer's id) and never narrowed.

        Raises:
            FileNotFoundError: no file at ``path``.
            OSError: it cannot be read as HDF5.
        """
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"{path}: no metrics.h5 to take over")
        with h5py.File(path, "r", swmr=True) as f:
            raw = _root_attrs(f)
            file_width = int(f["rounds/steps"].shape[1])
            tables = list(f)
        rows = {t: min((len(a) for a in read_table(path, t).values()), default=0) for t in tables}
        # Every table named, with 0 for one this file predates: its rows are the file's, not a round's count.
        keep = {t: rows.get(t, 0) for t in table_schema(1)}
        out = cls(path, int(raw["world_size"]), raw, keep_rows=keep, width=max(file_width, width or 0))
        out.rows = keep
        return out

    def _open_writer(self, path: Path) -> None:
        """Open the complete file at ``path`` to append, in SWMR mode (every object exists, as SWMR requires)."""
        self._file = h5py.File(path, "r+", libver=LIBVER)
        try:
            self._datasets = {table: {name: self._file[table][name] for name in columns}
                              for table, columns in self.schema.items()}
            # Each column's row count and per-row shape, read once here and kept by `append`
            # (this writer is the file's only one): h5py's ``ds.shape`` asks HDF5 every time.
            self._extent = {table: {name: (ds.shape[0], ds.shape[1:]) for name, ds in columns.items()}
                            for table, columns in self._datasets.items()}
            self._file.swmr_mode = True  # from here on: no new objects, no attribute changes
        except BaseException:
            self._file.close()
            raise

    def _build(self, path: Path, attrs: Mapping[str, Any], salvaged: Mapping[str, Mapping[str, np.ndarray]]) -> None:
        """Write a complete metrics.h5 at ``path``: attributes, every table, the salvaged rows; fsynced.

        Through a sink (`flodl_mpi.outputs.h5sink`): a full disk ends as an OSError naming
        ``path``, not as a broken HDF5 library.
        """
        with h5sink.new_file(path, libver=LIBVER) as (f, sink):
            json_keys = write_attrs(f.attrs, attrs, "attrs")
            f.attrs["json_attrs"] = json.dumps(json_keys)
            f.attrs["schema_version"] = SCHEMA_VERSION
            for table, columns in self.schema.items():
                group = f.create_group(table)
                for name, (dtype, shape) in columns.items():
                    ds = group.create_dataset(
                        name, shape=(0, *shape), maxshape=(None, *shape), dtype=dtype,
                        chunks=(max(1, _CHUNK_BYTES // (dtype.itemsize * int(np.prod(shape)))), *shape),
                    )
                    rows = salvaged.get(table, {}).get(name)
                    if rows is not None and len(rows):
                        ds.resize(len(rows), axis=0)
                        ds[:] = _pad(rows, shape[0]) if shape else rows
                    if sink.error is not None:  # the disk refused a write: stop adding to the file
                        raise sink.error
                _step("temp partial")

    def _recover(self) -> None:
        """Finish or undo what a killed resume left, before reading the history."""
        before = self.path.with_name(self.path.name + ".before-resume")
        if before.exists():
            # An older flodl-mpi renamed the history here, then was killed before its
            # new file was complete: the renamed file is the whole history.
            os.replace(before, self.path)
            self.recovered.append(f"{before.name}: a resume of an older flodl-mpi did not finish rebuilding "
                                  f"{self.path.name} (killed or failed); its history restored from {before.name}")
        tmp = self.path.with_name(self.path.name + ".resume-tmp")
        if tmp.exists():
            tmp.unlink()
            self.recovered.append(f"{tmp.name}: a resume did not finish rebuilding {self.path.name} (killed or "
                                  f"failed); its unfinished copy removed, {self.path.name} was untouched")

    def _salvage(self, keep_rows: Mapping[str, int]) -> tuple[dict[str, dict[str, np.ndarray]], list[list[int]], int]:
        """The kept rows, the world size history and the per-rank width of the file at ``path``."""
        with h5py.File(self.path, "r", swmr=True) as f:
            old_w = int(f.attrs["world_size"])
            history = json.loads(f.attrs["world_size_history"]) if "world_size_history" in f.attrs \
                else [[0, old_w]]
            width = int(f["rounds/steps"].shape[1])
            present = set(f)
        out = {}
        for table, columns in self.live_schema.items():
            rows = read_table(self.path, table) if table in present else {}  # a table this file predates: no rows
            keep, have = int(keep_rows.get(table, 0)), min((len(a) for a in rows.values()), default=0)
            if table == "membership" and table not in keep_rows and "round" in rows:
                # The changes of the rounds kept (rows in round order): a later one is the future dropped.
                keep = int(np.count_nonzero(rows["round"][:have] < int(keep_rows.get("rounds", 0))))
            if have < keep:
                raise ValueError(f"{self.path}: table {table!r} has {have} rows, the checkpoint saw {keep}")
            out[table] = {name: a[:keep] for name, a in rows.items() if name in columns}  # later rows are redone
            for name, (dtype, shape) in columns.items():  # a column this file predates: unknown values
                if name not in out[table]:
                    out[table][name] = _pad(np.zeros((keep, 0, *shape[1:]), dtype), shape[0]) if shape \
                        else np.full(keep, np.nan if dtype.kind == "f" else -1, dtype)
        return out, history, width

    def append(self, table: str, rows: Mapping[str, np.ndarray]) -> None:
        """Append k >= 1 rows to ``table``: every column, leading dimension k.

        Each column is resized, written and flushed in turn, so SWMR readers see it:
        one extent change, one write of the k rows and one flush per column (HDF5's
        low-level calls, not h5py's slicing, whose selection machinery cost more
        than the write itself: 5.4 ms of CPU per epoch of a world of one, issue 26
        item 10). A kill between two columns leaves the earlier columns one append
        longer, as a reader that catches an append half-way sees them (`read_table`
        reads the shortest).

        Raises:
            ValueError, TypeError: as described in the schema check (names the table,
                the column, the expected and the received shape).
        """
        checked = _check_rows(self.live_schema, table, rows)
        extents = self._extent[table]
        for name, ds in self._datasets[table].items():
            n, row_shape = extents[name]
            data = np.ascontiguousarray(_pad(checked[name], row_shape[0]) if row_shape else checked[name])
            k = data.shape[0]
            dsid = ds.id
            dsid.set_extent((n + k, *row_shape))
            file_space = dsid.get_space()
            file_space.select_hyperslab((n, *(0 for _ in row_shape)), data.shape)
            dsid.write(h5py.h5s.create_simple(data.shape), file_space, data)
            dsid.flush()
            extents[name] = (n + k, row_shape)

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._file.id.valid:
            self._file.close()

    def __enter__(self) -> "MetricsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def keep_before_restart(path: str | os.PathLike) -> tuple[Path, dict[str, int] | None] | None:
    """Rename a metrics.h5 that holds rows to ``metrics.h5.before-restart-<UTC time>``, before a run starts again.

    A resume with no checkpoint to go on from (none written yet, or every one
    damaged) rebuilds metrics.h5 with no rows; the history it held is kept under
    the new name (one ``os.replace``: the file is whole under one name or the other).

    Returns:
        ``(new path, rows per table)`` when renamed (rows None: the file did not read,
        kept all the same); None when there is no file or it holds no row.
    """
    path = Path(path)
    if not path.exists():
        return None
    rows: dict[str, int] | None
    try:
        with h5py.File(path, "r", swmr=True) as f:
            rows = {t: min((len(f[t][c]) for c in f[t]), default=0) for t in ("rounds", "epochs") if t in f}
    except Exception:  # noqa: BLE001 - a damaged file is history too: keep it
        rows = None
    if rows is not None and not any(rows.values()):
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    new = path.with_name(f"{path.name}.before-restart-{stamp}")
    k = 1
    while new.exists():
        new, k = path.with_name(f"{path.name}.before-restart-{stamp}-{k}"), k + 1
    os.replace(path, new)
    return new, rows


def read_table(path: str | os.PathLike, table: str) -> dict[str, np.ndarray]:
    """Read one table, safe while the run still writes (SWMR reader).

    Returns:
        column -> array, all truncated to the shortest column (the rows every column has).

    Raises:
        KeyError: no such table in the file.
        BlockingIOError: the file stayed locked for 10 s. The writer holds it
            locked while it creates the file, before SWMR is on; a reader that
            comes then is retried, not failed.
    """
    deadline = time.monotonic() + 10.0
    while True:
        try:
            f = h5py.File(path, "r", swmr=True)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with f:
        group = f[table]
        data = {name: ds[()] for name, ds in group.items()}
    n = min((len(a) for a in data.values()), default=0)
    return {name: a[:n] for name, a in data.items()}


class WriterError(RuntimeError):
    """The writer thread failed; the original exception is chained as ``__cause__``.

    ``plain`` is True when the message says it all (a full disk): no traceback is shown.
    """

    plain = False


#: errno values of a file system that refuses more bytes: a full disk, a quota, a file size
#: limit (``ulimit -f``). Each is a fact about the run dir, not a bug: one line, no traceback.
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)

#: What to do about each, for the one line.
DISK_REMEDY = {
    errno.ENOSPC: "free space there",
    errno.EDQUOT: "free space under your quota there (or have it raised)",
    errno.EFBIG: "raise the job's file size limit (ulimit -f)",
}


def disk_error(exc: BaseException | None) -> OSError | None:
    """The OSError (or h5py's text of one) in ``exc`` or what it chains whose errno is in `DISK_ERRNOS`.

    h5py reports a failed write of its own driver as a RuntimeError or OSError whose
    text holds ``errno = 28, error message = 'No space left on device'``; such a
    text is turned into an ``OSError(errno, strerror)``.

    Returns:
        The OSError with ``errno`` (and ``filename`` when known), or None.
    """
    while exc is not None:
        code = getattr(exc, "errno", None)
        if code in DISK_ERRNOS:
            return exc if isinstance(exc, OSError) else OSError(code, os.strerror(code))
        text = str(exc)
        for code in DISK_ERRNOS:
            if f"errno = {code}," in text or os.strerror(code) in text:
                return OSError(code, os.strerror(code))
        exc = exc.__cause__ or exc.__context__
    return None


def disk_error_line(run_dir: Path, error: OSError) -> str:
    """The one line for a run dir that refused bytes: ``run dir R: <strerror>: <what>; <remedy>, then ...``.

    ``<strerror>`` is the operating system's words for the errno (``No space left on
    device``, ``Disk quota exceeded``, ``File too large``); ``<what>`` is the
    error's ``detail`` attribute (set by `flodl_mpi.outputs.h5sink.check_room`) or the file
    that could not be written.
    """
    code = error.errno
    detail = getattr(error, "detail", None)
    if detail is None:
        name = error.filename
        if name:
            with contextlib.suppress(ValueError):  # under the run dir: named from there
                name = str(Path(os.fsdecode(name)).relative_to(run_dir))
        detail = f"could not write {name}" if name else "could not write metrics.h5 or a checkpoint"
        if name and (".tmp-" in str(name) or str(name).endswith(".resume-tmp")):  # removed by its writer
            detail += " (removed)"
    return (f"run dir {run_dir}: {os.strerror(code)}: {detail}; {DISK_REMEDY[code]}, then go on with --resume "
            "(the newest complete checkpoint is kept)")


def disk_writer_error(run_dir: Path, exc: BaseException) -> "WriterError | None":
    """A plain `WriterError` (one line, no traceback) when ``exc`` is a refused write (`disk_error`), else None."""
    disk = disk_error(exc)
    if disk is None:
        return None
    err = WriterError(disk_error_line(Path(run_dir), disk))
    err.plain = True
    err.__cause__ = exc
    return err


_CLOSE = object()

#: Rows `MetricsWriter.append_held` holds before queueing them as one append, at most. A round
#: every few milliseconds (a small model, a world of one) made a validated append per round and,
#: on the writer thread, an HDF5 resize, write and flush of every column per round: measured
#: 0.45 ms of CPU per round on the 2-core machine, more than the round itself (issue 26 item 10).
HOLD_ROWS = 256
#: Seconds the oldest held row waits at most, checked as rows arrive: while rounds keep coming, a
#: reader of a running run's metrics.h5 sees them this late at most.
HOLD_S = 0.5


class NoMetricsWriter:
    """The metrics duty of a rank that writes no files: every rank but 0, and every rank of a run without a
    run dir. It has `MetricsWriter`'s caller side and does nothing (nothing is queued, nothing can fail),
    so the callers never ask which rank they are on; `writes` says whether this rank is the writer, for
    the few duties beside the files that go with it (rank 0's lines in train.log). Nothing here enters a
    collective.
    """

    #: Whether this rank writes the run's files (rank 0 of a run with a run dir: `MetricsWriter`).
    writes = False
    #: What the writer found and mended when it reopened metrics.h5 (lines for train.log): nothing.
    recovered: tuple[str, ...] = ()
    #: Seconds the latest checkpoint took to write.
    last_save_s = 0.0

    def start(self) -> None:
        """Nothing to start."""

    def check(self) -> None:
        """Nothing can have failed."""

    def append_held(self, table: str, row: Mapping[str, Any]) -> None:
        """Drop ``row`` (this rank writes no metrics)."""

    def append(self, table: str, rows: Mapping[str, np.ndarray]) -> None:
        """Drop ``rows`` (this rank writes no metrics)."""

    def flush_wait(self, timeout: float | None = None) -> bool:
        """Nothing is queued: True at once."""
        return True

    def close(self, timeout: float | None = None) -> None:
        """Nothing to close."""


def writer_or_none(writer: "MetricsWriter | NoMetricsWriter | None") -> "MetricsWriter | NoMetricsWriter":
    """``writer``, or a `NoMetricsWriter` for None (the callers of the bridge and the Trainer that pass no writer)."""
    return NoMetricsWriter() if writer is None else writer


class MetricsWriter:
    """Rank 0's writer thread: appends metrics and writes checkpoints off the training path.

    Every output file of the run is written by this one thread. The h5py wheel is
    serial and h5py holds one global lock around every HDF5 call, so HDF5 work on the
    training thread or the bridge thread would stall them behind disk I/O (an fsync
    of a checkpoint can take seconds). Callers only enqueue; the queue is unbounded.

    Failure semantics: the first exception in the thread stops it. Work queued after
    it is dropped (rows appended so far stay in metrics.h5; the last good checkpoint
    stays in place), pending `flush_wait` calls return, and every later call of
    `append`, `save_checkpoint`, `flush_wait`, `check` or `close` raises `WriterError`
    chained to the original exception, in the caller's thread.

    Example (rank 0)::

        writer = MetricsWriter(run_dir, world_size, attrs, run_dir / "checkpoints")
        writer.start()
        for epoch in ...:
            ...
            writer.append("epochs", rows)       # each round / epoch / batch
            writer.check()                      # surface a disk error promptly
            writer.save_checkpoint(checkpoint_name(epoch, r), params, buffers, meta, order)
        writer.close()

    Args:
        run_dir: directory for ``metrics.h5`` (created if missing).
        world_size: ranks in the run, >= 1.
        attrs: root attributes of metrics.h5 (see `MetricsFile`).
        checkpoint_dir: where checkpoints go; None disables `save_checkpoint`.
        keep_checkpoints: complete checkpoints kept after each save, >= 1.
        keep_rows: resume: continue the existing metrics.h5, cut to these rows
            per table (see `MetricsFile`).
        width: per-rank width of the appends (default ``world_size``; see `MetricsFile`).

    :meth:`take_over` builds the writer of the lowest surviving rank when rank 0 died.
    """

    #: This rank writes the run's files (`NoMetricsWriter` on every other rank).
    writes = True

    def __init__(
        self,
        run_dir: Path,
        world_size: int,
        attrs: Mapping[str, Any],
        checkpoint_dir: Path | None = None,
        keep_checkpoints: int = 3,
        keep_rows: Mapping[str, int] | None = None,
        width: int | None = None,
    ):
        self.schema = table_schema(world_size if width is None else width)
        self._width, self._take_over = width, False
        if isinstance(keep_checkpoints, bool) or not isinstance(keep_checkpoints, int) or keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be an int >= 1, got {keep_checkpoints!r}")
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.h5"
        self.checkpoint_dir = None if checkpoint_dir is None else Path(checkpoint_dir)
        self._world_size, self._attrs, self._keep = world_size, dict(attrs), keep_checkpoints
        self._keep_rows = None if keep_rows is None else dict(keep_rows)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders "refuse new work" against enqueues
        self._error: BaseException | None = None
        self._closed = False
        self._ready = threading.Event()
        self._inflight: list[tuple] = []  # the batch the thread is working through
        # append_held's rows, oldest first, of one table, not queued yet (under _lock)
        self._held: list[Mapping[str, Any]] = []
        self._held_table, self._held_since = "", 0.0
        #: What a resume repaired in metrics.h5 (`MetricsFile.recovered`), once started.
        self.recovered: list[str] = []
        #: After :meth:`take_over` has started: the rows each table kept (`MetricsFile.take_over`).
        self.rows: dict[str, int] = {}
        #: Seconds the latest checkpoint took to write (0 before the first).
        self.last_save_s = 0.0
        self._thread = threading.Thread(target=self._run, name="flodl-writer", daemon=True)

    @classmethod
    def take_over(cls, run_dir: Path, width: int | None = None, checkpoint_dir: Path | None = None,
                  keep_checkpoints: int = 3) -> MetricsWriter:
        """The writer of the rank that takes over rank 0's duties (SPEC §9): on :meth:`start`, it
        reopens ``run_dir/metrics.h5`` with every row the dead writer had flushed
        (`MetricsFile.take_over`; `rows` then says how many) and appends from there.

        Args:
            run_dir: the run directory holding metrics.h5.
            width: the per-rank width of the appends (the membership's); at least the file's.
            checkpoint_dir, keep_checkpoints: as the constructor's.

        Raises:
            FileNotFoundError: no metrics.h5 there. OSError: it cannot be read.
        """
        path = Path(run_dir) / "metrics.h5"
        if not path.exists():
            raise FileNotFoundError(f"{path}: no metrics.h5 to take over")
        with h5py.File(path, "r", swmr=True) as f:
            attrs, file_width = _root_attrs(f), int(f["rounds/steps"].shape[1])
        writer = cls(run_dir, int(attrs["world_size"]), attrs, checkpoint_dir, keep_checkpoints,
                     width=max(file_width, width or 0))
        writer._take_over = True
        return writer

    # -------------------------------------------------------------- caller side

    def start(self) -> None:
        """Start the thread and wait until it has created metrics.h5.

        Raises:
            WriterError: the file could not be created (e.g. it already exists).
        """
        self._thread.start()
        self._ready.wait()
        self.check()

    def check(self) -> None:
        """Raise `WriterError` (chained to the thread's exception) if the thread failed."""
        if self._error is not None:
            disk = disk_writer_error(self.run_dir, self._error)
            if disk is not None:  # a fact about the run dir, not a bug: one line, no traceback
                raise disk from self._error
            raise WriterError(f"writer thread failed: {type(self._error).__name__}: {self._error}") from self._error

    def _put(self, item: tuple | None) -> None:
        """Queue ``item`` after the held rows (None: only the held rows)."""
        with self._lock:
            self.check()
            if self._closed or not self._thread.is_alive():
                raise RuntimeError("MetricsWriter is not running (call start(); not after close())")
            self._queue_held()
            if item is not None:
                self._queue.put(item)

    def _queue_held(self) -> None:
        """Queue the held rows as one append (under ``_lock``); they are dropped if they do not fit the schema."""
        if not self._held:
            return
        rows, self._held = self._held, []
        columns = {name: np.asarray([r[name] for r in rows]) for name in rows[0]}
        self._queue.put(("append", self._held_table, _check_rows(self.schema, self._held_table, columns)))

    def append_held(self, table: str, row: Mapping[str, Any]) -> None:
        """Hold one row of ``table`` and append it with the rows held after it, in one block.

        ``row`` maps every column to this row's value: a scalar, or an array of the
        column's row shape (no leading k). The values belong to the writer from this
        call on: do not modify them. The held rows are validated and queued as one
        :meth:`append` when `HOLD_ROWS` are held, when the oldest has waited
        `HOLD_S` seconds (checked as rows arrive), and before anything else is
        queued (another table's rows, a checkpoint, :meth:`flush_wait`, :meth:`close`):
        the file is written in the order of the calls, and a checkpoint finds every
        row held before it in metrics.h5. For a row a round, on the bridge's thread.

        Raises:
            ValueError, TypeError: held rows that do not fit the schema (raised by the
                call that queues them, which drops them).
            WriterError: the thread failed earlier.
        """
        with self._lock:
            self.check()
            if self._closed or not self._thread.is_alive():
                raise RuntimeError("MetricsWriter is not running (call start(); not after close())")
            if self._held_table != table:
                self._queue_held()
            now = time.monotonic()
            if not self._held:
                self._held_table, self._held_since = table, now
            self._held.append(row)
            if len(self._held) >= HOLD_ROWS or now - self._held_since >= HOLD_S:
                self._queue_held()

    def append(self, table: str, rows: Mapping[str, np.ndarray]) -> None:
        """Enqueue k >= 1 rows for ``table``; validated and copied now, written later.

        Raises:
            ValueError, TypeError: rows that do not fit the schema (in the caller's
                thread, before anything is queued).
            WriterError: the thread failed earlier.
        """
        self._put(("append", table, _check_rows(self.schema, table, rows)))

    def save_checkpoint(
        self,
        name: str,
        params: Mapping[str, np.ndarray],
        buffers: Mapping[str, np.ndarray],
        meta: Mapping[str, Any],
        order: Sequence[str],
        ranks: Sequence[tuple[Mapping[str, np.ndarray], Mapping[str, Any]]] = (),
        cohort: tuple[Mapping[str, np.ndarray], Mapping[str, Any]] | None = None,
    ) -> None:
        """Enqueue a checkpoint ``checkpoint_dir/name``, then pruning to ``keep_checkpoints``.

        A Python API run's (root attribute ``config`` a run record with ``api``)
        gets that record as meta ``run_record`` (what ``flodl-mpi inspect`` shows).

        The arrays are owned by the writer from this call on: do not modify them
        (hand over copies, e.g. the snapshot the bridge just took).

        Raises:
            ValueError: no ``checkpoint_dir``, or ``name`` is not a plain file name.
            WriterError: the thread failed earlier.
        """
        if self.checkpoint_dir is None:
            raise ValueError("save_checkpoint needs checkpoint_dir; MetricsWriter got checkpoint_dir=None")
        if not name or Path(name).name != name:
            raise ValueError(f"name must be a plain file name, got {name!r}")
        record = self._attrs.get("config")
        if isinstance(record, Mapping) and "api" in record and "run_record" not in meta:
            # A Python API run: the record of what it used (config.json's) beside the full
            # resume config, whose fields the API did not use hold the CLI's defaults.
            meta = {**meta, "run_record": dict(record)}
        self._put(("checkpoint", name, params, buffers, meta, list(order), list(ranks), cohort))

    def save(self, contents: CheckpointContents) -> None:
        """Enqueue a run's checkpoint: ``contents`` (`flodl_mpi.outputs.checkpoint_contents`) under its
        name, as `save_checkpoint` (the run record added, then pruning). Raises as `save_checkpoint`."""
        self.save_checkpoint(contents.name, **contents.format_args())

    def flush_wait(self, timeout: float | None = None) -> bool:
        """Block until everything queued before this call is written.

        Returns:
            True when written, False when ``timeout`` (seconds) passed first.

        Raises:
            WriterError: the thread failed (before or while draining).
        """
        done = threading.Event()
        self._put(("flush", done))
        ok = done.wait(timeout)
        self.check()
        return ok

    def close(self, timeout: float | None = None) -> None:
        """Drain the queue, close metrics.h5, join the thread; idempotent.

        Args:
            timeout: seconds to wait at most; None waits until everything queued
                is written (the caller's watchdog bounds it), so a long last
                checkpoint is never dropped.

        Raises:
            WriterError: the thread failed, or did not finish within ``timeout`` seconds.
        """
        with self._lock:
            try:
                if not self._closed and self._thread.is_alive():
                    try:
                        self._queue_held()
                    finally:
                        self._queue.put((_CLOSE,))
            finally:
                self._closed = True
        if self._thread.ident is not None:  # started
            self._thread.join(timeout)
        if self._thread.is_alive():
            raise WriterError(f"metrics writer did not finish within {timeout} s (disk stalled?)")
        self.check()

    # -------------------------------------------------------------- writer thread

    def _run(self) -> None:
        metrics = None
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if self._take_over:
                metrics = MetricsFile.take_over(self.path, self._width)
                self.rows = metrics.rows
            else:
                metrics = MetricsFile(self.path, self._world_size, self._attrs, self._keep_rows, self._width)
            self.recovered = metrics.recovered
            self._ready.set()
            while self._serve(metrics):
                pass
        except BaseException as exc:  # crosses to the caller as data (check/close)
            self._fail(exc)
        finally:
            self._ready.set()
            if metrics is not None:
                try:
                    metrics.close()
                except BaseException as exc:
                    self._fail(exc)

    def _serve(self, metrics: MetricsFile) -> bool:
        """Process everything queued now; False after the close item."""
        batch = self._inflight = [self._queue.get()]
        try:
            while True:
                batch.append(self._queue.get_nowait())
        except queue.Empty:
            pass
        i = 0
        while i < len(batch):
            item = batch[i]
            kind = item[0]
            if kind is _CLOSE:
                return False
            if kind == "append":
                # Coalesce a run of appends to one table into one resize/write/flush.
                j = i + 1
                while j < len(batch) and batch[j][0] == "append" and batch[j][1] == item[1]:
                    j += 1
                rows = [b[2] for b in batch[i:j]]
                metrics.append(item[1], {c: np.concatenate([r[c] for r in rows]) for c in rows[0]})
                i = j
                continue
            if kind == "checkpoint":
                _, name, params, buffers, meta, order, ranks, cohort = item
                t0 = time.monotonic()
                self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
                # Clearly too little room (less than the arrays alone): say so, rather than write half a file.
                h5sink.check_room(self.checkpoint_dir, checkpoint.stored_bytes(params, buffers, ranks, cohort),
                                  f"checkpoint {name}")
                checkpoint.write_checkpoint(self.checkpoint_dir / name, params, buffers, meta, order, ranks,
                                            cohort=cohort)
                if meta.get("keep_best") and meta.get("is_best"):  # --keep-best: before the pruning may take it
                    best_checkpoint.keep_best(self.checkpoint_dir / name)
                checkpoint.prune_checkpoints(self.checkpoint_dir, self._keep)
                self.last_save_s = time.monotonic() - t0
            elif kind == "flush":
                item[1].set()
            i += 1
        return True

    def _fail(self, exc: BaseException) -> None:
        """Record the first error, refuse new work, release every pending flush_wait."""
        with self._lock:
            if self._error is None:
                self._error = exc
            self._closed = True
        # The error is recorded before any waiter wakes, so flush_wait sees it.
        pending = list(self._inflight)
        try:
            while True:
                pending.append(self._queue.get_nowait())
        except queue.Empty:
            pass
        for item in pending:
            if item[0] == "flush":
                item[1].set()
