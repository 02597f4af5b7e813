"""What ``flodl-mpi train`` can check of its input before MPI and torch start (issue 26 item 9).

Invariant: reads only (nothing is created), imports neither ``mpi4py.MPI`` nor torch
(nor the user's model code), and every message is the one the ranks give later for
the same mistake, so a refusal here is the same line, only 8-20 s sooner. What
needs the data's values, the model's code or the world (labels, NaN rows, the
model's output, the run dir's lock) is still checked after MPI starts.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from flodl_mpi.training.model_spec import model_spec_problem

__all__ = ["input_problem", "model_spec_problem", "one_host", "run_dir_problem"]

#: Variables in which a launcher says how many of its processes run on this host
#: (MPICH's Hydra, Open MPI), or how many hosts the job step spans (Slurm).
LOCAL_SIZE_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")
NODE_COUNT_VARS = ("SLURM_STEP_NUM_NODES",)


def run_dir_problem(run_dir: str | None) -> str | None:
    """Why ``--run-dir`` cannot be made or written, told from the file system without writing, or None.

    A file where the directory should be, a file among its parents, a parent that is not
    writable. A directory in use or not empty is the ranks' to say (they hold its lock).
    """
    if run_dir is None:
        return None
    path = Path(run_dir)
    if path.exists() and not path.is_dir():
        return f"--run-dir {run_dir!r}: exists and is not a directory"
    if path.is_dir():
        if not os.access(path, os.W_OK | os.X_OK):
            return f"--run-dir {run_dir!r}: not writable: {os.strerror(errno.EACCES)}"
        return None
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"--run-dir {run_dir!r}: cannot create it: {os.strerror(errno.ENOTDIR)} ({parent})"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"--run-dir {run_dir!r}: cannot create it: {os.strerror(errno.EACCES)} ({parent})"
    return None


def one_host(environ=None) -> bool:
    """Whether every process of the launch runs on this host, as the launcher's variables say.

    True without a launcher (a world of 1); False when they do not say. Why it matters: a
    refusal before MPI starts is each rank's own decision (nothing can be gathered yet), so it
    may only rest on what every rank sees alike; ranks on other hosts may see another file
    system (node-local data), and one rank refusing alone would leave the others in MPI's
    start-up until its timeout.
    """
    from flodl_mpi.runtime.launcher import launch_env

    env = os.environ if environ is None else environ
    launch = launch_env(env)
    if launch.launcher is None:
        return True
    for name in LOCAL_SIZE_VARS:
        if env.get(name, "").strip().isdigit():
            return int(env[name]) == launch.size
    return any(env.get(name, "").strip() == "1" for name in NODE_COUNT_VARS)


def input_problem(cfg, environ=None) -> str | None:
    """The first problem of ``cfg``'s ``--data``, dataset names, ``--model`` and ``--run-dir`` found
    without MPI and torch, or None. ``cfg``: a validated ``TrainConfig``.

    ``--data`` is opened read-only with h5py (its metadata: `flodl_mpi.training.data.check_layout`).
    What depends on the file system (all but the ``--model`` spec's form) is checked only when
    every rank runs on this host (`one_host`); on several hosts the ranks check it together
    once MPI is up.
    """
    if not one_host(environ):
        return model_spec_problem(cfg.model, look=False)
    if cfg.data is not None:
        from flodl_mpi.training.data import DEFAULT_NAMES, DataError, check_layout

        try:
            check_layout(cfg.data, {k: getattr(cfg, k) for k in DEFAULT_NAMES})
        except DataError as exc:
            return str(exc)
    return model_spec_problem(cfg.model) or run_dir_problem(cfg.run_dir)
