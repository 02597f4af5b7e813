"""Rank 0's checkpoint duty as an object: the save check and the saves, for the CLI's Trainer and the Averager.

Invariant: only rank 0 of a run with a run dir holds a :class:`Saver`; every other rank (and a run
without files) holds a :class:`NoSaver`, whose methods do nothing and build nothing, so the callers
never check which rank they are on, as the bridge's
`flodl_mpi.outputs.recorder.Recorder` / ``NoRecorder``. The contents are given as a function
(``build``), called on rank 0 only: the other ranks hold no gathered state to build them from.
Nothing here enters a collective: the gather of every rank's state comes before, on every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable

from flodl_mpi.outputs import checkpoint_room

if TYPE_CHECKING:
    import torch

    from flodl_mpi.outputs.checkpoint_contents import CheckpointContents
    from flodl_mpi.outputs.metrics import MetricsWriter, NoMetricsWriter

__all__ = ["NoSaver", "Saver", "saver_for"]


class NoSaver:
    """The checkpoint duty of a rank that writes none (every rank but 0; any rank of a run without a run dir)."""

    def check(self, directory: str | Path, build: Callable[[], CheckpointContents],
              optimizer: torch.optim.Optimizer | None, keep: int, saves: int) -> None:
        """The save check (`flodl_mpi.outputs.checkpoint_room.check_saveable`): nothing to check here."""

    def save(self, build: Callable[[], CheckpointContents]) -> Path | None:
        """Queue a checkpoint: nothing here. Returns where it will be (None: not saved by this rank)."""
        return None


class Saver(NoSaver):
    """Rank 0's checkpoint duty over its metrics writer, whose thread writes the files.

    Args:
        writer: rank 0's `flodl_mpi.outputs.metrics.MetricsWriter` (saving needs its ``checkpoint_dir``).
    """

    def __init__(self, writer: MetricsWriter) -> None:
        self.writer = writer

    def check(self, directory, build, optimizer, keep: int, saves: int) -> None:
        """The save check in ``directory`` (the run's ``checkpoints/``) with ``build()``, a checkpoint of
        the initial state, before any training.

        Raises:
            ValueError, OSError: as `flodl_mpi.outputs.checkpoint_room.check_saveable`.
        """
        checkpoint_room.check_saveable(directory, build(), optimizer, keep, saves)

    def save(self, build) -> Path:
        """Queue ``build()`` for the writer thread (`MetricsWriter.save`); returns the file it will be.

        Raises:
            WriterError: the writer thread failed earlier.
        """
        contents = build()
        self.writer.save(contents)
        return Path(self.writer.checkpoint_dir) / contents.name


def saver_for(rank: int, writer: MetricsWriter | NoMetricsWriter | None) -> NoSaver:
    """Rank 0 with a metrics writer (`MetricsWriter.writes`) saves; every other rank holds a :class:`NoSaver`."""
    return Saver(writer) if rank == 0 and getattr(writer, "writes", False) else NoSaver()
