"""The trainer's checkpoints: what a save holds, each rank's part of it, and the save check at setup.

Invariant: every rank enters a save's state gather (`save`) at the same point, and what the
checkpoint holds is built in one place, `contents_of` (the CLI's and ``fit``'s trainer,
`flodl_mpi.training.worker.Trainer`; the Averager builds its own: ``api/averager.py``), as
`flodl_mpi.outputs.checkpoint_contents.CheckpointContents`.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from flodl_mpi.outputs import checkpoint_room
from flodl_mpi.outputs.checkpoint_contents import CheckpointContents
from flodl_mpi.protocol.epoch_report import EPOCH_FIELDS, EpochReport, EpochSummary, aggregate_epoch
from flodl_mpi.training import rank_state
from flodl_mpi.training.data import num_batches
from flodl_mpi.training.model_record import model_record
from flodl_mpi.training.replica import state_arrays
from flodl_mpi.training.resplit import BatchQueue

__all__ = ["check_saveable", "cohort_state", "contents_of", "queue_meta", "save", "this_rank_state"]


def save(trainer, s: EpochSummary, reason: str, cursor: int = 0, report: EpochReport | None = None) -> None:
    """Save a checkpoint: collective (each rank's state is gathered), rank 0 writes.

    ``epoch`` in the meta counts completed epochs and ``cursor`` the global
    batches of the next one already trained (non-zero after a stop mid-epoch),
    which is where a resumed run goes on; ``epoch_reports`` then holds every
    rank's report of that epoch so far.
    """
    arrays, attrs = this_rank_state(trainer)
    ranks = trainer.bridge.gather_to_root((arrays, attrs, dataclasses.asdict(report) if cursor else None))
    trainer.saver.save(lambda: contents_of(trainer, s, reason, cursor, ranks))  # rank 0 (the others gathered no state)


def this_rank_state(trainer) -> tuple[dict, dict]:
    """This rank's state for a checkpoint (`flodl_mpi.training.rank_state.capture`), with fp16's
    GradScaler state (``grad_scaler``: its scale and growth tracker) so a resume scales alike."""
    arrays, attrs = rank_state.capture(trainer.optimizer, trainer.global_step, trainer.replica.model)
    if trainer.scaler is not None:
        attrs["grad_scaler"] = trainer.scaler.state_dict()
    wire = trainer.bridge.wire_state(cohort=False)
    if wire is not None:  # the delta wire's error feedback: this rank's own (its reference is the cohort's)
        arrays.update(wire[2])
    return arrays, attrs


def check_saveable(trainer, directory, start_epoch: int = 0) -> None:
    """The save check (`flodl_mpi.outputs.checkpoint_room.check_saveable`, rank 0) with a checkpoint
    of the initial state: what would fail at save time fails at setup, before any epoch is trained.

    Every name, dtype and meta value the real saves will hold goes through the
    writer once (a mid-epoch save's too: the trial holds an epoch report per rank).
    One checkpoint is the trial's size plus the optimizer state the first step
    creates for every rank; the run's peak (``--keep-checkpoints`` kept, the next
    written beside them, for the saves ahead of ``start_epoch``) must fit in the
    free space, and one checkpoint under the file size limit (``ulimit -f``).
    Collective through ``agree``, not the bridge.

    Args:
        directory: the run's ``checkpoints/`` (exists).
        start_epoch: epochs done already (a resume's), for the saves ahead.

    Raises:
        ValueError: the state cannot be saved, or the checkpoints do not fit; one
            line naming why, what is needed and what to do.
        OSError: the checkpoint directory is not writable.
    """
    arrays, attrs = this_rank_state(trainer)

    def trial() -> CheckpointContents:
        s = aggregate_epoch(np.zeros((trainer.world_size, len(EPOCH_FIELDS))), -1, 0)
        contents = contents_of(trainer, s, "checkpoint", 1,
                               [(arrays, attrs, dataclasses.asdict(EpochReport()))] * trainer.world_size)
        wire = trainer.bridge.wire_state(cohort=False)
        if wire is not None:  # the delta wire's reference, which the first round makes: in every later save
            held, more = contents.cohort or ({}, wire[1])
            sized = {f"wire_reference_{k.rsplit('/', 1)[1]}": e for k, e in wire[2].items()}  # its shape, dtype
            contents.cohort = ({**held, **sized}, more)
        return contents

    cfg = trainer.cfg
    best = cfg.keep_best is not None  # one more file (checkpoints/best/), and a save at any epoch may be one
    trainer.saver.check(directory, trial, trainer.optimizer, cfg.keep_checkpoints + int(best),
                        checkpoint_room.saves_ahead(cfg.epochs, start_epoch, 1 if best else cfg.checkpoint_every))


def queue_meta(trainer, cursor: int) -> dict:
    """A mid-epoch checkpoint's ``batch_queue`` after a membership change: the batches not trained yet, in
    their queue's order (a resume plans over them; `BatchQueue.state_dict`); ``{}`` otherwise."""
    if not cursor or trainer.queue is None or trainer.queue.is_whole:
        return {}
    n_batches = num_batches(trainer.data.train.n, trainer.cfg.step_samples, trainer.cfg.drop_last)
    return {"batch_queue": BatchQueue(trainer.queue.batches[cursor - (n_batches - len(trainer.queue)):]).state_dict()}


def contents_of(trainer, s: EpochSummary, reason: str, cursor: int, ranks: list) -> CheckpointContents:
    """The checkpoint of this run now, from the gathered ``(arrays, attrs, epoch report or None)``
    of every rank; its cohort state what every rank holds alike (:func:`cohort_state`)."""
    params, buffers, order = state_arrays(trainer.replica.model)
    stopped = trainer.task.stopped_epoch_meta() if cursor else {}  # the API's scalar books of the epoch so far
    return CheckpointContents(
        params=params, buffers=buffers, order=order,
        epoch=s.epoch + 1 if cursor == 0 else s.epoch,
        epoch_complete=cursor == 0,
        cursor=cursor,
        batches_done=s.batches,
        # A stopped epoch's row is dropped on resume: the finished epoch gets one row.
        metrics_rows={"rounds": trainer.bridge.version, "epochs": trainer.epoch_rows - (1 if cursor else 0),
                      "batches": trainer.batch_rows},
        elapsed_s=trainer.bridge.elapsed,
        round=trainer.bridge.version,
        global_step=trainer.global_step,
        reason=reason,
        world_size=trainer.world_size,
        test_accuracy=s.test_accuracy,
        test_loss=s.test_loss,
        test_count=s.test_count,
        config=trainer.cfg.to_dict(),
        guard=trainer.bridge.guard.state_dict(),
        policy=trainer.bridge.policy.state_dict(),  # the balancer (anchor, speeds, latch) and the guard
        time_unix=time.time(),
        model=model_record(trainer.replica.model),  # what a resume compares its model with
        # stopped mid-epoch: the resumed run finishes this epoch's report
        epoch_reports=[report for _, _, report in ranks] if cursor else None,
        epoch_scalars=stopped.pop("epoch_scalars", None),
        epoch_intents=stopped.pop("epoch_intents", None),
        extra={**stopped, **(trainer.best.meta() if trainer.best is not None else {}), **queue_meta(trainer, cursor)},
        ranks={r: (arrays, attrs) for r, (arrays, attrs, _) in enumerate(ranks)},
        cohort=cohort_state(trainer),
    )


def cohort_state(trainer) -> tuple[dict, dict] | None:
    """What every rank holds alike, saved once (``/cohort``): the outer optimizer's state when it steps,
    and the delta wire's reference (`flodl_mpi.transport.bridge.Bridge.wire_state`); None when neither."""
    outer, wire = trainer.bridge.outer, trainer.bridge.wire_state(mine=False)
    arrays, attrs = outer.state_dict() if outer is not None and outer.kind != "avg" else ({}, {})
    if wire is not None:
        arrays, attrs = {**arrays, **wire[0]}, {**attrs, **wire[1]}
    return (arrays, attrs) if arrays or attrs else None
