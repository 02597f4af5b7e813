"""A view of some rows of array-like features (in-memory, streamed, a torch Dataset's), by index.

Invariant: ``RowsView(base, rows)[k]`` is ``base[rows[k]]`` for any slice or index array ``k``,
and what it hands `prefetch` is the same mapping, so a view of streamed features (the
``--val-fraction`` split of them) reads only the rows asked for, as the base does. No MPI.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["RowsView"]


class RowsView:
    """Rows ``rows`` of ``base`` (an array-like of features indexed by slices and int arrays).

    Args:
        base: `flodl_mpi.training.stream.H5Rows`, `flodl_mpi.training.torch_rows.DatasetRows`,
            or an array; indexed with int64 arrays of its rows.
        rows: int64 ``(n,)``, the base's rows in the view's order.

    Attributes:
        shape: ``(n, *features)``. dtype, ndim: the base's.
    """

    def __init__(self, base, rows: np.ndarray) -> None:
        self.base, self.rows = base, np.asarray(rows, dtype=np.int64)
        self.shape = (len(self.rows), *tuple(base.shape[1:]))
        self.dtype, self.ndim = base.dtype, len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key) -> np.ndarray:
        return self.base[self.rows[key]]

    def prefetch(self, batches: Sequence[np.ndarray]) -> None:
        """Hand the base the rows of ``batches`` (view indices) to read ahead, when it reads ahead."""
        if hasattr(self.base, "prefetch"):
            self.base.prefetch([self.rows[np.asarray(b, dtype=np.int64)] for b in batches])

    def close(self) -> None:
        """Close the base (idempotent where the base is)."""
        if hasattr(self.base, "close"):
            self.base.close()
