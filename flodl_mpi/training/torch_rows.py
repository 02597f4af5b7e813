"""A map-style ``torch.utils.data.Dataset`` as the trainer's features: each rank reads only its batches.

Invariant: ``DatasetRows(ds)[idx]`` is ``np.stack([float32(ds[i][0]) for i in idx])`` for a slice
or an index array, whichever way it is read: in this process, or by a
``torch.utils.data.DataLoader``'s worker processes (``num_workers``, ``pin_memory``) reading
ahead the batches `prefetch` was handed, in that order. The trainer asks only for its own
rank's batches of the plan (`flodl_mpi.training.data.batch_indices` of the epoch's order), so a
rank reads its batches and nothing else, the same rows as from arrays: the same float32 values,
the same run, bit for bit. The labels are read once at the start (`dataset_labels`).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader

from flodl_mpi.training.stream import row_index

__all__ = ["DatasetRows", "dataset_labels", "is_map_dataset"]


def is_map_dataset(obj) -> bool:
    """Whether ``obj`` is a map-style dataset (``__getitem__`` and ``__len__``; not an array, tensor or pair)."""
    if isinstance(obj, (np.ndarray, torch.Tensor, tuple, list, dict, str)):
        return False
    return (
        isinstance(obj, torch.utils.data.Dataset)
        and hasattr(obj, "__len__")
        and not isinstance(obj, torch.utils.data.IterableDataset)
    )


def _float32(value) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    with np.errstate(over="ignore"):  # out of float32's range: inf, refused by the check
        return np.asarray(value, dtype=np.float32)


def _collate_x(items: list) -> torch.Tensor:
    """A batch's features: each item's first element as float32, stacked (in a worker or here)."""
    return torch.from_numpy(np.ascontiguousarray(np.stack([_float32(item[0]) for item in items])))


def _collate_y(items: list) -> np.ndarray:
    return np.stack(
        [np.asarray(item[1].detach().cpu() if isinstance(item[1], torch.Tensor) else item[1]) for item in items]
    )


class _Batches:
    """A batch sampler whose batches are set before each pass of the loader (the loader's workers persist)."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def dataset_labels(dataset, name: str, num_workers: int = 0, batch_size: int = 1024) -> np.ndarray:
    """Every item's label (its second element) in index order, as an array ``(N, ...)``.

    A ``targets`` attribute of length N (torchvision's datasets) is taken as the labels when
    it equals the label of the first and the last item (a ``target_transform`` would not);
    otherwise every item is read once (with ``num_workers`` loader workers).

    Raises:
        ValueError: the dataset is empty, or its items are not ``(x, y)`` pairs.
    """
    n = len(dataset)
    if n == 0:
        raise ValueError(f"{name}: the dataset is empty")
    first = dataset[0]
    if not isinstance(first, (tuple, list)) or len(first) < 2:
        raise ValueError(f"{name}: items must be (x, y) pairs, got {type(first).__name__}")
    targets = getattr(dataset, "targets", None)
    if targets is not None and len(targets) == n:
        y = np.asarray(targets.detach().cpu() if isinstance(targets, torch.Tensor) else targets)
        ends = _collate_y([first, dataset[n - 1]])
        if y.ndim >= 1 and np.array_equal(y[[0, n - 1]], ends):
            return y
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers, collate_fn=_collate_y)
    return np.concatenate(list(loader))


class DatasetRows:
    """The features (first elements) of a map-style dataset's items as float32 rows, read when indexed.

    ``rows[i:j]`` and ``rows[idx]`` return C-contiguous float32 ``(k, *feature_shape)``.
    :meth:`prefetch` hands the loader's workers the batches the training thread will ask for
    next (`flodl_mpi.training.stream.H5Rows`'s contract): an index array that is the next one
    handed over is served from them; anything else is read here, in this process.

    Args:
        dataset: map-style, ``dataset[i] -> (x, y, ...)``; ``x`` numeric (array, tensor, number list).
        name: the split's name for messages (``"train"``).
        num_workers, pin_memory: as ``torch.utils.data.DataLoader``'s (0: read in this process);
            the workers persist over the run (``persistent_workers``).

    Raises:
        ValueError: items of different shapes, or non-finite features (naming the item's index).
    """

    dtype = np.dtype(np.float32)

    def __init__(self, dataset, name: str, num_workers: int = 0, pin_memory: bool = False) -> None:
        self.dataset, self.name = dataset, name
        self.num_workers, self.pin_memory = int(num_workers), bool(pin_memory)
        first = _float32(dataset[0][0])
        self.shape = (len(dataset), *first.shape)
        self.ndim = len(self.shape)
        self._sampler = _Batches()
        self._loader = DataLoader(
            dataset,
            batch_sampler=self._sampler,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            collate_fn=_collate_x,
            persistent_workers=self.num_workers > 0,
        )
        self._pending: list[np.ndarray] = []  # handed over, not taken, in order
        self._chunks: collections.deque = collections.deque()  # sizes of the passes still to start
        self._iter = None
        self._left = 0  # batches the running pass still yields
        if self.num_workers > 0:  # the workers start now, with the data, before the trainer's threads do
            self._iter = iter(self._loader)

    def __len__(self) -> int:
        return self.shape[0]

    def loader_words(self) -> str:
        """The train.log line on how the dataset is read."""
        return (
            f"data from a torch Dataset ({type(self.dataset).__name__}): each rank reads only its batches' "
            f"items, num_workers {self.num_workers}, pin_memory {self.pin_memory}; the labels are in memory"
        )

    def _check(self, x: np.ndarray, idx: np.ndarray) -> np.ndarray:
        if x.shape[1:] != self.shape[1:]:
            raise ValueError(
                f"{self.name}: items have features of shape {x.shape[1:]}, item 0 of "
                f"{self.shape[1:]}: every item's x must have one shape"
            )
        finite = np.isfinite(x.reshape(len(x), -1)).all(axis=1)
        if not finite.all():
            raise ValueError(
                f"{self.name}: item {int(idx[np.flatnonzero(~finite)[0]])} holds non-finite features "
                "(NaN or Inf as float32)"
            )
        return x

    def _read(self, idx: np.ndarray) -> np.ndarray:
        if len(idx) == 0:
            return np.empty((0, *self.shape[1:]), dtype=np.float32)
        return self._check(_collate_x([self.dataset[int(i)] for i in idx]).numpy(), idx)

    def __getitem__(self, key) -> np.ndarray:
        if isinstance(key, slice):
            return self._read(np.arange(*key.indices(self.shape[0]), dtype=np.int64))
        idx = row_index(key, self.shape[0], "DatasetRows", "item")
        if self._pending and np.array_equal(self._pending[0], idx):
            if self._left == 0:  # the next pass: its batches were handed over together
                self._start(self._chunks.popleft())
            self._pending.pop(0)
            self._left -= 1
            return self._check(next(self._iter).numpy(), idx)
        self._drop()  # asked for something else: what was handed over is not wanted
        return self._read(idx)

    def _start(self, k: int) -> None:
        self._sampler.batches = [b.tolist() for b in self._pending[:k]]
        self._iter, self._left = iter(self._loader), k

    def prefetch(self, batches: Sequence[np.ndarray]) -> None:
        """Have the loader read ``batches`` (index arrays, in the order they will be asked for).

        Batches handed over earlier and not taken yet that are the first of ``batches`` stay;
        otherwise they are dropped (never served late). The new ones are read in one pass of
        the loader, started as soon as the passes before it are done.
        """
        batches = [np.asarray(b, dtype=np.int64) for b in batches]
        k = len(self._pending)
        if k > len(batches) or not all(map(np.array_equal, self._pending, batches)):
            self._drop()
            k = 0
        new = batches[k:]
        if not new:
            return
        self._pending += new
        if self._left == 0 and not self._chunks:
            self._start(len(new))
        else:
            self._chunks.append(len(new))

    def _drop(self) -> None:
        """Forget what was handed over (a pass left unfinished: the next pass's start drains it)."""
        self._pending, self._chunks, self._left, self._iter = [], collections.deque(), 0, None

    def close(self) -> None:
        """End the loader's worker processes (the last references to its iterator go; idempotent)."""
        self._drop()
        self._loader = None
