"""The Averager's checkpoints: what a save holds (each rank's state, the cohort's), the save check, and
how a resume takes a checkpoint back, an epoch cut short included.

Invariant: a save is collective (every rank's state gathered to rank 0, whose writer thread
writes); what it holds is built in one place (`contents_of`, the CLI trainer's twin is
`flodl_mpi.training.trainer_checkpoint.contents_of`). These functions are parts of
`flodl_mpi.api.averager.Averager` kept in their own module: they read and set its own
(underscored) counters. MPI-touching imports stay inside them (MPI starts in the Averager's setup).
"""

from __future__ import annotations

import math
import time

import torch

__all__ = ["check_saveable", "cohort_state", "contents_of", "continue_epoch", "epoch_progress", "resume", "save",
           "saver", "say_resumed", "this_rank_state"]


def resume(avg, ckpt) -> float:
    """This rank's state from the checkpoint (the consensus is loaded already): the one per-rank
    restore (`flodl_mpi.training.resume_state`, the CLI's too), then where the loop was.

    A checkpoint of an epoch cut short (a stop, or :meth:`close` after more
    steps) also gives back where the epoch was (:func:`continue_epoch`).
    Returns the ms the cut-short epoch had run (0.0: none).
    """
    from flodl_mpi.training import resume_state

    avg.global_step = resume_state.restore_rank(ckpt, avg.rank, avg.world_size, avg.optimizer,
                                                avg.model).global_step
    resume_state.restore_bridge(ckpt, avg.bridge)  # round, policy (or guard), clock
    avg._wire_resumed = resume_state.restore_wire(ckpt, avg.bridge, avg.rank, avg.world_size)
    avg._saved_version = ckpt.round
    avg.epoch = ckpt.epoch
    if ckpt.epoch_complete:
        avg._tests = (ckpt.test_accuracy, ckpt.test_loss, ckpt.test_count)
    avg._metrics_rows = {k: int(ckpt.metrics_rows.get(k, 0)) for k in avg._metrics_rows}
    progress = ckpt.epoch_progress
    if ckpt.epoch_complete or not isinstance(progress, dict):
        return 0.0  # a complete epoch, or written before the own loop kept its place: the epoch restarts
    return continue_epoch(avg, progress, ckpt.world_size)


def continue_epoch(avg, progress: dict, old_size: int) -> float:
    """The cut-short epoch's counts so far, so that its rows read as if never interrupted.

    ``progress`` (a checkpoint's ``epoch_progress``): ``step``, the step() calls
    every rank made in the epoch, and ``ranks``, per old rank, its report so
    far (``loss_sum``, ``batches``, ``nonfinite_batches``, ``samples``, -1 for
    not recorded, ``compute_ms``, ``epoch_ms``) and its ``record_scalar``
    book (``scalars``: ``{name: [sum, count]}``, ``intents``). Another world
    size: rank r carries the sum of old ranks ``r' ≡ r (mod W)``, as
    ``worker.Trainer.resume``. Returns the epoch's ms so far (this rank's).
    """
    avg._epoch_calls = int(progress["step"])
    epoch_ms = 0.0
    for old, part in enumerate(progress["ranks"]):
        if old % avg.world_size != avg.rank:
            continue
        avg._loss_sum += float(part["loss_sum"])
        avg._batches += int(part["batches"])
        avg._nonfinite += int(part["nonfinite_batches"])
        avg._samples_known = avg._samples_known and int(part["samples"]) >= 0
        avg._samples += max(int(part["samples"]), 0)
        avg._compute_ms += float(part["compute_ms"])
        epoch_ms = max(epoch_ms, float(part["epoch_ms"]))
        avg._book.restore({k: (s, c) for k, (s, c) in part["scalars"].items()}, part["intents"])
    return epoch_ms


def epoch_progress(avg) -> dict:
    """This rank's part of a cut-short epoch's ``epoch_progress`` (see :func:`continue_epoch`)."""
    sums, intents = avg._book.drain()
    avg._book.restore(sums, intents)  # read, not taken: the book goes on as it was
    return {"loss_sum": avg._loss_sum, "batches": avg._batches, "nonfinite_batches": avg._nonfinite,
            "samples": avg._samples if avg._samples_known else -1, "compute_ms": avg._compute_ms,
            "epoch_ms": 1e3 * (time.perf_counter() - avg._t_epoch),
            "scalars": {k: [s, c] for k, (s, c) in sums.items()}, "intents": list(intents)}


def say_resumed(avg, ckpt) -> None:
    """Rank 0: the resume line (train.log and stderr): where the loop goes on, and what is not exact."""
    old_size = ckpt.world_size
    where = (f"epoch {avg.start_epoch + 1} from step() call {avg.start_step + 1}" if avg.start_step else
             f"epoch {avg.start_epoch + 1}")
    line = (f"resuming from {ckpt.path.name}: {avg.start_epoch} epoch(s) done, {avg.start_step} step() "
            f"call(s) into the next, round {avg.bridge.version}; go on at {where} (avg.start_epoch "
            f"{avg.start_epoch}, avg.start_step {avg.start_step}; avg.batches() skips them)")
    if not ckpt.epoch_complete and not isinstance(ckpt.epoch_progress, dict):
        line += ("; the checkpoint (an older flodl-mpi's) does not say how far its epoch went: the epoch "
                 "restarts at its first step, its first batches trained twice")
    if old_size != avg.world_size:
        line += (f"; world size {old_size} -> {avg.world_size}: rank r took the optimizer state, step count "
                 f"and integer buffers of old rank r mod {old_size}, its RNG not restored: the run is not the "
                 "uninterrupted one")
    avg._say(line)
    if avg._wire_resumed:  # a delta wire: what of its state came back (the CLI's line)
        avg._say(avg._wire_resumed)


def this_rank_state(avg) -> tuple[dict, dict]:
    """This rank's state for a checkpoint: its optimizer's (`flodl_mpi.training.rank_state.capture`), or without
    one its RNG, integer buffers and step count; with a delta wire, its error feedback."""
    from flodl_mpi.training import rank_state

    if avg.optimizer is not None:
        arrays, attrs = rank_state.capture(avg.optimizer, avg.global_step, avg.model)
    else:
        ints = {f"int_buffers/{k}": v for k, v in rank_state.integer_buffers(avg.model).items()}
        arrays, attrs = ({"rng/torch": torch.get_rng_state().numpy().copy(), **ints},
                         {"global_step": int(avg.global_step)})
    wire = avg.bridge.wire_state(cohort=False)
    if wire is not None:  # the delta wire's error feedback: this rank's own (its reference is the cohort's)
        arrays.update(wire[2])
    return arrays, attrs


def cohort_state(avg, sized: bool = False):
    """The delta wire's reference (``/cohort``, the same on every rank), None on the other wires; ``sized``:
    with a zero array of the reference's shape and dtype per plane, for the save check before round 1."""
    wire = avg.bridge.wire_state(mine=False)
    if wire is None:
        return None
    arrays, attrs = wire[0], wire[1]
    if sized:  # the reference the first round makes: in every later save
        mine = avg.bridge.wire_state(cohort=False)[2]
        arrays = {**{f"wire_reference_{k.rsplit('/', 1)[1]}": e for k, e in mine.items()}, **arrays}
    return arrays, attrs


def contents_of(avg, summary, reason: str, ranks: list, complete: bool = True,
                progress: list | None = None, sized: bool = False):
    """The checkpoint of this run now (`flodl_mpi.outputs.checkpoint_contents.CheckpointContents`), from
    every rank's ``(arrays, attrs)``; ``progress``: every rank's part of a cut-short epoch; ``sized``: the
    save check's (`cohort_state`)."""
    from flodl_mpi.outputs.checkpoint_contents import CheckpointContents
    from flodl_mpi.training.model_record import model_record
    from flodl_mpi.training.replica import state_arrays

    params, buffers, order = state_arrays(avg.model)
    if summary is not None:
        tests = (summary.test_accuracy, summary.test_loss, summary.test_count)
    else:
        tests = avg._tests if complete else (math.nan, math.nan, 0)
    # Named as the CLI's: the epoch saved (the one cut short, when not complete); "epoch" counts those done.
    return CheckpointContents(
        params=params, buffers=buffers, order=order,
        epoch=avg.epoch, epoch_complete=complete, cursor=0, round=avg.bridge.version,
        global_step=avg.global_step, reason=reason, world_size=avg.world_size,
        elapsed_s=avg.bridge.elapsed, config=avg.cfg.to_dict(), guard=avg.bridge.guard.state_dict(),
        policy=avg.bridge.policy.state_dict(),  # as the CLI's: a resume restores it (the guard's within)
        # The epoch's test figures (a checkpoint of an epoch cut short: none measured)
        test_accuracy=tests[0], test_loss=tests[1], test_count=int(tests[2]),
        api="Averager", time_unix=time.time(),
        model=model_record(avg.model),  # what a resume compares its model with
        # A round's row is written when its acks ride the next gather: the last one is
        # still pending when no epoch exchange came after it.
        metrics_rows={"rounds": avg.bridge.version - int(avg._round_pending), **avg._metrics_rows},
        # where the cut-short epoch was: a resume goes on from there
        epoch_progress={"step": avg._epoch_calls, "ranks": progress} if not complete and progress is not None
        else None,
        ranks=dict(enumerate(ranks)),
        cohort=cohort_state(avg, sized=sized),
    )


def check_saveable(avg) -> None:
    """The save check (rank 0; `flodl_mpi.outputs.checkpoint_room.check_saveable`, the CLI's too) with a
    checkpoint of the initial state; room for one checkpoint (how many an own loop saves is not known)."""
    state = this_rank_state(avg)
    saver(avg).check(avg.run_dir / "checkpoints",
                     lambda: contents_of(avg, None, "checkpoint", [state] * avg.world_size, sized=True),
                     avg.optimizer, avg.cfg.keep_checkpoints, saves=1)


def save(avg, summary, reason: str, complete: bool = True) -> str | None:
    """Collective: every rank's state is gathered to rank 0, whose writer thread saves."""
    gathered = avg.bridge.gather_to_root((this_rank_state(avg), None if complete else epoch_progress(avg)))
    avg._saved_version = avg.bridge.version
    path = saver(avg).save(lambda: contents_of(avg, summary, reason, [state for state, _ in gathered], complete,
                                               None if complete else [part for _, part in gathered]))
    return None if path is None else str(path)


def saver(avg):
    """Rank 0's checkpoint duty over its writer (`flodl_mpi.outputs.saver`); a NoSaver elsewhere."""
    from flodl_mpi.outputs.saver import saver_for

    return saver_for(avg.rank, avg._writer)
