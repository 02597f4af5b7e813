"""Temporary files an earlier run left in its run dir: removed once this run holds the run dir's lock.

Invariant: while a process holds ``R/.lock`` (`flodl_mpi.outputs.run_dir_lock`), no other
run writes in ``R``, so every temporary file there that this process did not
create is stale: a write that was killed or failed (a checkpoint's
``checkpoints/*.tmp-<pid>``, the save check's, ``metrics.h5.resume-tmp``, ranks.json's
``.ranks.json.tmp-<pid>``). The
process id in a name says nothing once the lock is held: ids repeat across nodes,
containers and copies of a run dir. Such files can be as large as a checkpoint, so
each is removed and named, with its size, in one line.

Kept: ``metrics.h5.before-resume`` (history an older flodl-mpi's killed resume
left: `flodl_mpi.outputs.metrics.MetricsFile` restores it), ``*.damaged`` and
``metrics.h5.before-restart-*`` (kept for a look, on purpose).
"""

from __future__ import annotations

import os
from pathlib import Path

from flodl_mpi.outputs.checkpoint import TMP_RE as _TMP  # a temporary of write_checkpoint (and so of the save check)
from flodl_mpi.outputs.h5sink import size_words
from flodl_mpi.runtime.live_ranks import FILE_NAME as RANKS_FILE

__all__ = ["stale_temporaries", "remove_stale", "removal_line"]

#: The run dir's own temporaries, by name.
_RUN_DIR_TEMPS = ("metrics.h5.resume-tmp",)


def stale_temporaries(run_dir: str | os.PathLike) -> list[Path]:
    """The temporary files in ``run_dir`` and its ``checkpoints/``, sorted; reads only.

    Call it only while holding the run dir's lock: then none of them is being written.
    """
    run_dir = Path(run_dir)
    found = [run_dir / name for name in _RUN_DIR_TEMPS if (run_dir / name).is_file()]
    found += [p for p in run_dir.glob(f".{RANKS_FILE}.tmp-*") if p.is_file()]
    ckpts = run_dir / "checkpoints"
    if ckpts.is_dir():
        found += [p for p in ckpts.iterdir() if _TMP.search(p.name) and p.is_file()]
    return sorted(found)


def remove_stale(run_dir: str | os.PathLike) -> list[tuple[Path, int]]:
    """Remove `stale_temporaries` of ``run_dir``; returns ``[(path, bytes), ...]`` removed.

    Raises:
        OSError: a file could not be removed (permissions).
    """
    removed = []
    for path in stale_temporaries(run_dir):
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            continue
        removed.append((path, size))
    return removed


def removal_line(run_dir: str | os.PathLike, removed: list[tuple[Path, int]]) -> str | None:
    """The one line saying what `remove_stale` removed (None: nothing), paths relative to ``run_dir``."""
    if not removed:
        return None
    total = sum(size for _, size in removed)
    names = ", ".join(f"{p.relative_to(run_dir)} ({size_words(size)})" for p, size in removed)
    return (f"warning: removed {len(removed)} temporary file{'s' if len(removed) != 1 else ''} an earlier run left "
            f"unfinished (killed or failed while writing), {size_words(total)} in all: {names}")
