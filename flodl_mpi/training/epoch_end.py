"""An epoch's end after its exchange: rank 0's epoch line, the outer optimizer's watch, the save it is due.

Invariant: whether an epoch's end saves is decided from the config and the gathered
summary only, so every rank joins the save's state gather, or none does.
"""

from __future__ import annotations

import math

from flodl_mpi.protocol.epoch_report import EpochReport, EpochSummary, excluded_words
from flodl_mpi.training.data import num_batches

__all__ = ["report_epoch"]


def report_epoch(trainer, s: EpochSummary, stopped: bool, cursor: int, report: EpochReport) -> None:
    """After the epoch's exchange: rank 0's epoch line, the outer optimizer's watch, and the save it is due.

    Collective when it saves (`flodl_mpi.training.trainer_checkpoint.save`): whether it
    saves is decided from the config and gathered values only (``s``, the same on every rank).

    Args:
        trainer: the rank's `flodl_mpi.training.worker.Trainer`.
        s: the epoch's summary, identical on every rank.
        stopped: a stop round ended the epoch.
        cursor: the epoch's global batches done.
        report: this rank's report of the epoch (a mid-epoch save holds it).
    """
    cfg = trainer.cfg
    last = s.epoch == cfg.epochs - 1
    trainer.writer.check()  # a disk error on rank 0 ends the job now, not at the end
    if trainer.writer.writes:  # rank 0's epoch line
        partial = ""
        if stopped:
            n_batches = num_batches(trainer.data.train.n, cfg.step_samples, cfg.drop_last)
            partial = (f" (stopped after {cursor} of {n_batches} batches)" if cursor < n_batches else
                       " (complete: the stop came with its last round)")
        # What was measured, no more: an epoch not evaluated has no test numbers, a regression no accuracy.
        tests = "".join(f"  {name} {value:.4f}" for name, value in
                        (("val_loss", s.val_loss), ("val_acc", s.val_accuracy), ("test_loss", s.test_loss),
                         ("test_acc", s.test_accuracy)) if math.isfinite(value))
        if trainer.best is not None and trainer.best.is_best:
            tests += f"  (best {trainer.best.metric}" + (", kept)" if trainer.best.keep else ")")
        trainer.log(f"epoch {s.epoch + 1}/{cfg.epochs}{partial}  loss {s.avg_loss:.4f}"
                    f"{excluded_words(s.nonfinite_batches)}{tests}"
                    f"{trainer.task.epoch_words()}  rounds {s.rounds}  {s.epoch_ms / 1e3:.1f} s")
        trainer.log_detail("  per rank: " + "; ".join(
            f"r{r} {s.per_rank_throughput[r]:.0f} samples/s, {s.per_rank_batches[r]} batches, "
            f"data wait {s.per_rank_data_ms[r] / 1e3:.2f} s" for r in range(trainer.world_size)))
    if not stopped:  # a complete epoch's loss (every rank's watch sees the same; rank 0 says it)
        line = trainer.outer_watch.observe(s.epoch, s.avg_loss)
        if line is not None and trainer.rank == 0:
            trainer.warn(line)
    # Decided from the config and gathered values only: every rank agrees, and
    # every rank joins the state gather of the save.
    due = (cfg.checkpoint_every and (s.epoch + 1) % cfg.checkpoint_every == 0) or trainer.task.checkpoint_now
    best = trainer.best is not None and ((trainer.best.is_best and trainer.best.keep) or trainer.best.early_stopped)
    if due or last or stopped or best:  # (a new best epoch is kept: --keep-best; an early stop is the end)
        # A stop in the epoch's last window ended the epoch anyway: save it complete.
        in_epoch = stopped and cursor < num_batches(trainer.data.train.n, cfg.step_samples, cfg.drop_last)
        trainer.save_checkpoint(s, reason="graceful_shutdown" if stopped else "checkpoint",
                                cursor=cursor if in_epoch else 0, report=report)
