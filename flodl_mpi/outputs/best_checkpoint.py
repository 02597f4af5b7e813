"""``--keep-best``: the best epoch's checkpoint kept in ``checkpoints/best/``, beside the newest N.

Invariant: ``checkpoints/best/`` holds one complete checkpoint, the best epoch's, under its
own name (``ckpt-e000007-r000161.h5``); the pruning of ``checkpoints/`` (`flodl_mpi.outputs.
checkpoint.prune_checkpoints`, its ``*.h5`` only) never sees it, and a resume never loads it.
A new best is linked (or, where the file system has no hard links, copied) under a temporary
name and renamed in, then the older one removed: a crash at any point leaves a complete best.
Rank 0's writer thread calls it, after the checkpoint is written and before the pruning.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

__all__ = ["BEST_DIR", "best_checkpoint", "keep_best"]

#: The folder of the best checkpoint, inside the run's ``checkpoints/``.
BEST_DIR = "best"


def keep_best(path: Path) -> Path:
    """Make the complete checkpoint ``path`` the kept best; returns its path in ``best/``.

    Raises:
        OSError: it cannot be linked or copied there (the disk is full, say).
    """
    folder = path.parent / BEST_DIR
    folder.mkdir(exist_ok=True)
    final = folder / path.name
    tmp = folder / f"{path.name}.tmp-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    try:
        os.link(path, tmp)  # the same bytes, no copy: pruning path later removes one name only
    except OSError:
        shutil.copyfile(path, tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
    os.replace(tmp, final)
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    for old in folder.iterdir():
        if old != final:
            old.unlink(missing_ok=True)
    return final


def best_checkpoint(checkpoints: str | os.PathLike) -> Path | None:
    """The kept best checkpoint of a run's ``checkpoints/`` folder, or None."""
    found = sorted((Path(checkpoints) / BEST_DIR).glob("ckpt-*.h5"))
    return found[-1] if found else None
