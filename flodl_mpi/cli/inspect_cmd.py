"""``flodl-mpi inspect PATH``: what a checkpoint or a metrics.h5 holds, and whether it is sound.

Invariant: inspecting only reads, never initialises MPI and never imports torch.
The verdict on a checkpoint is the project's own reader's
(`flodl_mpi.outputs.checkpoint.read_checkpoint`), so what inspect calls sound is what
``--resume`` and ``load_state_dict`` will load; the per-dataset walk beside it
only locates damage (which dataset fails its Fletcher-32 checksum).

Exit status: 0 sound, 1 damaged or incomplete, 2 not a file inspect knows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from flodl_mpi.outputs.checkpoint import READ_ERRORS, CheckpointError, first_line, read_checkpoint
from flodl_mpi.cli.run_events import change_words
from flodl_mpi.outputs.run_reader import RunError, metrics_attrs, open_metrics, read_membership

__all__ = ["add_parser", "dataset_status", "describe_checkpoint", "describe_metrics", "main", "run"]

EXIT_OK, EXIT_DAMAGED, EXIT_INPUT = 0, 1, 2

def dataset_status(ds: h5py.Dataset) -> str:
    """``ok`` (read back, checksum verified), ``ok (no checksum)``, or ``DAMAGED (...)``.

    Reading the whole dataset is what verifies a Fletcher-32 checksum: HDF5 checks
    it chunk by chunk on read and raises OSError on a mismatch.
    """
    try:
        ds[()]
    except READ_ERRORS as exc:
        return f"DAMAGED ({first_line(exc)})"
    return "ok" if ds.fletcher32 else "ok (no checksum)"


def _walk(f: h5py.File) -> list[tuple[str, tuple, str, str]]:
    """Every dataset of the file: (HDF5 path, shape, dtype, status), in file order."""
    rows = []

    def visit(name: str, obj) -> None:
        if isinstance(obj, h5py.Dataset):
            rows.append((name, obj.shape, str(obj.dtype), dataset_status(obj)))

    f.visititems(visit)
    return rows


def _short(value: Any, width: int = 100) -> str:
    text = json.dumps(value) if isinstance(value, (dict, list)) else str(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _optimizer_line(value: Any) -> str:
    """A run record's optimizer in full: its class, then each param group's hyperparameters
    (`flodl_mpi.api.run_record.describe_optimizer`), not cut at the line's width."""
    if not (isinstance(value, dict) and isinstance(value.get("param_groups"), list)):
        return _short(value)
    groups = "; ".join(", ".join(f"{k} {json.dumps(v)}" for k, v in g.items() if k != "params")
                       + f" ({g.get('params', '?')} tensors)" for g in value["param_groups"] if isinstance(g, dict))
    return f"{value.get('class')}: {groups}"


def describe_checkpoint(path: Path) -> tuple[str, bool]:
    """The text report on a checkpoint, and whether it is sound (loads as a whole).

    Lists: the verdict of `read_checkpoint`; meta; the state-dict tensors (name,
    shape, dtype, checksum status); the ranks whose per-rank state it holds and
    what each holds; every dataset that fails its checksum, by HDF5 path.
    """
    lines = [f"checkpoint {path}"]
    verdict, ckpt = None, None
    try:
        ckpt = read_checkpoint(path)
    except CheckpointError as exc:
        verdict = str(exc)
    except READ_ERRORS as exc:  # a truncated file HDF5 refuses, a half-written object header...
        verdict = f"checkpoint {path}: cannot be opened ({first_line(exc)})"
    try:
        f = h5py.File(path, "r")
    except READ_ERRORS as exc:
        lines.append(f"  DAMAGED: {verdict or f'cannot be opened as HDF5 ({first_line(exc)})'}")
        lines.append("  verdict: NOT usable (--resume sets it aside as *.damaged)")
        return "\n".join(lines), False
    try:
        with f:
            complete = bool(f.attrs.get("complete", False))
            version = f.attrs.get("schema_version", "absent")
            lines.append(f"  complete {complete}   schema_version {version}")
            walked = _walk(f)
            ranks_present = sorted(int(r) for r in f["ranks"]) if "ranks" in f else []
    except READ_ERRORS as exc:  # a damaged group, link table or object header met on the walk
        lines.append(f"  DAMAGED: {verdict or f'checkpoint {path}: cannot be read ({first_line(exc)})'}")
        lines.append("  verdict: NOT usable (--resume sets it aside as *.damaged)")
        return "\n".join(lines), False
    status = {name: st for name, _, _, st in walked}
    if ckpt is not None:
        lines.append("  meta:")
        record = ckpt.meta.get("run_record")
        for key in sorted(ckpt.meta):
            if key == "run_record" and isinstance(record, dict):
                continue
            if key == "config" and isinstance(record, dict):  # a Python API run: its record tells what it used
                lines.append(f"    {'config':<16} (the full resume config, with the CLI's defaults where the "
                             f"{record.get('api', 'API')} run did not use a field: see run record)")
                continue
            lines.append(f"    {key:<16} {_short(ckpt.meta[key])}")
        if isinstance(record, dict):
            lines.append(f"  run record (config.json of this {record.get('api', 'API')} run: what it used; "
                         "fields it did not use are left out):")
            for key in sorted(record):
                lines.append(f"    {key:<24} {_optimizer_line(record[key]) if key == 'optimizer' else _short(record[key])}")
        arrays = {**ckpt.params, **ckpt.buffers}
        lines.append(f"  state dict: {len(ckpt.order)} tensors "
                     f"({sum(int(a.size) for a in ckpt.params.values())} parameter values)")
        for name in ckpt.order:
            a = arrays[name]
            kind = "param " if name in ckpt.params else "buffer"
            # read_checkpoint read every tensor back, so each passed its checksum; the
            # HDF5 path may spell the name escaped, so the lookup may miss.
            where = status.get(f"{'params' if kind == 'param ' else 'buffers'}/{name}", "ok")
            lines.append(f"    {kind} {name:<32} {tuple(a.shape)!s:<16} {a.dtype!s:<8} {where}")
        lines.append(f"  ranks with saved state: {list(ckpt.ranks) or 'none'}")
        for r, (rank_arrays, attrs) in ckpt.ranks.items():
            keys = ", ".join(sorted(attrs))
            lines.append(f"    rank {r}: {len(rank_arrays)} arrays "
                         f"({sum(int(np.asarray(a).nbytes) for a in rank_arrays.values())} bytes); {keys}")
    else:
        lines.append(f"  ranks with saved state: {ranks_present or 'none'}")
        lines.append(f"  datasets ({len(walked)}):")
        for name, shape, dtype, st in walked:
            lines.append(f"    {name:<40} {shape!s:<16} {dtype:<8} {st}")
    damaged = [(name, st) for name, _, _, st in walked if st.startswith("DAMAGED")]
    for name, st in damaged:
        lines.append(f"  DAMAGED dataset /{name}: {st[len('DAMAGED '):]}")
    sound = ckpt is not None and not damaged
    if verdict:
        lines.append(f"  DAMAGED: {verdict}")
    lines.append("  verdict: sound: loads with load_state_dict and --resume" if sound
                 else "  verdict: NOT usable (--resume sets it aside as *.damaged)")
    return "\n".join(lines), sound


def describe_metrics(path: Path) -> str:
    """The text report on a metrics.h5: attributes, tables with row counts and columns.

    A table's row count is its shortest column (what `read_table` returns); a column
    longer than that is reported (an append caught half-way, while the run writes).

    Raises:
        RunError: not openable.
    """
    lines = [f"metrics {path}"]
    with open_metrics(path) as f:
        attrs = metrics_attrs(f)
        cfg = attrs.pop("config", None)
        lines.append(f"  schema_version {attrs.pop('schema_version', '1 (no attribute)')}")
        for key in sorted(attrs):
            lines.append(f"  {key:<14} {_short(attrs[key])}")
        for name, group in f.items():
            if not isinstance(group, h5py.Group):
                continue
            lengths = {}
            for col, ds in group.items():
                ds.refresh()
                lengths[col] = ds.shape
            rows = min((s[0] for s in lengths.values()), default=0)
            lines.append(f"  table {name}: {rows} rows, {len(lengths)} columns")
            for col, shape in lengths.items():
                extra = f"  ({shape[0] - rows} row(s) ahead: being written)" if shape[0] > rows else ""
                lines.append(f"    {col:<24} {group[col].dtype!s:<8} per row {shape[1:]}{extra}")
    changes = read_membership(path)
    if changes:  # the ledger in words (ids are stable ids; docs/elastic-records.rst)
        lines.append(f"  membership changes ({len(changes)}):")
        lines += [f"    {change_words(c)}" for c in changes]
    if isinstance(cfg, dict):
        lines.append("  config:")
        for key, value in cfg.items():
            lines.append(f"    {key:<18} {value!r}")
    return "\n".join(lines)


def _kind(path: Path) -> tuple[str | None, BaseException | None]:
    """``checkpoint``, ``metrics`` or None, from the file's contents (not its name), and
    the error HDF5 raised opening it (None: it opened)."""
    try:
        with h5py.File(path, "r", libver="latest", swmr=True) as f:
            if "json_attrs" in f.attrs or "epochs" in f:
                return "metrics", None
            if "params" in f or "order" in f.attrs or "complete" in f.attrs:
                return "checkpoint", None
            return None, None
    except READ_ERRORS as exc:  # damaged: the name decides (a partly written temp checkpoint is ckpt-*.h5.tmp-PID)
        return ("checkpoint" if path.name.startswith("ckpt-") else None), exc


def add_parser(sub) -> argparse.ArgumentParser:
    """Register ``inspect`` on the ``flodl-mpi`` sub-parsers."""
    p = sub.add_parser("inspect", allow_abbrev=False,
                       help="show what a checkpoint or metrics.h5 holds, and whether it is sound",
                       description="A checkpoint: meta, tensors (name, shape, dtype, checksum), completeness, "
                                   "ranks with saved state. A metrics.h5: tables, row counts, config. "
                                   "Exit status 0 sound, 1 damaged, 2 not a file inspect knows.")
    p.add_argument("path", metavar="PATH", help="a checkpoint (.h5), a metrics.h5, or a run directory")
    return p


def run(args: argparse.Namespace) -> int:
    """``flodl-mpi inspect``; returns the exit status."""
    path = Path(args.path)
    if path.is_dir():
        path = path / "metrics.h5"
    if not path.is_file():
        print(f"flodl-mpi inspect: error: {args.path}: no such file", file=sys.stderr)
        return EXIT_INPUT
    kind, cause = _kind(path)
    if kind == "metrics":
        try:
            print(describe_metrics(path))
        except RunError as exc:
            print(f"flodl-mpi inspect: error: {exc}", file=sys.stderr)
            return EXIT_DAMAGED
        except READ_ERRORS as exc:  # opened, then a damaged table met on the walk
            print(f"flodl-mpi inspect: error: {path}: damaged, cannot be read ({first_line(exc)})", file=sys.stderr)
            return EXIT_DAMAGED
        return EXIT_OK
    if kind == "checkpoint":
        text, sound = describe_checkpoint(path)
        print(text)
        return EXIT_OK if sound else EXIT_DAMAGED
    try:
        hdf5 = bool(h5py.is_hdf5(path))
    except READ_ERRORS:  # removed or unreadable since
        hdf5 = False
    if cause is not None and hdf5:
        # HDF5's signature, yet HDF5 refuses it (a checkpoint cut short under another name: its
        # root group, names and flags are written last, so what is left cannot tell its kind).
        print(f"flodl-mpi inspect: error: {path}: damaged, or not an HDF5 file written by flodl-mpi: "
              f"HDF5 cannot open it ({first_line(cause)}); neither a checkpoint nor a metrics.h5 can be "
              "recognised in what is left", file=sys.stderr)
        return EXIT_DAMAGED
    print(f"flodl-mpi inspect: error: {path}: neither a flodl-mpi checkpoint nor a metrics.h5"
          + ("" if cause is None else " (not HDF5)"), file=sys.stderr)
    return EXIT_INPUT


def main(argv: list[str] | None = None) -> int:
    """``python -m flodl_mpi.cli.inspect_cmd PATH`` (the same as ``flodl-mpi inspect PATH``)."""
    parser = argparse.ArgumentParser(prog="flodl-mpi")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(["inspect", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    from flodl_mpi.cli.main import unix_pipe

    unix_pipe()
    sys.exit(main())
