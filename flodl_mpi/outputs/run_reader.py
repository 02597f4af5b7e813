"""A run directory read back for looking at: metrics.h5 tables, its attributes, the log.

Invariant: reading never writes and never initialises MPI, and it works while the
run still writes (metrics.h5 is opened as an HDF5 SWMR reader through
`flodl_mpi.outputs.metrics.read_table`). Absent tables or columns (a file from an older or
newer writer) come back absent, not as an error; only a schema version newer than
this reader knows, or a file that is not a run's metrics.h5, is refused.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from flodl_mpi.outputs.metrics import SCHEMA_VERSION, read_table
from flodl_mpi.protocol.membership import MembershipChange

__all__ = ["Run", "RunError", "changes_of", "load_run", "metrics_attrs", "open_metrics", "read_membership"]

#: Per table, the integer per-rank column whose -1 padding marks a rank the row's world did not have.
_PRESENCE = {"rounds": "steps", "epochs": "per_rank_batches", "scalars": "per_rank_count"}

#: Options that name the run, not how it trained: never reported as a difference.
NOT_OPTIONS = ("run_dir", "resume", "not_applicable")


class RunError(ValueError):
    """A run directory or metrics.h5 that cannot be read; the message says why and what to do."""


@dataclass
class Run:
    """One run as read back.

    Attributes:
        path: the run directory.
        label: short name for legends and table headers (the directory name).
        attrs: metrics.h5 root attributes, JSON ones decoded (``config``, ``hosts``, ...).
        tables: table -> column -> array (rows so far; columns cut to the shortest).
            Per-rank columns have shape ``(rows, W)``.
        log_lines: ``train.log`` (rank 0's log), or empty.
        resumes: how many times the run was resumed (``config-resume-*.json`` files).
        resume_rounds: the rounds done when each resume started, ascending (the
            ``rNNNNNN`` of ``config-resume-rNNNNNN.json``; a resume at a round already
            resumed from once rewrites its file: listed once).
    """

    path: Path
    label: str
    attrs: dict[str, Any]
    tables: dict[str, dict[str, np.ndarray]]
    log_lines: list[str] = field(default_factory=list)
    resumes: int = 0
    resume_rounds: list[int] = field(default_factory=list)

    @property
    def config(self) -> dict[str, Any]:
        """The options as run (``attrs['config']``), ``{}`` when absent."""
        cfg = self.attrs.get("config")
        return cfg if isinstance(cfg, dict) else {}

    @property
    def own_loop(self) -> bool:
        """A run of :class:`flodl_mpi.Averager` (your loop, no planned epochs); older files say so by their data."""
        cfg = self.config
        return cfg.get("api") == "Averager" or cfg.get("data") == "(your training loop)"

    @property
    def loss_name(self) -> str:
        """The training loss as the run recorded it (metrics.h5 ``loss``); files from before it say ``loss``."""
        name = self.attrs.get("loss")
        return name if isinstance(name, str) and name else "loss"

    @property
    def world_size(self) -> int:
        """The ranks of the run as last started (metrics.h5 ``world_size``); 0 when absent."""
        return int(self.attrs.get("world_size", 0))

    @property
    def world_size_history(self) -> list[tuple[int, int]]:
        """``[(first round, world size), ...]``, one entry per world size the run had, in order
        (metrics.h5 ``world_size_history``; a file from before it: ``[(0, world_size)]``)."""
        raw = self.attrs.get("world_size_history")
        if isinstance(raw, str):  # not listed in json_attrs by some writer: still JSON
            try:
                raw = json.loads(raw)
            except ValueError:
                raw = None
        try:
            history = [(int(first), int(w)) for first, w in raw]
        except (TypeError, ValueError):
            history = []
        return history or [(0, self.world_size)]

    @property
    def width(self) -> int:
        """Per-rank columns' width: the largest world size the run had (``max`` over the history),
        or more after a membership change: one slot per stable id ever given."""
        cols = (c for t in self.tables.values() for c in t.values() if c.ndim == 2)
        return max([w for _, w in self.world_size_history] + [c.shape[1] for c in cols])

    def rank_name(self, column: int) -> str:
        """How a per-rank column is named on plots and in tables: ``rank 2``, or ``id 2`` (its stable
        id) once the run's membership changed (a column is then one id across the changes)."""
        return f"{'id' if self.membership else 'rank'} {column}"

    @property
    def membership(self) -> list[MembershipChange]:
        """The run's membership changes in round order (metrics.h5 ``membership``, `changes_of`);
        empty while the ranks stayed those launched, and for a file from before the table.

        Once a change happened, every per-rank column is indexed by stable id (the launch
        rank, then a join counter), so ``per_rank(table, name)[:, i]`` is one rank's series
        across the changes, NaN where that id was not a rank (docs/elastic-records.rst).
        """
        return changes_of(self.tables.get("membership", {}))

    def present(self, table: str) -> np.ndarray | None:
        """Which ranks the world that wrote each row had: bool ``(rows, width)``, or None (no rows).

        A row written by a smaller world than the widest is padded (NaN in float columns,
        -1 in integer ones, docs/file-formats.rst "Another world size"); this reads the
        padding of the table's integer per-rank column (``rounds/steps``,
        ``epochs/per_rank_batches``, ``scalars/per_rank_count``: never negative when
        written), so float columns' own NaN ("not measured") stays apart from it. A table
        without that column: every rank present.
        """
        col = self.column(table, _PRESENCE.get(table, ""))
        if col is not None and col.ndim == 2:
            return col >= 0
        rows = next((len(c) for c in self.tables.get(table, {}).values()), 0)
        return np.ones((rows, self.width), dtype=bool) if rows else None

    def per_rank(self, table: str, name: str) -> np.ndarray | None:
        """A per-rank column as float64 ``(rows, W)`` with NaN where the row's world had no such
        rank (integer columns' -1 padding too), so NaN-aware reductions use only real rows.

        Returns None when the column is absent or not per-rank.
        """
        col = self.column(table, name)
        if col is None or col.ndim != 2:
            return None
        out = col.astype(np.float64)
        present = self.present(table)
        if present is not None and present.shape == out.shape:
            out[~present] = np.nan
        return out

    def segments(self) -> list[tuple[int, int, float, float]]:
        """The run's stretches at one world size: ``[(first round, world size, start_s, end_s)]``.

        ``start_s`` of a resumed stretch is the latest ``time_s`` of the rows recorded before
        it (the run's clock continues from its checkpoint, saved just after them); the last
        stretch ends at the later of the last round's and the last epoch's ``time_s``.
        """
        times_r, times_e = self.column("rounds", "time_s"), self.column("epochs", "time_s")
        ep_rounds = self.column("epochs", "rounds")
        tr = np.zeros(0) if times_r is None else times_r.astype(np.float64)
        te = np.zeros(0) if times_e is None else times_e.astype(np.float64)
        er = np.zeros(len(te), np.int64) if ep_rounds is None else ep_rounds[:len(te)]
        end = max([0.0, *tr[-1:], *te[-1:]])
        out, history = [], self.world_size_history
        for k, (first, w) in enumerate(history):
            start = 0.0 if k == 0 else float(max([0.0, *tr[:first], *te[:len(er)][er <= first]]))
            out.append([first, w, start, end])
            if k:
                out[k - 1][3] = start
        return [tuple(seg) for seg in out]

    def column(self, table: str, name: str) -> np.ndarray | None:
        """The column, or None when the table or column is absent or has no rows."""
        col = self.tables.get(table, {}).get(name)
        return col if col is not None and len(col) else None


def changes_of(table: dict[str, np.ndarray]) -> list[MembershipChange]:
    """The rows of a ``membership`` table (column -> array, as `read_table` gives) as changes.

    ``left`` / ``joined`` (bool, per stable id) become the ids; ``steps_lost`` is read for
    the ids that left. A table without its columns (an older file) gives no change.
    """
    need = ("round", "time_s", "left", "joined", "steps_lost", "world_size", "detection_ms", "recovery_ms")
    if any(name not in table for name in need):
        return []
    out = []
    for i in range(min(len(table[name]) for name in need)):
        left = np.flatnonzero(table["left"][i])
        out.append(MembershipChange(
            round=int(table["round"][i]), time_s=float(table["time_s"][i]), left=tuple(int(v) for v in left),
            joined=tuple(int(v) for v in np.flatnonzero(table["joined"][i])),
            steps_lost=tuple(max(0, int(table["steps_lost"][i][v])) for v in left),
            world_size=int(table["world_size"][i]), detection_ms=float(table["detection_ms"][i]),
            recovery_ms=float(table["recovery_ms"][i])))
    return out


def read_membership(path: str | os.PathLike) -> list[MembershipChange]:
    """The membership changes of a metrics.h5 (`changes_of`), safe while the run writes; [] without the table.

    Raises:
        BlockingIOError: as `read_table` (the file stayed locked for 10 s).
    """
    try:
        return changes_of(read_table(path, "membership"))
    except KeyError:  # a file from before the table
        return []


def open_metrics(path: str | os.PathLike, timeout: float = 10.0) -> h5py.File:
    """Open a metrics.h5 as an SWMR reader (safe while the run writes).

    Raises:
        RunError: no such file, not HDF5, or still locked after ``timeout`` seconds
            (the writer holds the lock while it creates the file).
    """
    path = Path(path)
    if not path.is_file():
        raise RunError(f"{path}: no such file")
    if not h5py.is_hdf5(path):
        raise RunError(f"{path}: not an HDF5 file")
    deadline = time.monotonic() + timeout
    while True:
        try:
            return h5py.File(path, "r", libver="latest", swmr=True)
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise RunError(f"{path}: locked by its writer for {timeout:g} s; try again") from None
            time.sleep(0.05)
        except OSError as exc:
            raise RunError(f"{path}: cannot be opened ({exc})") from None


def metrics_attrs(f: h5py.File) -> dict[str, Any]:
    """Root attributes of an open metrics.h5, JSON ones (listed in ``json_attrs``) decoded."""
    json_keys = set(json.loads(f.attrs["json_attrs"])) if "json_attrs" in f.attrs else set()
    out = {}
    for key, value in f.attrs.items():
        if key == "json_attrs":
            continue
        if isinstance(value, np.generic):
            value = value.item()
        if isinstance(value, bytes):
            value = value.decode()
        if key in json_keys:
            value = json.loads(value)
        out[key] = value
    return out


def check_schema(path: Path, attrs: dict[str, Any], tables: list[str]) -> None:
    """Refuse, with a clear message, a file this reader cannot interpret.

    A file without ``schema_version`` is version 1 (written before the attribute existed).

    Raises:
        RunError: schema newer than `flodl_mpi.outputs.metrics.SCHEMA_VERSION`, or no ``epochs`` table.
    """
    version = attrs.get("schema_version", 1)
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise RunError(f"{path}: metrics schema_version {version!r} is newer than this flodl-mpi reads "
                       f"({SCHEMA_VERSION}); upgrade flodl-mpi (pip install -U flodl-mpi) to read it")
    if "epochs" not in tables:
        raise RunError(f"{path}: no 'epochs' table; not a flodl-mpi metrics.h5 (tables: {sorted(tables)})")


def load_run(run_dir: str | os.PathLike, label: str | None = None) -> Run:
    """Read a run directory (or its ``metrics.h5`` given directly), while it writes or after.

    Args:
        run_dir: the run directory, holding ``metrics.h5``; or the file itself.
        label: legend name; default the directory's name.

    Returns:
        `Run`.

    Raises:
        RunError: no metrics.h5, not HDF5, a schema this version cannot read.
    """
    path = Path(run_dir)
    metrics = path if path.is_file() else path / "metrics.h5"
    if path.is_file():
        path = path.parent
    if not path.exists():
        raise RunError(f"{run_dir}: no such run directory")
    if not metrics.exists():
        raise RunError(f"{run_dir}: no metrics.h5 (not a flodl-mpi run directory, or the run has not "
                       "started writing yet)")
    with open_metrics(metrics) as f:
        attrs = metrics_attrs(f)
        names = [k for k, v in f.items() if isinstance(v, h5py.Group)]
    check_schema(metrics, attrs, names)
    tables = {}
    for name in names:
        try:
            tables[name] = read_table(metrics, name)
        except BlockingIOError:
            raise RunError(f"{metrics}: locked by its writer; try again") from None
    log = path / "train.log"
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    records = list(path.glob("config-resume-*.json"))
    names = (re.fullmatch(r"config-resume-r(\d+)\.json", p.name) for p in records)
    rounds = sorted(int(m.group(1)) for m in names if m)
    return Run(path=path, label=label or path.resolve().name, attrs=attrs, tables=tables,
               log_lines=lines, resumes=len(records), resume_rounds=rounds)
