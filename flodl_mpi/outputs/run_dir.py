"""The run directory: rank 0 claims it (new, empty, or a run's own to resume) and holds its lock.

Invariant: nothing in a run directory is created, cleaned up or written before
rank 0 holds its lock (`flodl_mpi.outputs.run_dir_lock`); every rank learns the
outcome from one agreed result, so a refusal is the same line on every rank.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

from flodl_mpi.config import TrainConfig
from flodl_mpi.outputs import run_dir_lock
from flodl_mpi.runtime.world import Watchdog, agree
from flodl_mpi.training.resume_target import resume_refusal

__all__ = ["make_run_dir"]


def make_run_dir(cfg: TrainConfig, comm, watchdog: Watchdog) -> Path:
    """Rank 0 claims the run directory: a new or empty one, or with ``--resume`` a run's own.

    A plain ``--resume`` (``cfg.resume`` True) on a run dir that does not exist or holds
    no checkpoint is refused here, before anything is created, locked or written
    (`flodl_mpi.training.resume_target.resume_refusal`); ``--resume auto`` then starts the run.

    The default ``runs/<UTC time>`` is claimed with an exclusive ``mkdir`` (a
    suffix ``-1``, ``-2``, ... when several jobs start in the same second).
    Rank 0 then holds the directory's lock (`flodl_mpi.outputs.run_dir_lock`) for the
    rest of the run, taken before anything in it is cleaned up or written: a
    second run on the same directory is refused (``InputError``, exit status 2)
    and touches nothing of the first. Every rank learns the outcome from
    `agree`'s gathered result.
    """

    def create() -> str | None:
        if comm.rank != 0:
            return None
        if cfg.run_dir is not None:
            run_dir = Path(cfg.run_dir)
            if run_dir.exists() and not run_dir.is_dir():
                raise ValueError(f"--run-dir {cfg.run_dir!r}: exists and is not a directory")
            claimed = run_dir.is_dir() and (run_dir / run_dir_lock.LOCK_NAME).exists()
            if claimed:  # a run used it: another one still may; nothing is looked at before the lock is held
                run_dir_lock.claim(run_dir, cfg.run_dir)
            if not cfg.resume and run_dir.is_dir() and any(p.name != run_dir_lock.LOCK_NAME
                                                           for p in run_dir.iterdir()):
                if (run_dir / "config.json").is_file():
                    raise ValueError(f"--run-dir {cfg.run_dir!r} holds a flodl-mpi run: add --resume to continue "
                                     "it, or choose a new or empty directory (nothing in it was touched)")
                raise ValueError(f"--run-dir {cfg.run_dir!r} is not empty (it may hold another run); "
                                 "choose a new or empty directory so nothing saved is overwritten")
            refusal = resume_refusal(cfg.run_dir, cfg.resume)  # a plain --resume with nothing to continue
            if refusal is not None:  # decided before the run dir is created, locked or written
                raise ValueError(refusal)
            try:
                run_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:  # under a file, no permission, a read-only file system: one line
                raise ValueError(f"--run-dir {cfg.run_dir!r}: cannot create it: {exc.strerror or exc}"
                                 + (f" ({exc.filename})" if exc.filename and str(exc.filename) != cfg.run_dir
                                    else "")) from exc
            if not claimed:
                run_dir_lock.claim(run_dir, cfg.run_dir)
        else:
            base = time.strftime("runs/%Y%m%d-%H%M%S", time.gmtime())
            for k in itertools.count():
                run_dir = Path(base if k == 0 else f"{base}-{k}")
                try:
                    run_dir.mkdir(parents=True)
                    break
                except FileExistsError:
                    continue
            run_dir_lock.claim(run_dir)
        (run_dir / "checkpoints").mkdir(exist_ok=cfg.resume)
        return str(run_dir)

    return Path(comm.bcast(agree(comm, "run dir", create, watchdog, name_ranks=False), root=0))

