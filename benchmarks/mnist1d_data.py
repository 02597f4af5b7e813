"""Write MNIST-1D as a flodl-mpi data file: ``python benchmarks/mnist1d_data.py OUT.h5``.

MNIST-1D (Greydanus & Kobak 2024, arXiv:2011.14439) is generated locally by the
``mnist1d`` package (``pip install mnist1d``; no download): 4,000 train / 1,000
test samples of 40 float features, 10 classes, with the package's default
arguments (``get_dataset_args()``, seed 42). The file holds ``train/x``
float32 ``(4000, 40)``, ``train/y`` int64 ``(4000,)``, ``test/x``, ``test/y``:
the layout ``flodl-mpi train --data`` reads.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import h5py
import numpy as np


def write_mnist1d(path: str | os.PathLike) -> Path:
    """Generate MNIST-1D with the package's defaults and write it to ``path`` (atomically)."""
    from mnist1d.data import get_dataset_args, make_dataset

    data = make_dataset(get_dataset_args())
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    with h5py.File(tmp, "w") as f:
        f["train/x"] = np.asarray(data["x"], dtype=np.float32)
        f["train/y"] = np.asarray(data["y"], dtype=np.int64)
        f["test/x"] = np.asarray(data["x_test"], dtype=np.float32)
        f["test/y"] = np.asarray(data["y_test"], dtype=np.int64)
        f.attrs["source"] = "mnist1d.data.make_dataset(get_dataset_args())"
    os.replace(tmp, path)
    return path


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="output HDF5 file")
    print(write_mnist1d(p.parse_args().out))
