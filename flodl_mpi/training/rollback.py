"""Going back to a window's start after a peer died in its round (``--on-rank-failure shrink``; SPEC §9).

Invariant: every survivor returns to the state it shares with every other survivor, the
window's start (the last consensus), and the window's batches are trained again in the
shrunk world, so each batch is still trained once in the consensus. `mark` keeps that
state at each window's start; `shrink` takes the trainer (`flodl_mpi.training.worker.Trainer`)
back to it once `flodl_mpi.training.recovery` rebuilt the world.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from flodl_mpi.errors import RankFailure
from flodl_mpi.protocol.epoch_report import EpochReport
from flodl_mpi.training import recovery
from flodl_mpi.training.resplit import lost_positions

__all__ = ["Mark", "mark", "shrink"]


@dataclasses.dataclass
class Mark:
    """The state every rank shares at a window's start (the last consensus), kept for a shrink.

    ``--on-rank-failure shrink`` only: a copy of the model and the optimizer state per window.
    """

    rows: int            # batch records of the epoch so far
    report: EpochReport  # the epoch's report so far (a copy)
    global_step: int
    model: list          # the params then the floating buffers (clones)
    optimizer: dict      # the optimizer's state dict (a deep copy)


def mark(trainer, report: EpochReport, rows: list) -> Mark:
    """What a window starts from, kept to go back to when its round is abandoned (:func:`shrink`)."""
    with torch.no_grad():
        model = [t.detach().clone() for t in (*trainer.replica.params, *trainer.replica.float_buffers)]
    return Mark(len(rows), dataclasses.replace(report), trainer.global_step, model,
                copy.deepcopy(trainer.optimizer.state_dict()))


def shrink(trainer, failure: RankFailure, window, mark: Mark, rows: list) -> tuple[EpochReport, list]:
    """Go on without the ranks that died in this window's round (SPEC §9 "Shrink").

    ``trainer.elastic`` agrees the failed set with the other survivors and rebuilds the
    bridge on the shrunk world (`flodl_mpi.training.recovery`). The round is abandoned:
    every survivor returns to the state it shares with every other, the window's
    start (the last consensus: params, floating buffers; and its own optimizer state,
    step count and epoch report of then), and the window's batches, every rank's, go
    to the front of the epoch's new queue, then those not handed out yet
    (`BatchQueue.after_change`): each batch is still trained once in the consensus.
    The RNG (dropout) is not rewound.

    Returns:
        The epoch's report and batch records as they were at the window's start.
    """
    old_size = trainer.world_size
    done = trainer.elastic(trainer, failure, window)
    recovery.take_new_world(trainer, done)
    with torch.no_grad():
        for dst, src in zip((*trainer.replica.params, *trainer.replica.float_buffers), mark.model):
            dst.copy_(src)
    trainer.optimizer.load_state_dict(mark.optimizer)
    trainer.steps, trainer.global_step, trainer.loss_finite = 0, mark.global_step, True
    trainer.queue = trainer.queue.after_change(window.end, lost_positions([window], range(old_size)))
    done.finish(trainer, window)
    # this rank's records of the epoch before the window, under its new rank
    return dataclasses.replace(mark.report), [(trainer.rank, *row[1:]) for row in rows[:mark.rows]]
