"""Checkpoint files: one HDF5 file per save, written atomically, readable without pickle.

Invariant: a file under its final name is complete. It is written as
``<name>.tmp-<pid>`` in the same directory, flushed, fsynced and then renamed with
``os.replace`` (SPEC §6), so a kill mid-write never replaces the last good checkpoint.

File format (``SCHEMA_VERSION = 2``)::

    /params/<escaped name>       one dataset per parameter; floating -> float32
    /buffers/<escaped name>      one dataset per buffer; floating -> float32,
                                 integer and bool kept as they are (rank 0's
                                 integer buffers; each rank's own are in /ranks)
    root attributes:
      <meta key>       str, int, float, bool or numeric ndarray stored natively;
                       dict, list, tuple and None stored as a JSON string
      json_keys        JSON list of the meta keys stored as JSON (decoded on read)
      schema_version   int
      order            JSON list: the state-dict key order
      complete         True, written last
    /ranks/<r>/<name>            optional, per rank r: arrays kept in their own dtype
                                 (optimizer state, RNG state); the group's attributes
                                 hold that rank's JSON-able state, as the root's do;
                                 a name component is escaped like a state-dict name
                                 (a delta wire's error feedback: wire/error/<plane>)
    /cohort/prev, /cohort/velocity   optional: state every rank holds alike, once
                                 (the outer optimizer's previous global parameters
                                 and momentum, float32, flat); attributes: its kind,
                                 lr, momentum, steps and size (`read_cohort_state`);
                                 /cohort/wire_reference_<plane> and the attribute
                                 wire: a delta wire's reference (docs/file-formats.rst)

Names: PyTorch allows any character in a state-dict name (``nn.ModuleDict({"conv1/7x7":
...})`` gives ``conv1/7x7.weight``), HDF5 does not: ``/`` separates groups, a name
``.`` is the group itself, and a NUL ends the name. So a dataset's name is the
state-dict name percent-escaped (`escape_name`: ``%`` -> ``%25``, ``/`` -> ``%2F``,
NUL -> ``%00``, a leading ``.`` -> ``%2E``), reversibly; ``order`` keeps the names
as they are, and reading gives back exactly those. Schema 1 files (no escaping)
are still read.

Format bounds: the low bound v108 gives dense attribute storage (a long ``order``
or config fits); the high bound v110 keeps every object readable by HDF5 1.10
tools (Debian's ``h5dump``), whatever newer library writes the file.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import urllib.parse
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import h5py
import numpy as np

from flodl_mpi.outputs import h5sink
from flodl_mpi.outputs.h5attrs import read_attrs, write_attrs

if TYPE_CHECKING:  # torch is imported lazily: reading a checkpoint needs only h5py
    import torch

__all__ = [
    "SCHEMA_VERSION",
    "LIBVER",
    "CheckpointError",
    "CheckpointMissing",
    "READ_ERRORS",
    "first_line",
    "Checkpoint",
    "escape_name",
    "unescape_name",
    "verify_checkpoint",
    "newest_verified",
    "set_aside_damaged",
    "write_checkpoint",
    "stored_bytes",
    "read_checkpoint",
    "read_newest",
    "load_state_dict",
    "state_dict_of",
    "read_rank_state",
    "read_cohort_state",
    "checkpoint_name",
    "list_checkpoints",
    "latest_checkpoint",
    "prune_checkpoints",
]

SCHEMA_VERSION = 2

# Root attribute names the format itself uses; meta keys may not shadow them.
_RESERVED = ("json_keys", "schema_version", "order", "complete")
TMP_RE = re.compile(r"\.tmp-(\d+)$")
#: HDF5 format bounds of a checkpoint: v108 as the low bound enables dense attribute
#: storage, so a long ``order`` or config (> 64 KiB) still fits in an attribute; v110
#: as the high bound keeps the file readable by HDF5 1.10 (the newest library would
#: otherwise write object versions 1.10's tools reject).
LIBVER = ("v108", "v110")
#: What h5py raises reading a damaged file: it maps HDF5's error classes onto
#: OSError (most I/O and format errors), KeyError (an object or link not found),
#: ValueError, TypeError, and RuntimeError for the rest (a half-written object
#: header: "Can't deserialize object header prefix"; HDF5's "not implemented" errors
#: too, which h5py raises as a subclass of RuntimeError). Every reader here turns them
#: into `CheckpointError`.
READ_ERRORS = (OSError, RuntimeError, KeyError, ValueError, TypeError)
#: How many times `read_newest` and `latest_checkpoint` list a directory when none
#: of the checkpoints a listing named could be read and the directory changed
#: meanwhile (a writer that saved and pruned while the reader looked); each new
#: listing holds files newer than the last.
RELISTS = 10


def escape_name(name: str) -> str:
    """A state-dict name as an HDF5 link name: reversible, no ``/``, never ``.``.

    ``%`` -> ``%25``, ``/`` -> ``%2F``, NUL -> ``%00``, and a leading ``.`` ->
    ``%2E``; everything else is kept, so usual names (``0.weight``) read as they are.

    >>> escape_name("conv1/7x7.weight")
    'conv1%2F7x7.weight'

    Raises:
        ValueError: ``name`` is empty (HDF5 has no empty link name; PyTorch never
            makes one).
    """
    if not name:
        raise ValueError("a state-dict name is empty; HDF5 cannot store it")
    out = name.replace("%", "%25").replace("/", "%2F").replace("\0", "%00")
    return "%2E" + out[1:] if out.startswith(".") else out


def unescape_name(link: str) -> str:
    """Inverse of `escape_name`."""
    return urllib.parse.unquote(link)


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used; the message names the file and why."""

    def __init__(self, path: str | os.PathLike, problem: str):
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"checkpoint {self.path}: {problem}")


class CheckpointMissing(CheckpointError):
    """The file is not there: it never was, or it was removed (a run's pruning of old
    checkpoints) between a listing that named it and the open. `read_newest` passes
    over such a file to the next newest; a reader of one named file gets it as a
    `CheckpointError` ("no such file")."""


@dataclass
class Checkpoint:
    """One checkpoint as read back: arrays by state-dict name, meta decoded."""

    params: dict[str, np.ndarray]
    buffers: dict[str, np.ndarray]
    meta: dict[str, Any]
    order: list[str]
    path: Path
    #: rank -> ``(arrays, attrs)`` as written by ``write_checkpoint(ranks=...)``
    #: (only the ranks asked for by ``read_checkpoint(ranks=...)``).
    ranks: dict[int, tuple[dict[str, np.ndarray], dict[str, Any]]] = field(default_factory=dict)
    #: The file's ``schema_version`` (1 or `SCHEMA_VERSION`).
    schema_version: int = SCHEMA_VERSION


# ---------------------------------------------------------------- attributes


# ---------------------------------------------------------------- write


def _disk_array(name: str, value: np.ndarray) -> np.ndarray:
    """The array as stored: floating -> float32 (SPEC §6), integer and bool unchanged."""
    arr = np.asarray(value)
    if arr.dtype.kind == "f":
        return arr.astype(np.float32, copy=False)
    if arr.dtype.kind in "biu":
        return arr
    raise TypeError(f"tensor {name!r} has dtype {arr.dtype}; expected floating, integer or bool")


def _create(group: h5py.Group, name: str, data: np.ndarray) -> None:
    """A dataset with a Fletcher-32 checksum (non-scalar ones: the filter needs chunks),
    so a flipped bit on disk fails the read instead of loading wrong weights."""
    if data.ndim and data.size:
        group.create_dataset(name, data=data, fletcher32=True, chunks=True)
    else:
        group.create_dataset(name, data=data)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def stored_bytes(
    params: Mapping[str, np.ndarray],
    buffers: Mapping[str, np.ndarray],
    ranks: Sequence[tuple[Mapping[str, np.ndarray], Mapping[str, Any]]] = (),
    cohort: tuple[Mapping[str, np.ndarray], Mapping[str, Any]] | None = None,
) -> int:
    """Bytes the arrays of a checkpoint take in the file, as `write_checkpoint` stores them.

    Floating params and buffers count 4 bytes an element (stored float32), the rest
    their own itemsize. A lower bound of the file's size: HDF5 adds its headers,
    chunk indexes and checksums (about 1 % for a model of large tensors), and the
    attributes (the config, the per-rank JSON).
    """
    def nbytes(arrays: Mapping[str, np.ndarray], float32: bool) -> int:
        total = 0
        for value in arrays.values():
            arr = np.asarray(value)
            total += arr.size * (4 if float32 and arr.dtype.kind == "f" else arr.dtype.itemsize)
        return total

    total = nbytes(params, True) + nbytes(buffers, True)
    total += sum(nbytes(arrays, False) for arrays, _ in ranks)
    if cohort is not None:
        total += nbytes(cohort[0], False)
    return total


def write_checkpoint(
    path: str | os.PathLike,
    params: Mapping[str, np.ndarray],
    buffers: Mapping[str, np.ndarray],
    meta: Mapping[str, Any],
    order: Sequence[str],
    ranks: Sequence[tuple[Mapping[str, np.ndarray], Mapping[str, Any]]] = (),
    cohort: tuple[Mapping[str, np.ndarray], Mapping[str, Any]] | None = None,
) -> Path:
    """Write one checkpoint atomically (temporary name, complete flag, fsync, rename).

    Args:
        path: final file name, e.g. ``run/checkpoints/ckpt-e000005-r000123.h5``.
        params: state-dict name -> array, any shape; floating arrays are stored float32.
        buffers: state-dict name -> array; floating -> float32, integer/bool as they are.
        meta: root attributes (epoch, round, reason, config, ...); see the module
            docstring for the types accepted and how dict/list values are stored.
        order: the state-dict key order; exactly the names of ``params`` and ``buffers``.
        ranks: per rank, ``(arrays, attrs)``: arrays by name (``/`` makes
            subgroups, so escape a component that holds one with `escape_name`;
            dtypes kept exactly) and JSON-able attributes, e.g. each
            rank's optimizer and RNG state (SPEC §6).

    Returns:
        ``Path(path)``.

    Raises:
        ValueError: an empty name, a name in both params and buffers,
            ``order`` does not match their names, or a meta key is reserved.
        TypeError: an array dtype or meta value of an unsupported kind.
        OSError: a write or the fsync failed (``errno`` as the OS said: ENOSPC,
            EDQUOT, EFBIG, EIO ...); the previous file at ``path`` is untouched and
            the temporary file is removed. HDF5 never sees the failure (`flodl_mpi.outputs.h5sink`).
    """
    path = Path(path)
    order = list(order)
    for name in (*params, *buffers):
        escape_name(name)  # refuses an empty name before anything is written
    both = set(params) & set(buffers)
    if both:
        raise ValueError(f"names in both params and buffers: {sorted(both)}")
    names = set(params) | set(buffers)
    if len(order) != len(set(order)) or set(order) != names:
        raise ValueError(
            f"order must list every name of params and buffers once; "
            f"missing from order: {sorted(names - set(order))}, "
            f"unknown in order: {sorted(set(order) - names)}, "
            f"duplicates: {len(order) - len(set(order))}"
        )
    clash = [k for k in meta if k in _RESERVED]
    if clash:
        raise ValueError(f"meta keys {clash} are reserved by the checkpoint format")

    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        # Through a sink (flodl_mpi.outputs.h5sink): a failed write (a full disk, a quota, a file
        # size limit) ends as an OSError here, never as a broken HDF5 library state.
        # track_order: datasets and attributes list in creation order (state-dict order,
        # `complete` last) in h5dump/h5ls as well as here.
        with h5sink.new_file(tmp, libver=LIBVER, track_order=True) as (f, sink):
            def create(group: h5py.Group, name: str, data: np.ndarray, subgroups: dict | None = None) -> None:
                if sink.error is not None:  # the disk refused a write: stop adding to the file
                    raise sink.error
                parent, _, leaf = name.rpartition("/")
                if parent and subgroups is not None:
                    # Each subgroup (optimizer/state/<i>, ...) opened once, on its first array, in the
                    # order h5py would create it (the file is the same): not looked up again per tensor.
                    if parent not in subgroups:
                        subgroups[parent] = group.require_group(parent)
                    group, name = subgroups[parent], leaf
                _create(group, name, data)

            for group, arrays in (("params", params), ("buffers", buffers)):
                g = f.create_group(group)
                for name, value in arrays.items():
                    create(g, escape_name(name), _disk_array(name, value))
            for r, (arrays, attrs) in enumerate(ranks):
                g, subgroups = f.create_group(f"ranks/{r}"), {}
                for name, value in arrays.items():
                    create(g, name, np.asarray(value), subgroups)
                g.attrs["json_keys"] = json.dumps(write_attrs(g.attrs, attrs, f"ranks[{r}]"))
            if cohort is not None:  # state every rank holds alike (the outer optimizer's): once
                g, subgroups = f.create_group("cohort"), {}
                for name, value in cohort[0].items():
                    create(g, name, np.asarray(value), subgroups)
                g.attrs["json_keys"] = json.dumps(write_attrs(g.attrs, cohort[1], "cohort"))
            json_keys = write_attrs(f.attrs, meta, "meta")
            f.attrs["json_keys"] = json.dumps(json_keys)
            f.attrs["schema_version"] = SCHEMA_VERSION
            f.attrs["order"] = json.dumps(order)
            f.attrs["complete"] = True  # last: a file without it was interrupted
        # new_file closed the file, raised a write error or fsynced it: data on disk
        # before the rename makes it visible.
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    # The rename itself lives in the directory entry; fsync it so it survives a crash.
    try:
        _fsync(path.parent)
    except OSError:  # some filesystems (and Windows) cannot fsync a directory
        pass
    return path


# ---------------------------------------------------------------- read


def first_line(exc: BaseException) -> str:
    """An exception as one line: its type when it is not an OSError, then its first line."""
    text = (str(exc).splitlines() or [""])[0]
    return text if isinstance(exc, OSError) else f"{type(exc).__name__}: {text}"


@contextlib.contextmanager
def _reading(path: Path, problem: str = "unreadable data"):
    """h5py's errors inside the block (`READ_ERRORS`) come out as `CheckpointError`
    ``problem (cause)``, naming ``path``."""
    try:
        yield
    except CheckpointError:
        raise
    except READ_ERRORS as exc:  # e.g. a Fletcher-32 checksum mismatch, a damaged object header, a missing group
        raise CheckpointError(path, f"{problem} ({first_line(exc)})") from None


def _is_hdf5(path: Path) -> bool:
    try:
        return bool(h5py.is_hdf5(path))
    except READ_ERRORS:  # removed meanwhile, or not readable
        return False


def _open(path: Path) -> h5py.File:
    """Open a checkpoint for reading; CheckpointError unless it exists, is HDF5, is complete.

    Once open, the file stays readable if it is removed meanwhile (POSIX keeps an
    unlinked file's data until its last descriptor closes).

    Raises:
        CheckpointMissing: the file is not there (also: removed while being opened).
        CheckpointError: not HDF5, HDF5 refuses it (a truncated file), incomplete,
            a schema newer than this flodl_mpi, or an unreadable header.
    """
    if not path.is_file():
        raise CheckpointMissing(path, "no such file")
    try:
        f = h5py.File(path, "r")
    except READ_ERRORS as exc:
        if not path.exists():  # removed between the check and the open (a prune)
            raise CheckpointMissing(path, "no such file (removed while being opened)") from None
        if not _is_hdf5(path):
            raise CheckpointError(path, "not an HDF5 file") from None
        raise CheckpointError(path, f"cannot be opened ({first_line(exc)})") from None
    try:
        with _reading(path, "cannot be opened"):
            if "complete" not in f.attrs or not bool(f.attrs["complete"]):
                raise CheckpointError(path, "incomplete (no 'complete' flag; the write was interrupted)")
            version = int(f.attrs.get("schema_version", -1))
        if version > SCHEMA_VERSION:
            raise CheckpointError(
                path,
                f"schema_version {version} is newer than this flodl_mpi reads "
                f"({SCHEMA_VERSION}); upgrade flodl_mpi",
            )
        return f
    except BaseException:
        f.close()
        raise


def read_checkpoint(path: str | os.PathLike, ranks: Sequence[int] | None = None, verify: bool = False) -> Checkpoint:
    """Read a complete checkpoint back into numpy arrays.

    Args:
        path: the file.
        ranks: whose per-rank state to read (None: every rank's); a resuming rank
            reads only its own, so memory does not grow with the world size.
        verify: first read every dataset of the file (`verify_checkpoint`), in the
            same open, so a damaged one anywhere (a rank's state too) is refused.

    Returns:
        `Checkpoint` with arrays as stored (floating float32, integer/bool as written;
        0-d arrays for scalars), ``meta`` decoded (JSON values back to dict/list),
        ``order`` the state-dict key order.

    Raises:
        CheckpointError: missing file (`CheckpointMissing`), not HDF5, damaged
            (HDF5 refuses it, a checksum mismatch, a missing group), incomplete,
            schema newer than ``SCHEMA_VERSION``, or a name in ``order`` without its
            dataset; every h5py or OS error comes out as this, naming the file and the cause.
    """
    path = Path(path)
    with _open(path) as f:
        if verify:
            _verify_open(f, path)
        return _read_open(f, path, ranks)


def _read_open(f: h5py.File, path: Path, ranks: Sequence[int] | None) -> Checkpoint:
    """`read_checkpoint` of a file `_open` opened."""
    with _reading(path):
        # Schema 1 stored names as they were (it refused '/'); schema 2 escapes them.
        version = int(f.attrs["schema_version"])
        name = unescape_name if version >= 2 else str
        params = {name(k): np.asarray(v[()]) for k, v in f["params"].items()}
        buffers = {name(k): np.asarray(v[()]) for k, v in f["buffers"].items()}
        order = json.loads(f.attrs["order"])
    with _reading(path, "unreadable meta"):
        meta = read_attrs(f.attrs, skip=_RESERVED)
        saved = sorted(int(r) for r in f.get("ranks", {}))
    states = {r: _read_rank(f, path, r) for r in (saved if ranks is None else ranks)}
    lost = [k for k in order if k not in params and k not in buffers]
    if lost:
        raise CheckpointError(path, f"names in 'order' without a dataset: {lost}")
    return Checkpoint(params=params, buffers=buffers, meta=meta, order=order, path=path, ranks=states,
                      schema_version=version)


def _read_rank(f: h5py.File, path: Path, rank: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    with _reading(path, f"unreadable state of rank {rank}"):
        if str(rank) not in f.get("ranks", {}):
            saved = sorted(int(r) for r in f.get("ranks", {}))
            raise CheckpointError(path, f"holds no state for rank {rank} (it has ranks {saved})")
        group = f["ranks"][str(rank)]
        arrays: dict[str, np.ndarray] = {}
        group.visititems(
            lambda name, obj: arrays.__setitem__(name, np.asarray(obj[()])) if isinstance(obj, h5py.Dataset) else None
        )
        return arrays, read_attrs(group.attrs)


def read_rank_state(path: str | os.PathLike, rank: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """One rank's ``(arrays, attrs)`` from a checkpoint, without reading anything else.

    Raises:
        CheckpointError: as `read_checkpoint`, or no state saved for ``rank``.
    """
    path = Path(path)
    with _open(path) as f:
        return _read_rank(f, path, rank)


def read_cohort_state(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The state every rank holds alike (``/cohort``: the outer optimizer's), as ``(arrays, attrs)``.

    Raises:
        CheckpointError: as `read_checkpoint`, no cohort state in the file, or a
            checksum mismatch in it.
    """
    path = Path(path)
    with _open(path) as f:
        with _reading(path, "unreadable cohort state"):
            if "cohort" not in f:
                raise CheckpointError(path, "holds no cohort state (written by a run without an outer optimizer)")
            arrays = {k: np.asarray(v[()]) for k, v in f["cohort"].items()}
            return arrays, read_attrs(f["cohort"].attrs)


def load_state_dict(path: str | os.PathLike) -> "collections.OrderedDict[str, torch.Tensor]":
    """A plain PyTorch state dict, in the model's key order, from a checkpoint file or directory.

    For use outside the project; no pickle is involved, so any checkpoint is safe to open.
    Floating tensors come back float32; ``load_state_dict`` casts to the model's dtype.

    Args:
        path: a checkpoint file; or a run directory or its ``checkpoints/``: then the
            newest checkpoint there that still exists and reads back, chosen and read in
            one open (`read_newest`), so this is safe while the run trains and prunes
            old checkpoints. A damaged one passed over is named in a `UserWarning`.

    Example::

        model.load_state_dict(load_state_dict("runs/x"))          # the newest, while the run trains
        model.load_state_dict(load_state_dict("runs/x/checkpoints/ckpt-e000005-r000123.h5"))

    Raises:
        CheckpointError: as `read_checkpoint` for a file; as `read_newest` for a
            directory (none there, every one removed or damaged). Never a raw h5py
            or OS error.
    """
    path = Path(path)
    if path.is_dir():
        ckpt, passed_over = read_newest(path / "checkpoints" if (path / "checkpoints").is_dir() else path, ranks=[])
        for damaged, why in passed_over:
            warnings.warn(f"checkpoint {damaged} is damaged ({why}); loaded {ckpt.path.name}, "
                          "the newest that reads back", stacklevel=2)
    else:
        ckpt = read_checkpoint(path, ranks=[])
    return state_dict_of(ckpt)


def state_dict_of(ckpt: Checkpoint) -> "collections.OrderedDict[str, torch.Tensor]":
    """A read checkpoint's params and buffers as a PyTorch state dict, in ``ckpt.order``
    (tensors share memory with the arrays; floating ones float32, as stored)."""
    import torch

    arrays = {**ckpt.params, **ckpt.buffers}
    return collections.OrderedDict((k, torch.from_numpy(arrays[k])) for k in ckpt.order)


def read_newest(directory: str | os.PathLike, ranks: Sequence[int] | None = (),
                verify: bool = False) -> tuple[Checkpoint, list[tuple[Path, str]]]:
    """The newest checkpoint in ``directory`` that still exists and reads back, chosen and read in one open.

    Safe while a run writes here and prunes its old checkpoints: a listing and an
    open are never one step, so a file removed in between (`CheckpointMissing`) is
    passed over for the next newest, and once a file is open its removal does not
    hurt (POSIX keeps an unlinked file's data until it is closed). When no file
    listed could be read and the directory's ``*.h5`` files changed while the reader
    looked (the writer saved and pruned), it is listed again, up to `RELISTS` times.
    A complete checkpoint that does not read back is passed over too, and reported
    (resume's rule, `newest_verified`, reading only).

    Args:
        directory: a ``checkpoints/`` directory.
        ranks: whose per-rank state to read (as `read_checkpoint`; default none).
        verify: also read every other dataset (`verify_checkpoint`: each
            rank's state, the cohort state), in the same open, before trusting the file.

    Returns:
        ``(checkpoint, damaged)``: ``damaged`` lists ``(path, why)`` newest first: the
        complete checkpoints passed over because they did not read back, and the files
        under a checkpoint name (``ckpt-*.h5``) newer than the one read that are not
        complete checkpoints. A file removed before it was opened is not damaged.

    Raises:
        CheckpointError: no checkpoint (the path is ``directory``: missing, empty, or
            every one listed removed before it could be opened ``RELISTS`` times over),
            or every one damaged (the path is the newest damaged one).
    """
    directory = Path(directory)
    damaged: list[tuple[Path, str]] = []
    tried: set[Path] = set()
    gone: set[str] = set()  # names seen, then removed before they could be read
    for _ in range(RELISTS):
        before = _h5_names(directory)
        for path in reversed([p for p in list_checkpoints(directory) if p not in tried]):
            tried.add(path)
            try:
                ckpt = read_checkpoint(path, ranks, verify)
            except CheckpointMissing:  # pruned since the listing: the next newest
                continue
            except CheckpointError as exc:
                damaged.append((path, exc.problem))
                continue
            newer = [(p, "not a complete checkpoint") for p in _incomplete(directory) if p.name > path.name]
            return ckpt, sorted(newer + damaged, key=lambda item: item[0].name, reverse=True)
        after = _h5_names(directory)
        gone |= before - after
        if after == before:  # nothing came or went while this looked: a new listing finds nothing new
            break
    if damaged:
        raise CheckpointError(damaged[0][0], f"damaged ({damaged[0][1]}), and no older checkpoint reads back")
    if not directory.is_dir():
        raise CheckpointError(directory, "no such directory")
    if gone:
        raise CheckpointError(directory, f"no complete checkpoint left: the {len(gone)} listed were each removed "
                                         "before they could be opened (pruned by the run writing here?)")
    raise CheckpointError(directory, "no complete checkpoint in this directory")


# ---------------------------------------------------------------- directory


def checkpoint_name(epoch: int, round_: int) -> str:
    """File name for a save at ``epoch`` and averaging round ``round_``; sorts by time.

    >>> checkpoint_name(5, 123)
    'ckpt-e000005-r000123.h5'
    """
    if epoch < 0 or round_ < 0:
        raise ValueError(f"epoch and round_ must be >= 0, got epoch={epoch}, round_={round_}")
    return f"ckpt-e{epoch:06d}-r{round_:06d}.h5"


def _sort_key(path: Path) -> tuple[int, str] | None:
    """(meta round, name) of a complete checkpoint; None when unreadable or incomplete."""
    try:
        with _open(path) as f:
            r = f.attrs.get("round", -1)  # without a round, a file sorts first
            return (int(r) if np.ndim(r) == 0 else -1, path.name)
    except READ_ERRORS:  # CheckpointError included (a ValueError): removed, damaged, incomplete
        return None


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Complete ``*.h5`` checkpoints in ``directory``, oldest first.

    Ordered by meta ``round`` (files without one first), then by name. Temporary
    (``*.tmp-<pid>``), incomplete and unreadable files are skipped; a missing
    directory gives an empty list.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    keyed = [(key, p) for p in directory.glob("*.h5") if (key := _sort_key(p)) is not None]
    return [p for _, p in sorted(keyed)]


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in ``directory`` (what resume loads), or None.

    A name, not an open file: while a run trains, its pruning may remove the file
    before the caller opens it (a `CheckpointError`, "no such file"). To read the
    newest while a run writes, pass the directory itself to `load_state_dict` or
    use `read_newest`, which choose and open in one step.

    None only for a directory that holds no complete checkpoint: a listing that
    found none while the directory's ``*.h5`` files changed (the writer pruned the
    ones it was opening and saved newer ones) is taken again, up to `RELISTS` times.
    """
    directory = Path(directory)
    found: list[Path] = []
    for _ in range(RELISTS):
        before = _h5_names(directory)
        found = list_checkpoints(directory)
        if found or _h5_names(directory) == before:
            break
    return found[-1] if found else None


def verify_checkpoint(path: str | os.PathLike) -> None:
    """Read every dataset of a checkpoint, so each Fletcher-32 checksum is checked.

    The header check of `list_checkpoints` does not read the weights; this does,
    before a resume trusts the file.

    Raises:
        CheckpointError: as `read_checkpoint`, or a dataset whose data does not
            read back (checksum mismatch, truncated file), named.
    """
    path = Path(path)
    with _open(path) as f:
        _verify_open(f, path)


def _verify_open(f: h5py.File, path: Path) -> None:
    """`verify_checkpoint` of a file `_open` opened."""
    def read(name: str, obj) -> None:
        if isinstance(obj, h5py.Dataset):
            with _reading(path, f"unreadable data in {name!r}"):
                obj[()]

    with _reading(path, "unreadable structure"):  # a damaged group or link table
        f.visititems(read)


def _h5_names(directory: Path) -> set[str]:
    """The names of the ``*.h5`` files in ``directory`` now (none when it is missing)."""
    return {p.name for p in directory.glob("*.h5")}


def _incomplete(directory: Path) -> list[Path]:
    """Files under a checkpoint name (``ckpt-*.h5``) that are there and are not complete checkpoints, by name.

    A file that a writer renames in, or prunes, while this looks is neither: it is
    checked (`_sort_key`) before its existence, so one removed meanwhile is not named.
    """
    return [p for p in sorted(directory.glob("ckpt-*.h5")) if _sort_key(p) is None and p.exists()]


def newest_verified(directory: str | os.PathLike) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint whose every byte reads back, and the damaged ones met on the way; reads only.

    Files under a checkpoint name (``ckpt-*.h5``) that are not complete checkpoints
    are damaged (all of them, any age); then the complete ones are verified newest
    first (`verify_checkpoint`) until one reads back, and those that failed before
    it are damaged too. Files older than the one chosen are not read.

    Returns:
        ``(newest good checkpoint or None, [(damaged path, why), ...])``: the
        incomplete ones first (in name order), then the complete ones that failed,
        newest first.
    """
    directory = Path(directory)
    good = list_checkpoints(directory)
    damaged: list[tuple[Path, str]] = [(p, "not a complete checkpoint") for p in _incomplete(directory)]
    for path in reversed(good):
        try:
            verify_checkpoint(path)
        except CheckpointMissing:  # removed since the listing (no run holds the lock): not damaged
            continue
        except CheckpointError as exc:
            damaged.append((path, exc.problem))
            continue
        return path, damaged
    return None, damaged


def set_aside_damaged(directory: str | os.PathLike) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint whose every byte reads back; damaged ones renamed ``*.damaged``.

    The damaged files of `newest_verified` (not complete; complete with data that
    fails `verify_checkpoint`, newer than the one chosen) are renamed
    ``<name>.damaged``: never resumed from, not overwritten by the next save, kept
    for a look.

    Returns:
        ``(newest good checkpoint or None, [(path set aside, why), ...])``.
    """
    chosen, aside = newest_verified(directory)
    for path, _ in aside:
        path.rename(path.with_name(path.name + ".damaged"))
    return chosen, aside


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` of this host is alive (a temporary file's writer; False for pid <= 0)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)  # signal 0: existence check only
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def prune_checkpoints(directory: str | os.PathLike, keep: int) -> list[Path]:
    """Delete the oldest complete checkpoints beyond the newest ``keep``, and stale temps.

    A temporary file ``*.tmp-<pid>`` is stale when no process ``<pid>`` is alive on
    this host (a killed write); temporaries of live processes, this one included,
    may be writes in flight and are left alone. Incomplete files are not touched.

    Args:
        keep: how many complete checkpoints to keep, >= 1.

    Returns:
        The paths deleted.

    Raises:
        ValueError: ``keep`` < 1.
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an int >= 1, got {keep!r}")
    directory = Path(directory)
    doomed = list_checkpoints(directory)[:-keep]
    for p in directory.glob("*.tmp-*") if directory.is_dir() else ():
        m = TMP_RE.search(p.name)
        if m and int(m.group(1)) != os.getpid() and not pid_alive(int(m.group(1))):
            doomed.append(p)
    for p in doomed:
        p.unlink(missing_ok=True)
    return doomed
