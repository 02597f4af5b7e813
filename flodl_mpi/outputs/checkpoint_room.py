"""Room for a run's checkpoints: estimated before training, so a disk too small refuses the run, not its epoch 5.

Invariant: a run starts only when ``checkpoints/`` has room for every checkpoint
it will hold at once: the newest ``--keep-checkpoints`` (as many as it will have
written by then) plus the one being written beside them (a save writes a temporary
file, renames it, and only then prunes the oldest). One checkpoint's size is
measured, not guessed: the save check writes a real checkpoint of the initial
state; the optimizer state, which most optimizers create at their first step, is
predicted from a step of the same optimizer on tensors without storage (PyTorch's
``meta`` device) and added for every rank.

A quota and a file size limit are not seen by ``statvfs``: those are caught when
written, with the same one line (`flodl_mpi.outputs.metrics.disk_error_line`).
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from flodl_mpi.outputs.checkpoint import list_checkpoints
from flodl_mpi.outputs.h5sink import free_bytes, size_words

if TYPE_CHECKING:
    from flodl_mpi.outputs.checkpoint_contents import CheckpointContents


__all__ = ["check_saveable", "save_check", "optimizer_state_bytes", "saves_ahead", "Room", "room_needed", "refusal", "check_before_training"]


def save_check(directory: str | Path, write: Callable[[Path], object]) -> int:
    """Write a checkpoint with ``write(path)`` to a temporary file in ``directory``, remove it, return its size.

    Args:
        write: writes one checkpoint at the path given (`flodl_mpi.outputs.checkpoint.write_checkpoint`).

    Raises:
        ValueError: the state cannot be stored (``the model's state cannot be saved ...``),
            or the disk refused it (a full disk, a quota, the file size limit: its
            words and what to do). Either way one line, and nothing is left behind.
        OSError: any other failure to write there (permissions).
    """
    from flodl_mpi.outputs.metrics import DISK_REMEDY, disk_error  # (metrics imports this module's neighbours)

    directory = Path(directory)
    # write_checkpoint writes "save-check.tmp-PID" (a temp, removed as stale under the run dir's
    # lock), then renames it to "save-check", removed at once: no .h5, so never listed as a
    # checkpoint even when a kill lands between the two.
    path = directory / "save-check"
    try:
        write(path)
        return path.stat().st_size
    except (ValueError, TypeError) as exc:
        raise ValueError(f"the model's state cannot be saved in a checkpoint: {exc}") from None
    except OSError as exc:
        disk = disk_error(exc)
        if disk is None:
            raise
        raise ValueError(f"{directory}: {disk.strerror}: the save check could not write a checkpoint there; "
                         f"{DISK_REMEDY[disk.errno]} (nothing was trained)") from None
    finally:
        path.unlink(missing_ok=True)


def _state_bytes(state: dict) -> int:
    return sum(v.numel() * v.element_size() for s in state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``optimizer``'s state once every parameter has taken a step.

    State the optimizer holds now (a resumed run's, Adagrad's from construction)
    counts as it is. For a parameter without state, one step of a copy of the
    optimizer (its class, its param groups' hyperparameters) on storage-less
    ``meta`` tensors with zero gradients tells which tensors the step creates, and
    their shapes and dtypes; nothing is allocated, the optimizer is not touched.
    An optimizer whose step cannot run on ``meta`` tensors counts only the state it
    holds now (a lower bound: a refusal is then never wrong, only later).

    Returns:
        Bytes, as `flodl_mpi.training.rank_state.capture` saves them (dtypes kept).
    """
    held = _state_bytes(optimizer.state)
    missing = [(g, p) for g in optimizer.param_groups for p in g["params"] if p not in optimizer.state]
    if not missing:
        return held
    try:
        shadow_groups = []
        for group in optimizer.param_groups:
            params = []
            for p in group["params"]:
                if p in optimizer.state:
                    continue
                q = torch.empty_like(p, device="meta").requires_grad_(p.requires_grad)
                q.grad = torch.zeros_like(q)
                params.append(q)
            if params:
                # Flags that bind the step to a device kind (fused, capturable, foreach) are
                # dropped: the state's tensors are the same either way.
                shadow_groups.append({**{k: v for k, v in group.items() if k not in ("params", "fused",
                                                                                     "capturable", "foreach")},
                                      "params": params})
        shadow = type(optimizer)(shadow_groups)
        with torch.no_grad():
            shadow.step()
        return held + _state_bytes(shadow.state)
    except Exception:  # noqa: BLE001 - a user's optimizer class: a lower bound is still an answer
        return held


def saves_ahead(epochs: int, start_epoch: int, checkpoint_every: int) -> int:
    """Checkpoints a run writes from ``start_epoch`` (epochs done) to ``epochs``: every
    ``checkpoint_every`` epochs (0: none) and after the last. A stop adds one; not counted."""
    every = {e for e in range(start_epoch, epochs) if checkpoint_every and (e + 1) % checkpoint_every == 0}
    if start_epoch < epochs:
        every.add(epochs - 1)
    return len(every)


@dataclass(frozen=True)
class Room:
    """What a run needs in ``checkpoints/`` (bytes), and what it has.

    Attributes:
        one: one checkpoint of this run (estimated).
        count: checkpoints this run adds beside those present at its peak (>= 1 when it saves).
        free: bytes free there now.
        keep_fit: the largest ``--keep-checkpoints`` that fits (0: not even one checkpoint).
    """

    one: int
    count: int
    free: int
    keep_fit: int

    @property
    def need(self) -> int:
        return self.one * self.count

    @property
    def fits(self) -> bool:
        return self.free >= self.need


def room_needed(one: int, free: int, present: int, keep: int, saves: int) -> Room:
    """Bytes a run needs at its peak, beyond what ``present`` checkpoints take already.

    The peak comes when the run has ``min(keep, present + saves - 1)`` complete
    checkpoints (never fewer than ``present``, which stay until the first save
    prunes them) and writes the next beside them:
    ``count = max(present, min(keep, present + saves - 1)) + 1 - present``.

    Args:
        one: bytes of one checkpoint.
        free: bytes free in ``checkpoints/``.
        present: complete checkpoints there now (a resume's).
        keep: ``--keep-checkpoints``, >= 1.
        saves: checkpoints the run will write (`saves_ahead`); 0: needs nothing.
    """
    if saves <= 0 or one <= 0:
        return Room(one, 0, free, keep)
    count = max(present, min(keep, present + saves - 1)) + 1 - present
    fit = free // one  # checkpoints that fit beside the present ones
    keep_fit = 0 if fit < 1 else max(1, present + fit - 1)
    return Room(one, count, free, keep_fit)


def refusal(room: Room, directory, keep: int) -> str | None:
    """The one line refusing a run without room (None when it fits): needed against free, the dir, what to do.

    The flags are the CLI's; the Python API shows its keywords (`flodl_mpi.runtime.session.api_words`).
    """
    if room.fits:
        return None
    many = room.count > 1
    what = (f"{room.count} checkpoint{'s' if many else ''} of about {size_words(room.one)}"
            + (f": --keep-checkpoints {keep} kept, and the next written beside them before the oldest is deleted"
               if many else ""))
    remedy = (f"lower --keep-checkpoints to {room.keep_fit}" if many and room.keep_fit >= 1
              else "choose a run dir on a larger file system")
    return (f"{directory} has {size_words(room.free)} free, this run needs about {size_words(room.need)} there "
            f"({what}); free space there or {remedy} (nothing was trained)")


def check_before_training(directory: str | Path, check_bytes: int, optimizer: torch.optim.Optimizer | None,
                          captured: dict, world_size: int, keep: int, saves: int) -> None:
    """Refuse a run whose checkpoints will not fit (rank 0, after the save check; collective through ``agree``).

    One checkpoint is the save check's file (``check_bytes``) plus, for each of the
    ``world_size`` ranks, the optimizer state a step creates beyond what the check
    held (`optimizer_state_bytes` minus the ``optimizer/`` arrays of ``captured``,
    `flodl_mpi.training.rank_state.capture`'s). It must be under the file size limit
    (``RLIMIT_FSIZE``), and the run's peak (`room_needed`) within the free space.

    Args:
        directory: the run's ``checkpoints/``.
        saves: checkpoints the run will write (`saves_ahead`; the own loop's: 1).

    Raises:
        ValueError: one line: what one checkpoint or the run needs, the limit or the
            free space, and what to do (`refusal`).
    """
    directory = Path(directory)
    extra = 0
    if optimizer is not None:
        extra = max(0, optimizer_state_bytes(optimizer) - sum(
            a.nbytes for k, a in captured.items() if k.startswith("optimizer/")))
    one = check_bytes + world_size * extra
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and one > limit:
        raise ValueError(f"{directory}: a checkpoint of this run needs about {size_words(one)}, above the file "
                         f"size limit of this job ({size_words(limit)}: ulimit -f); raise the limit "
                         "(nothing was trained)")
    free = free_bytes(directory)
    if free is None:  # the file system does not say
        return
    refused = refusal(room_needed(one, free, len(list_checkpoints(directory)), keep, saves), directory, keep)
    if refused is not None:
        raise ValueError(refused)


def check_saveable(directory: str | Path, contents: CheckpointContents, optimizer: torch.optim.Optimizer | None,
                   keep: int, saves: int) -> None:
    """The save check (rank 0): what would fail at save time fails now, before any training.

    ``contents`` (a checkpoint of the initial state, every rank's state as rank 0's) is
    written to a temporary file and removed (`save_check`), so every name, dtype and meta
    value the real saves will hold goes through the writer once; then the run's
    checkpoints must fit (`check_before_training`: one checkpoint's size, the optimizer
    state a first step creates added for every rank, ``keep`` kept and the next beside them).
    The CLI's, ``fit``'s and the ``Averager``'s one save check.

    Args:
        directory: the run's ``checkpoints/`` (exists).
        optimizer: the rank's optimizer (None: an own loop without one).
        keep: ``--keep-checkpoints``.
        saves: the checkpoints the run will write (`saves_ahead`; an own loop's: 1).

    Raises:
        ValueError: the state cannot be saved, or the checkpoints do not fit; one line
            naming why, what is needed and what to do.
        OSError: the directory is not writable.
    """
    size = save_check(directory, contents.write)
    check_before_training(directory, size, optimizer, contents.ranks[0][0], len(contents.ranks), keep, saves)
