"""HDF5 datasets, the built-in digits data, and the per-epoch sample order.

Invariant: a loaded ``Dataset`` is fully validated (float32 finite features, int64
non-negative labels, matching row counts and feature shapes), and every rank derives the
same sample order from ``(seed, epoch)`` alone, so no order is ever communicated.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from flodl_mpi.config import DATA_LOADING, TASKS  # fit(task=...): None infers it from the targets' dtype

__all__ = [
    "DATA_LOADING",
    "DEFAULT_NAMES",
    "VAL_NAMES",
    "DataError",
    "Dataset",
    "Split",
    "TASKS",
    "batch_indices",
    "check_layout",
    "dataset_from_arrays",
    "for_task",
    "default_digits_path",
    "ensure_digits",
    "epoch_permutation",
    "load_dataset",
    "num_batches",
    "smallest_batch",
    "with_val",
    "write_digits",
]

#: ``--data-loading auto`` streams (`flodl_mpi.training.stream`) when both splits' features as float32 exceed
#: this share of the host's available memory per rank on it.
STREAM_ABOVE = 0.25

#: Dataset names inside the HDF5 file, by role.
DEFAULT_NAMES = {"train_x": "train/x", "train_y": "train/y", "test_x": "test/x", "test_y": "test/y"}


class DataError(ValueError):
    """Bad input data; the message is one line naming the file, the dataset and the problem."""


@dataclass(frozen=True)
class Split:
    """One split: ``x`` float32 (N, *feature_shape), C-contiguous; ``y`` int64 (N,) or (N, T) (per position)."""

    x: np.ndarray
    y: np.ndarray

    @property
    def n(self) -> int:
        """Number of samples N."""
        return int(self.x.shape[0])

    @property
    def feature_shape(self) -> tuple[int, ...]:
        """Shape of one sample, ``x.shape[1:]``."""
        return tuple(self.x.shape[1:])


@dataclass(frozen=True)
class Dataset:
    """Train and test splits of one source; ``num_classes`` = max label over both + 1."""

    train: Split
    test: Split
    num_classes: int
    source: str
    #: where ``num_classes`` came from, for the log: ``10 classes (largest label 9 in 'train/y')``
    #: or ``10 classes (attribute num_classes of 'data.h5')``; "" for regression.
    classes_note: str = ""
    #: lines (``warning: ...``) on labels that add classes training never targets: a test label
    #: the training split lacks, no label 0 (1-based labels); logged by the trainer's header.
    warnings: tuple[str, ...] = ()
    #: the validation split (``--val-fraction``: `flodl_mpi.training.validation`), or None.
    val: Split | None = None

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one sample (the train split's feature shape; test has the same)."""
        return self.train.feature_shape


# --------------------------------------------------------------------------- loading


def _check_names(names: Mapping[str, str]) -> dict[str, str]:
    if not isinstance(names, Mapping):
        raise TypeError(f"names must be a mapping like DEFAULT_NAMES, got {type(names).__name__}")
    unknown = sorted(set(names) - set(DEFAULT_NAMES))
    if unknown:
        raise ValueError(f"names has unknown keys {unknown}; allowed: {sorted(DEFAULT_NAMES)}")
    merged = {**DEFAULT_NAMES, **names}  # keys not given keep their default name
    for key, value in merged.items():
        if not isinstance(value, str) or not value:
            raise TypeError(f"names[{key!r}] must be a non-empty str, got {value!r}")
    return merged


def _list_datasets(f: h5py.File) -> list[str]:
    found: list[str] = []
    f.visititems(lambda name, obj: found.append(name) if isinstance(obj, h5py.Dataset) else None)
    return found


def _dataset_of(f: h5py.File, name: str, file: str) -> h5py.Dataset:
    obj = f.get(name)
    if not isinstance(obj, h5py.Dataset):
        has = ", ".join(_list_datasets(f)) or "no datasets"
        what = "is a group, not a dataset" if obj is not None else "not found"
        raise DataError(f"dataset {name!r} {what} in {file!r} (has: {has})")
    return obj


def _open(file: str) -> h5py.File:
    if not os.path.exists(file):
        raise DataError(f"--data {file!r}: no such file")
    try:
        return h5py.File(file, "r")
    except OSError as exc:  # not HDF5, truncated, a directory, no permission
        raise DataError(f"--data {file!r}: cannot open as HDF5 ({exc})") from exc


def check_layout(path: str | os.PathLike, names: Mapping[str, str] = DEFAULT_NAMES) -> None:
    """What :func:`load_dataset` checks before it reads a value, from the file's metadata only (fast).

    The file exists and is HDF5, each dataset of ``names`` is there, features are numeric
    ``(N, ...)``, labels 1-D integers, rows match within each split; a ``val`` group holds ``val/x``
    and ``val/y`` of the training set's feature shape, rows matching. The CLI asks it before
    MPI and torch start (issue 26 item 9), so such a mistake is refused in well under a
    second instead of after their 8-20 s; the messages are `load_dataset`'s.

    Raises:
        DataError: as :func:`load_dataset`, for the problems above.
    """
    names = _check_names(names)
    file = str(path)
    with _open(file) as f:
        objs = {role: _dataset_of(f, name, file) for role, name in names.items()}
        for split in ("train", "test"):
            x, y = objs[f"{split}_x"], objs[f"{split}_y"]
            xname, yname = names[f"{split}_x"], names[f"{split}_y"]
            _feature_kind(x.dtype, x.shape, xname, file)
            _label_kind(y.dtype, y.shape, yname, file)
            if x.shape[0] != y.shape[0]:
                raise DataError(f"{xname!r} has {x.shape[0]} rows but {yname!r} has {y.shape[0]} in {file!r}")
        if "val" in f:  # the file's own validation set: the checks `with_val` makes from the metadata
            x, y = (_dataset_of(f, VAL_NAMES[role], file) for role in ("val_x", "val_y"))
            _feature_kind(x.dtype, x.shape, VAL_NAMES["val_x"], file)
            if y.dtype.kind in "iu":  # whole-number floats are labels too: their values are checked at load
                _label_kind(y.dtype, y.shape, VAL_NAMES["val_y"], file)
            if x.shape[0] != y.shape[0]:
                raise DataError(f"{VAL_NAMES['val_x']!r} has {x.shape[0]} rows but {VAL_NAMES['val_y']!r} has "
                                f"{y.shape[0]} in {file!r}")
            train_shape = tuple(objs["train_x"].shape[1:])
            if tuple(x.shape[1:]) != train_shape:
                raise DataError(f"{VAL_NAMES['val_x']!r} has feature shape {tuple(x.shape[1:])} but the training "
                                f"set has {train_shape} in {file!r}")


def _feature_kind(dtype: np.dtype, shape: tuple, name: str, file: str) -> None:
    if dtype.kind not in "biuf":
        raise DataError(f"{name!r} in {file!r} must be numeric features, got {dtype}")
    if len(shape) < 2:
        raise DataError(f"{name!r} in {file!r} must have shape (N, features...), got {tuple(shape)}")


def _features(x: np.ndarray, name: str, file: str) -> np.ndarray:
    _feature_kind(x.dtype, x.shape, name, file)
    if x.size == 0:
        raise DataError(f"{name!r} in {file!r} is empty (shape {x.shape})")
    return _finite_float32(x, name, file)


def _finite_float32(x: np.ndarray, name: str, file: str) -> np.ndarray:
    """``x`` as contiguous float32, refused if any value is NaN or Inf after the cast."""
    # Checked after the cast: float64 values beyond float32's range become inf here,
    # which is reported below rather than as numpy's overflow warning.
    with np.errstate(over="ignore"):
        x = np.ascontiguousarray(x, dtype=np.float32)
    finite = np.isfinite(x)
    if not finite.all():  # issue 26 item 9: the row to look at, and how many there are
        bad = ~finite.reshape(len(x), -1).all(axis=1)
        row = int(np.flatnonzero(bad)[0])
        value = x[row].reshape(-1)[~finite[row].reshape(-1)][0]
        count = int(bad.sum())
        raise DataError(f"{name!r} in {file!r} holds non-finite values (NaN or Inf as float32): row {row} first "
                        f"({float(value)}), {count} row{'s' if count != 1 else ''} of {len(x)} in all")
    return x


def _label_kind(dtype: np.dtype, shape: tuple, name: str, file: str) -> None:
    """Integer labels: one per sample ``(N,)``, or one per position ``(N, T)`` with ``T >= 2``.

    Per-position labels are a sequence task's targets (a language model's next
    tokens: the loss is the cross-entropy at every position, the model returns
    logits ``(batch, C, T)``, as ``torch.nn.functional.cross_entropy`` takes
    them). ``(N, 1)`` stays refused: a column of per-sample labels is the
    likelier meaning, and it would need logits ``(batch, C, 1)``.
    """
    if dtype.kind not in "iu" or not (len(shape) == 1 or (len(shape) == 2 and shape[1] >= 2)):
        raise DataError(f"{name!r} in {file!r} must be 1-D integer class labels, got {dtype} {tuple(shape)} "
                        "(or per-position labels: integers of shape (N, T), T >= 2)")


def _labels(y: np.ndarray, name: str, file: str) -> np.ndarray:
    _label_kind(y.dtype, y.shape, name, file)
    if y.size == 0:
        raise DataError(f"{name!r} in {file!r} is empty")
    if y.min() < 0:
        raise DataError(f"{name!r} in {file!r} holds negative labels (min {y.min()})")
    return np.ascontiguousarray(y, dtype=np.int64)


def _targets(y: np.ndarray, name: str, file: str) -> np.ndarray:
    """Targets of any task: integer class labels as :func:`_labels` (per sample or per position), or float
    targets of any shape."""
    if y.dtype.kind in "iu" and (y.ndim == 1 or (y.ndim == 2 and y.shape[1] >= 2)):
        return _labels(y, name, file)
    if y.dtype.kind not in "biuf" or y.ndim < 1:
        raise DataError(f"{name!r} in {file!r} must be numeric targets of shape (N, ...), got {y.dtype} {y.shape}")
    if y.size == 0:
        raise DataError(f"{name!r} in {file!r} is empty")
    return _finite_float32(y, name, file)


def dataset_from_arrays(train: tuple, test: tuple, source: str = "in-memory arrays") -> Dataset:
    """A :class:`Dataset` from in-memory ``(x, y)`` pairs (numpy arrays or tensors), validated as a file is.

    ``x``: numeric ``(N, *features)``; ``y``: 1-D integer class labels >= 0
    (classification), or floating targets ``(N, ...)`` of any shape
    (regression: ``num_classes`` is then 0).

    Raises:
        DataError: as :func:`load_dataset` (the message names ``train`` / ``test``).
    """
    splits = {}
    for split, pair in (("train", train), ("test", test)):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise DataError(f"{split} must be an (x, y) pair of arrays, got {type(pair).__name__}")
        if hasattr(pair[0], "prefetch"):  # rows read as they are indexed (a torch Dataset's): checked then
            x, y = pair[0], _targets(np.asarray(pair[1]), f"{split} y", source)
        else:
            x, y = (np.asarray(a.detach().cpu() if hasattr(a, "detach") else a) for a in pair)
            x, y = _features(x, f"{split} x", source), _targets(y, f"{split} y", source)
        if len(x) != len(y):
            raise DataError(f"{split}: x has {len(x)} rows but y has {len(y)}")
        splits[split] = Split(x=x, y=y)
    return _dataset(splits, {"train_x": "train x", "test_x": "test x", "train_y": "train y", "test_y": "test y"},
                    source)


#: A class count (largest label + 1) above this is refused without a stated ``num_classes``.
MAX_CLASSES = 1 << 20
#: ... and so is one above this many times the number of distinct labels (when also > `SPARSE_FLOOR`).
SPARSE_RATIO = 64
SPARSE_FLOOR = 1024


def _first_row(y: np.ndarray, mask: np.ndarray) -> int:
    """The first row of ``y`` (labels ``(N,)`` or ``(N, T)``) where ``mask`` (``y``'s shape) holds."""
    return int(np.flatnonzero(mask.reshape(len(mask), -1).any(axis=1))[0])


def _row_label(y: np.ndarray, mask: np.ndarray, row: int) -> int:
    """The first label of ``y[row]`` where ``mask`` holds (the label itself for per-sample labels)."""
    return int(y[row].reshape(-1)[mask[row].reshape(-1)][0])


def _class_count(splits: dict, names: Mapping[str, str], file: str, stated: int | None) -> tuple[int, str]:
    """The number of classes of integer labels, and the log's note on where it came from.

    With ``stated`` (the data's ``num_classes`` attribute): every label must be below it.
    Without: largest label + 1, refused when implausible for the labels there are: above
    `MAX_CLASSES`, or above both `SPARSE_FLOOR` and `SPARSE_RATIO` x the distinct labels (a
    stray or sentinel label, e.g. -1 stored unsigned, would make the model allocate an
    output per class up to it).

    Raises:
        DataError: one line naming the file, the dataset, the first offending row and its label.
    """
    ys = [(names[f"{split}_y"], splits[split].y) for split in ("train", "test")]
    if stated is not None:
        for name, y in ys:
            over = y >= stated
            if over.any():
                row = _first_row(y, over)
                raise DataError(f"{name!r} in {file!r}: label {_row_label(y, over, row)} at row {row} is not "
                                "below the data's "
                                f"num_classes {stated} (labels are 0..{stated - 1})")
        return stated, f"{stated} classes (attribute num_classes of {file!r})"
    largest = max(int(y.max()) for _, y in ys)
    name, y = next((name, y) for name, y in ys if int(y.max()) == largest)
    row = _first_row(y, y == largest)
    count = largest + 1
    distinct = len(np.unique(np.concatenate([y for _, y in ys])))
    if count > MAX_CLASSES or (count > SPARSE_FLOOR and count > SPARSE_RATIO * distinct):
        why = (f"more than {MAX_CLASSES}" if count > MAX_CLASSES
               else f"more than {SPARSE_RATIO}x the {distinct} distinct labels")
        raise DataError(f"{name!r} in {file!r}: label {largest} at row {row} makes {count} classes (largest label "
                        f"+ 1), {why}: a stray or sentinel label? Fix that row, or state the class count as the "
                        "attribute num_classes (file root or the labels' dataset)")
    return count, f"{count} classes (largest label {largest} in {name!r})"


def _label_warnings(splits: dict, names: Mapping[str, str], file: str, stated: bool) -> tuple[str, ...]:
    """Labels that give the model outputs training never targets (issue 26 item 9), one line each.

    A test label that no training row has (a typo, another label scheme: those test rows
    can only count as errors), and labels with no 0 anywhere (1-based: class 0 is never
    trained). Not with a stated ``num_classes``: the count was said on purpose.
    """
    if stated:
        return ()
    train, test = splits["train"].y, splits["test"].y
    lines = []
    unseen = ~np.isin(test, train)
    if unseen.any():
        labels = np.unique(test[unseen])
        shown = ", ".join(str(int(v)) for v in labels[:5]) + (", ..." if len(labels) > 5 else "")
        k, row = int(unseen.sum()), _first_row(test, unseen)
        lines.append(f"warning: {names['test_y']!r} in {file!r} holds label{'s' if len(labels) != 1 else ''} "
                     f"{shown} that {names['train_y']!r} never has ({k} test row{'s' if k != 1 else ''}, the "
                     f"first at row {row}): the model gets an output for {'them' if len(labels) != 1 else 'it'} "
                     "that training never targets, and those rows count as errors; check the labels of both "
                     "splits")
    low = min(int(train.min()), int(test.min()))
    if low >= 1:
        high = max(int(train.max()), int(test.max()))
        lines.append(f"warning: no label is 0 in {names['train_y']!r} or {names['test_y']!r} of {file!r} (labels "
                     f"{low}..{high}): class{'es' if low > 1 else ''} 0{f'..{low - 1}' if low > 1 else ''} get"
                     f"{'' if low > 1 else 's'} an output that training never targets; 1-based labels? subtract "
                     f"{low} (labels are 0..C-1)")
    return tuple(lines)


def _dataset(splits: dict, names: Mapping[str, str], file: str, stated: int | None = None) -> Dataset:
    train, test = splits["train"], splits["test"]
    if train.feature_shape != test.feature_shape:
        raise DataError(f"{names['train_x']!r} has feature shape {train.feature_shape} but {names['test_x']!r} has "
                        f"{test.feature_shape} in {file!r}")
    if train.y.dtype.kind != test.y.dtype.kind or train.y.shape[1:] != test.y.shape[1:]:
        raise DataError(f"train and test targets differ in kind or shape: {train.y.dtype} {train.y.shape[1:]} and "
                        f"{test.y.dtype} {test.y.shape[1:]} in {file!r}")
    if train.y.dtype.kind != "i":
        return Dataset(train=train, test=test, num_classes=0, source=file)
    classes, note = _class_count(splits, names, file, stated)
    return Dataset(train=train, test=test, num_classes=classes, source=file, classes_note=note,
                   warnings=_label_warnings(splits, names, file, stated is not None))


#: The validation set's datasets in the HDF5 file, when it has a ``val`` group (in place of ``--val-fraction``).
VAL_NAMES = {"val_x": "val/x", "val_y": "val/y"}


def with_val(data: Dataset, x, y, names: Mapping[str, str] = VAL_NAMES) -> Dataset:
    """``data`` with the validation split ``(x, y)``, checked against the training split.

    ``x``: numeric ``(N, *features)`` (an array, made finite float32 as the others; or the
    array-like rows of streamed features, checked as they are read); ``y``: targets of the
    training split's kind: class labels below ``data.num_classes`` (whole-number floats
    become int64 labels), or float targets of the training targets' shape.

    Raises:
        DataError: one line naming the dataset: a shape, kind or label that does not fit.
    """
    xname, yname, file = names["val_x"], names["val_y"], data.source
    if not hasattr(x, "prefetch"):  # arrays, tensors; rows read on demand are checked as they are read
        x = _features(np.asarray(x.detach().cpu() if hasattr(x, "detach") else x), xname, file)
    y = np.asarray(y.detach().cpu() if hasattr(y, "detach") else y)
    if len(x) != len(y):
        raise DataError(f"{xname!r} has {len(x)} rows but {yname!r} has {len(y)} in {file!r}")
    if tuple(x.shape[1:]) != data.train.feature_shape:
        raise DataError(f"{xname!r} has feature shape {tuple(x.shape[1:])} but the training set has "
                        f"{data.train.feature_shape} in {file!r}")
    if data.train.y.dtype.kind == "i":
        if y.dtype.kind == "f" and y.ndim == 1 and np.array_equal(y, np.round(y)):
            y = y.astype(np.int64)
        y = _labels(y, yname, file)
        over = y >= data.num_classes
        if over.any():
            row = _first_row(y, over)
            raise DataError(f"{yname!r} in {file!r}: label {int(y[row])} at row {row} is not below the "
                            f"{data.num_classes} classes of the training and test sets")
    else:
        y = _targets(y, yname, file).astype(np.float32, copy=False)
        if y.dtype.kind != "f" or y.shape[1:] != data.train.y.shape[1:]:
            raise DataError(f"{yname!r} in {file!r}: targets {y.dtype} {y.shape[1:]} do not match the training "
                            f"targets {data.train.y.dtype} {data.train.y.shape[1:]}")
    return dataclasses.replace(data, val=Split(x=x, y=y))


#: Float targets with at most this many distinct whole values look like class labels.
LABEL_LIKE_MAX_DISTINCT = 256


def _label_like(y: np.ndarray) -> np.ndarray | None:
    """The distinct values of float targets that look like class labels (1-D or ``(N, 1)``,
    whole numbers >= 0, at most `LABEL_LIKE_MAX_DISTINCT` of them), else None."""
    if y.dtype.kind != "f" or not (y.ndim == 1 or (y.ndim == 2 and y.shape[1] == 1)):
        return None
    values = np.unique(y)
    if len(values) > LABEL_LIKE_MAX_DISTINCT or values[0] < 0 or not np.array_equal(values, np.round(values)):
        return None
    return values


def for_task(data: Dataset, task: str | None) -> Dataset:
    """``data`` as ``task`` needs it, its validation split too (see `_for_task`)."""
    out = _for_task(data, task)
    if data.val is None or out is data:
        return out
    return with_val(out, data.val.x, data.val.y, {"val_x": "val x", "val_y": "val y"})


def _for_task(data: Dataset, task: str | None) -> Dataset:
    """``data`` as ``task`` needs it: ``fit(task=...)`` (issue 26 item 6).

    ``"classification"``: integer labels as they are; float targets that are whole
    numbers >= 0 (1-D or ``(N, 1)``) become int64 labels, checked as a file's. ``"regression"``:
    float targets as they are; integer labels become float32 targets ``(N,)``. None: integer
    labels classify, float targets regress, except float targets that look like class labels
    (`_label_like`): refused, since a silent regression on labels trains with mean squared
    error and measures no accuracy (``flodl-mpi train`` refuses float labels too).

    Raises:
        DataError: the refusal above (one line, naming both remedies), or targets that
            ``task`` cannot take (class labels from fractional or multi-column targets).
        ValueError: ``task`` is none of `TASKS` nor None.
    """
    if task is not None and task not in TASKS:
        raise ValueError(f"task={task!r}: must be one of {', '.join(map(repr, TASKS))} or None (from the targets)")
    train, test = data.train, data.test
    kind = train.y.dtype.kind
    if task == "regression":
        if kind != "i":
            return data
        splits = {s: Split(x=getattr(data, s).x, y=getattr(data, s).y.astype(np.float32)) for s in ("train", "test")}
        return Dataset(train=splits["train"], test=splits["test"], num_classes=0, source=data.source)
    if kind == "i":
        return data
    looks = [_label_like(train.y), _label_like(test.y)]
    if task is None:
        if looks[0] is None or looks[1] is None:
            return data
        values = np.union1d(looks[0], looks[1])
        shown = ", ".join(f"{v:g}" for v in values[:5]) + (", ..." if len(values) > 5 else "")
        raise DataError(f"the targets in {data.source!r} are floats that look like class labels (whole numbers, "
                        f"{len(values)} distinct: {shown}): fit() would regress on them (mean squared error, no "
                        "accuracy); pass task='classification' (or integer labels, y.astype('int64')) to classify, "
                        "or task='regression' to regress on them")
    for split, values in zip(("train", "test"), looks):
        if values is None:
            raise DataError(f"task='classification': the {split} targets in {data.source!r} are not class labels "
                            f"(whole numbers >= 0, 1-D): {getattr(data, split).y.dtype} "
                            f"{getattr(data, split).y.shape}")
    splits = {s: Split(x=getattr(data, s).x, y=getattr(data, s).y.reshape(-1).astype(np.int64))
              for s in ("train", "test")}
    names = {"train_x": "train x", "test_x": "test x", "train_y": "train y", "test_y": "test y"}
    return _dataset(splits, names, data.source)


def load_dataset(path: str | os.PathLike, names: Mapping[str, str] = DEFAULT_NAMES,
                 targets: str = "class", loading: str = "memory", ranks_per_host: int = 1) -> Dataset:
    """Read and validate a train/test classification dataset from an HDF5 file.

    Args:
        path: HDF5 file, opened read-only; everything is read into memory, or with
            ``loading="stream"`` the labels only, the features then read as they are
            indexed (:class:`flodl_mpi.training.stream.H5Rows`: the same float32 values;
            their finiteness is checked as each batch is read, a non-finite row then a
            :class:`DataError` in training naming the file row).
        names: dataset names by role, keys as in ``DEFAULT_NAMES`` (``train_x``,
            ``train_y``, ``test_x``, ``test_y``); keys not given keep the default.
            ``*_x``: numeric (N, *feature_shape), N >= 1, finite as float32.
            ``*_y``: integer labels >= 0, 1-D ``(N,)`` or per position ``(N, T)``, ``T >= 2``
            (a sequence task: the model returns logits ``(batch, C, T)``). Train and test
            feature shapes match, and so do the label shapes.
        targets: ``"class"`` (the CLI's) or ``"any"``: also floating ``*_y`` of
            shape ``(N, ...)`` (regression; ``num_classes`` 0), as :func:`dataset_from_arrays`.
        loading: one of `DATA_LOADING`; ``"auto"`` streams when both splits' features as
            float32 exceed `STREAM_ABOVE` of the memory available (/proc/meminfo) divided
            by ``ranks_per_host``, the ranks that each load the file on this host.

    Returns:
        ``Dataset`` with x float32 C-contiguous, y int64, ``num_classes`` = max label + 1.

    Raises:
        DataError: missing or non-HDF5 file, missing dataset, or any invalid content.
        TypeError, ValueError: ``names`` is not a mapping of known keys to strings.
    """
    names = _check_names(names)
    file = str(path)
    if loading not in DATA_LOADING:
        raise ValueError(f"loading must be one of {', '.join(DATA_LOADING)}, got {loading!r}")
    with _open(file) as f:
        objs = {role: _dataset_of(f, name, file) for role, name in names.items()}
        if "val" in f:  # the file's own validation set (docs/tutorial/your-data.rst)
            objs.update({role: _dataset_of(f, name, file) for role, name in VAL_NAMES.items()})
        xs = [role for role in ("train_x", "test_x", "val_x") if role in objs]
        every = {**names, **VAL_NAMES}
        if loading == "auto":
            loading = _auto_loading([objs[role].shape for role in xs], ranks_per_host)
        if loading == "stream":
            for role in xs:
                _feature_kind(objs[role].dtype, objs[role].shape, every[role], file)
                if objs[role].size == 0:
                    raise DataError(f"{every[role]!r} in {file!r} is empty (shape {objs[role].shape})")
        raw = {role: obj[()] for role, obj in objs.items() if loading == "memory" or role.endswith("_y")}
        stated = _stated_classes(f, names["train_y"], file)
    if loading == "stream":
        from flodl_mpi.training.stream import H5Rows

        for role in xs:
            raw[role] = H5Rows(file, every[role], _row_check(every[role], file))

    splits = {}
    for split in ("train", "test"):
        xname, yname = names[f"{split}_x"], names[f"{split}_y"]
        x = raw[f"{split}_x"] if loading == "stream" else _features(raw[f"{split}_x"], xname, file)
        y = (_labels if targets == "class" else _targets)(raw[f"{split}_y"], yname, file)
        if len(x) != len(y):
            raise DataError(
                f"{xname!r} has {len(x)} rows but {yname!r} has {len(y)} in {file!r}"
            )
        splits[split] = Split(x=x, y=y)

    data = _dataset(splits, names, file, stated)
    if "val_x" in raw:
        val_x = raw["val_x"] if loading == "stream" else _features(raw["val_x"], VAL_NAMES["val_x"], file)
        data = with_val(data, val_x, raw["val_y"])
    return data


def _auto_loading(shapes: list, ranks_per_host: int) -> str:
    """``auto``'s choice: ``stream`` when the features as float32 exceed `STREAM_ABOVE` of the memory per rank."""
    from flodl_mpi.training.stream import float32_bytes, memory_available

    available = memory_available()
    need = sum(float32_bytes(s) for s in shapes)
    return "stream" if available is not None and need > STREAM_ABOVE * available / max(1, ranks_per_host) else \
        "memory"


def _row_check(name: str, file: str):
    """The streamed rows' check: the in-memory path's finiteness check, its line naming the file row."""
    def check(values: np.ndarray, rows: np.ndarray) -> np.ndarray:
        finite = np.isfinite(values.reshape(len(values), -1)).all(axis=1)
        if not finite.all():
            first = int(np.flatnonzero(~finite)[0])
            raise DataError(f"{name!r} in {file!r} holds non-finite values (NaN or Inf as float32): row "
                            f"{int(rows[first])}, read while streaming it ({int((~finite).sum())} such row(s) in "
                            "this batch); the file was not loaded whole, so it was not checked at start")
        return values

    return check


def _stated_classes(f: h5py.File, yname: str, file: str) -> int | None:
    """The data's ``num_classes`` attribute (file root, or the train labels' dataset), or None.

    Raises:
        DataError: not an integer >= 1, or the two places state different counts.
    """
    found = {}
    for where, attrs in (("the file's root", f.attrs), (repr(yname), f[yname].attrs)):
        if "num_classes" in attrs:
            value = attrs["num_classes"]
            if np.ndim(value) != 0 or np.asarray(value).dtype.kind not in "iu" or int(value) < 1:
                raise DataError(f"attribute num_classes of {where} in {file!r} must be an integer >= 1, got "
                                f"{np.asarray(value).tolist()!r}")
            found[where] = int(value)
    if len(set(found.values())) > 1:
        raise DataError(f"attribute num_classes differs in {file!r}: "
                        + ", ".join(f"{v} on {k}" for k, v in found.items()))
    return next(iter(found.values()), None)


# --------------------------------------------------------------------------- built-in digits


def default_digits_path() -> Path:
    """Where the built-in digits file lives.

    ``$FLODL_MPI_DATA_DIR/digits.h5`` if that variable is set and non-empty, else
    ``$XDG_CACHE_HOME/flodl_mpi/digits.h5`` with ``XDG_CACHE_HOME`` defaulting to
    ``~/.cache`` (also when empty or relative, as the XDG base-directory spec says).
    """
    data_dir = os.environ.get("FLODL_MPI_DATA_DIR")
    if data_dir:
        return Path(data_dir).expanduser() / "digits.h5"
    cache = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(cache):
        cache = os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "flodl_mpi" / "digits.h5"


def write_digits(path: str | os.PathLike) -> Path:
    """Write scikit-learn's handwritten digits to ``path`` as an HDF5 dataset, atomically.

    1,797 8x8 images (ship with scikit-learn, no download), split once with
    ``train_test_split(test_size=0.2, stratify=y, random_state=0)`` into 1,437 train and
    360 test rows. x = pixels / 16, float32 (N, 64) in [0, 1]; y int64 (N,) in 0..9;
    under the ``DEFAULT_NAMES`` datasets. Parent directories are created.

    The file is written under a unique temporary name in the same directory and then
    renamed onto ``path``, so concurrent writers (several ranks on one node) and readers
    never see a half-written file; the last rename wins with identical content.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        OSError: the directory or file cannot be written.
    """
    # Lazy: scikit-learn is slow to import and needed only to build this file once.
    import sklearn
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    path = Path(path)
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)  # (1797, 64), pixels 0..16 -> [0, 1]
    y = digits.target.astype(np.int64)  # (1797,)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, stratify=y, random_state=0)

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        with h5py.File(tmp, "w") as f:
            arrays = {"train_x": x_tr, "train_y": y_tr, "test_x": x_te, "test_y": y_te}
            for role, arr in arrays.items():
                f.create_dataset(DEFAULT_NAMES[role], data=np.ascontiguousarray(arr))
            f.attrs["source"] = "sklearn.datasets.load_digits"
            f.attrs["split"] = "stratified 80/20, random_state=0"
            f.attrs["scikit_learn_version"] = sklearn.__version__
        # mkstemp creates the file 0600; a shared data dir needs it readable by others.
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def ensure_digits(path: str | os.PathLike | None = None) -> Path:
    """Return the digits file at ``path`` (default ``default_digits_path()``).

    It is written with ``write_digits`` only if it is missing or fails to load with
    ``load_dataset`` (a corrupt or foreign file is replaced).

    Raises:
        OSError: the file cannot be written; its message names ``FLODL_MPI_DATA_DIR``
            when that variable chose the place.
    """
    path = default_digits_path() if path is None else Path(path)
    if path.exists():
        try:
            load_dataset(path)
            return path
        except DataError:
            pass  # corrupt or partial: rewrite below
    try:
        return write_digits(path)
    except OSError as exc:  # one line naming where the path came from
        data_dir = os.environ.get("FLODL_MPI_DATA_DIR")
        where = (f"FLODL_MPI_DATA_DIR={data_dir!r}" if data_dir and path == default_digits_path()
                 else f"the built-in digits file {str(path)!r}")
        raise OSError(f"{where}: cannot write the built-in digits file {path.name} there: "
                                 f"{exc.strerror or exc}" + ("" if data_dir else
                                                             "; set FLODL_MPI_DATA_DIR to a writable directory")
                      ) from exc


# --------------------------------------------------------------------------- sample order


def _check_int(value: object, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def epoch_permutation(n_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The sample order of one epoch: int64 (n_samples,), a permutation of 0..n_samples-1.

    ``np.random.default_rng([seed, epoch]).permutation(n_samples)``: a function of its
    arguments only, so every rank computes the same order, and it differs per epoch.

    Raises:
        TypeError: an argument is not an int. ValueError: an argument is negative.
    """
    n_samples = _check_int(n_samples, "n_samples", 0)
    seed = _check_int(seed, "seed", 0)
    epoch = _check_int(epoch, "epoch", 0)
    return np.random.default_rng([seed, epoch]).permutation(n_samples).astype(np.int64)


def num_batches(n_samples: int, batch_size: int, drop_last: bool = False) -> int:
    """Number of global batches in an epoch of ``n_samples`` (the batch plan).

    The plan cuts the epoch's order into batches of ``batch_size``. The last one
    holds what is left over, with one exception: a lone sample left over
    (``n_samples % batch_size == 1``, ``n_samples > 1``) is folded into the batch
    before it, which then holds ``batch_size + 1`` samples, because a batch of one
    sample fails in a model with BatchNorm in training mode. With ``drop_last``
    the left-over samples (``n_samples % batch_size`` of them, different ones each
    epoch) are not trained on, as PyTorch's ``DataLoader(drop_last=True)``.

    Either way every sample of the plan is in exactly one batch per epoch.

    Examples: 1437 samples in batches of 4 give 359 batches (358 of 4, the last
    of 5); of 32, 45 batches (the last of 29); of 32 with ``drop_last``, 44.

    Raises:
        TypeError: not an int. ValueError: ``n_samples`` < 0 or ``batch_size`` < 1.
    """
    n_samples = _check_int(n_samples, "n_samples", 0)
    batch_size = _check_int(batch_size, "batch_size", 1)
    if drop_last:
        return n_samples // batch_size
    count = -(-n_samples // batch_size)
    if count > 1 and n_samples % batch_size == 1:
        count -= 1  # the lone sample joins the batch before it
    return count


def smallest_batch(n_samples: int, batch_size: int, drop_last: bool = False) -> int:
    """Samples in the smallest batch of the plan of ``num_batches`` (0 if it has no batch).

    E.g. ``smallest_batch(1437, 32) == 29``, ``smallest_batch(1437, 4) == 4``,
    ``smallest_batch(10, 32) == 10``, ``smallest_batch(10, 32, drop_last=True) == 0``.

    Raises:
        TypeError: not an int. ValueError: ``n_samples`` < 0 or ``batch_size`` < 1.
    """
    count = num_batches(n_samples, batch_size, drop_last)
    if count == 0:
        return 0
    if count == 1:
        return min(n_samples, batch_size) if drop_last else n_samples
    rest = n_samples - (count - 1) * batch_size  # samples in the last batch
    return min(batch_size, rest)


def batch_indices(perm: np.ndarray, batch_size: int, batch: int, drop_last: bool = False) -> np.ndarray:
    """Sample indices of global batch ``batch`` (0-based) in the plan of ``num_batches``.

    ``perm[batch*bs:(batch+1)*bs]``, except the last batch: it runs to the end of
    ``perm`` (so it holds a folded lone sample, ``bs + 1`` samples), or, with
    ``drop_last``, stops at ``bs`` samples.

    Args:
        perm: 1-D index array, e.g. from ``epoch_permutation``.
        batch_size: samples per batch, >= 1.
        batch: 0 <= batch < ``num_batches(len(perm), batch_size, drop_last)``.
        drop_last: as in ``num_batches``.

    Returns:
        A view of ``perm``, shape (k,) with 1 <= k <= batch_size + 1.

    Raises:
        ValueError: ``perm`` is not 1-D. TypeError/ValueError: bad ``batch_size``.
        IndexError: ``batch`` out of range.
    """
    if np.ndim(perm) != 1:
        raise ValueError(f"perm must be 1-D, got shape {np.shape(perm)}")
    count = num_batches(len(perm), batch_size, drop_last)
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)):
        raise TypeError(f"batch must be an int, got {type(batch).__name__} {batch!r}")
    if not 0 <= batch < count:
        raise IndexError(f"batch must be in [0, {count}), got {batch}")
    start = batch * batch_size
    last = batch == count - 1 and not drop_last
    return perm[start:] if last else perm[start : start + batch_size]
