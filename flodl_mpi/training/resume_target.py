"""Whether ``--resume`` has a run to continue, decided before anything in the run dir is touched.

Invariant: a plain ``--resume`` (``resume = true``, ``resume=True``) never starts a run. A run
dir that does not exist, or whose ``checkpoints/`` holds no checkpoint file, is refused with one
line (bad input, exit status 2) and nothing in it is created or changed: the CLI asks before MPI
and torch start, and every entry point (the CLI, ``fit``, the ``Averager``) asks again before it
locks, creates or writes the run dir (`flodl_mpi.training.train._make_run_dir`). ``--resume auto``
(``resume = "auto"``, ``resume="auto"``) is a requeued job's form: it continues a run that holds
a checkpoint and starts one that holds none, saying so in one line (`new_run_line`).

Whether a checkpoint file reads back is not decided here (that reads every dataset): the resume's
survey (`flodl_mpi.training.train._find_resume`) refuses a plain ``--resume`` whose checkpoints are all
damaged. Pure: ``os`` and ``pathlib`` only, no MPI, no torch, no h5py.
"""

from __future__ import annotations

import os
from pathlib import Path

from flodl_mpi.config import RESUME_AUTO
from flodl_mpi.outputs.run_dir_lock import LOCK_NAME, in_use

__all__ = ["AUTO_REMEDY", "early_refusal", "has_checkpoint_file", "new_run_line", "resume_refusal"]

#: The end of every refusal of a plain ``--resume`` that has nothing to continue.
AUTO_REMEDY = f"use --resume {RESUME_AUTO} to start the run when it has none (a requeued job's first start)"


def has_checkpoint_file(run_dir: str | os.PathLike) -> bool:
    """Whether ``run_dir/checkpoints`` holds a file under a checkpoint's name (``*.h5``; not a
    ``*.tmp-<pid>`` write in progress, not a ``*.damaged`` one set aside). Reads the directory only."""
    folder = Path(run_dir) / "checkpoints"
    try:
        return any(p.name.endswith(".h5") for p in folder.iterdir())
    except OSError:  # absent, or not a directory
        return False


def resume_refusal(run_dir: str | None, resume: bool | str) -> str | None:
    """Why ``resume`` cannot go on in ``run_dir`` (one line in the CLI's words), or None.

    Args:
        run_dir: ``--run-dir`` as the user spelled it (None: not given; the config refuses that).
        resume: the config's ``resume``: False, True (strict) or ``"auto"``.

    Returns:
        None without a resume, for a path that is not a directory (the run dir's own check
        says so), and when there is something to continue; else the refusal: with ``resume``
        True, a run dir that does not exist or has no checkpoint file; with either form, a
        non-empty directory that holds no flodl-mpi run (no ``config.json``).
    """
    if not resume or run_dir is None:
        return None
    path = Path(run_dir)
    if not path.exists():
        if resume is True:
            return (f"--resume: --run-dir {run_dir!r} does not exist, so there is no run to continue; "
                    f"check the path, or {AUTO_REMEDY}")
        return None
    if not path.is_dir():
        return None
    try:
        names = [p.name for p in path.iterdir() if p.name != LOCK_NAME]
    except OSError as exc:
        return f"--resume: --run-dir {run_dir!r}: cannot read it: {exc.strerror or exc}"
    if names and "config.json" not in names:
        return f"--resume: {run_dir!r} is not empty but holds no flodl-mpi run (no config.json); nothing in it was touched"
    if resume is True and not has_checkpoint_file(path):
        return (f"--resume: --run-dir {run_dir!r} holds no checkpoint (nothing in its checkpoints/), so there is "
                f"nothing to continue and nothing in it was touched; check the path, or {AUTO_REMEDY}")
    return None


def early_refusal(run_dir: str | None, resume: bool | str) -> str | None:
    """`resume_refusal` asked before the run dir's lock is taken (the CLI before MPI starts, ``fit``
    before its data and model): None for a run dir another run holds, whose claim refuses it with
    its own line (`flodl_mpi.outputs.run_dir_lock`), not this one's guess from a run in progress."""
    refusal = resume_refusal(run_dir, resume)
    if refusal is None or in_use(run_dir):
        return None
    return refusal


def new_run_line(run_dir: str | os.PathLike) -> str:
    """What ``--resume auto`` says when it finds no checkpoint: the run starts from epoch 1."""
    return f"no checkpoint in {run_dir}: starting a new run"
