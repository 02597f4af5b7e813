"""One rank's training loop: windows of batches, snapshot, round, adopt, report.

Invariant: every rank runs the same sequence of windows, rounds and epoch
exchanges — the plan is a function of the config, the data size and the world
size only (SPEC §4) — so every collective is entered in the same order, idle
ranks included. This module never calls MPI: it talks to the bridge.

The `Trainer` holds the loop (epochs, windows, the batch step, the rounds and their
adoption); its parts of another concern live beside it: the replica and its
snapshot/adoption copies (`flodl_mpi.training.replica`), a window's start kept and
gone back to after a peer's death (`flodl_mpi.training.rollback`), the epoch's line
and save decision (`flodl_mpi.training.epoch_end`) and what a checkpoint holds
(`flodl_mpi.training.trainer_checkpoint`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time

import numpy as np
import torch

from flodl_mpi.training import recovery, resume_state, rollback, trainer_checkpoint
from flodl_mpi.errors import RankFailure
from flodl_mpi.transport.bridge import Bridge, RoundUpdate
from flodl_mpi.training.resplit import BatchQueue
from flodl_mpi.outputs.checkpoint_contents import CheckpointContents
from flodl_mpi.outputs.metrics import writer_or_none
from flodl_mpi.outputs.saver import saver_for
from flodl_mpi.config import TrainConfig
from flodl_mpi.training.accumulate import micro_batches
from flodl_mpi.training.data import Dataset, batch_indices, epoch_permutation, num_batches
from flodl_mpi.runtime import hooks
from flodl_mpi.protocol.optimizer_state import OptimizerStateAverager, resolve_mode
from flodl_mpi.protocol.outer_watch import OuterWatch
from flodl_mpi.policy.policies import Plan
from flodl_mpi.training.progress import EpochProgress
from flodl_mpi.policy.replay import RecordedPlan
from flodl_mpi.protocol.epoch_report import EpochReport, EpochSummary
from flodl_mpi.runtime.signals import StopRequest
from flodl_mpi.training.best_model import BestWatch
from flodl_mpi.training.epoch_end import report_epoch
from flodl_mpi.training.replica import Replica
from flodl_mpi.training.task import ClassificationTask

__all__ = ["Trainer"]

#: Every this many steps a batch record carries the L2 norm of all params (SPEC §5).
PARAM_NORM_EVERY = 10

#: ``--amp``'s autocast dtype (`flodl_mpi.config.AMP_MODES`); None: no autocast.
AMP_DTYPES = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass
class _OpenEnd:
    """An async epoch whose last round runs on into the next epoch: what its end needs."""

    epoch: int
    report: EpochReport
    rows: list
    cursor: int


class Trainer:
    """Runs a rank's epochs; the same object on every rank, rank 0 adds the writer.

    Args:
        cfg: the validated config.
        rank, world_size: this rank's place.
        data: the dataset (every rank holds it; each reads only its batches).
        replica: the model on its device.
        bridge: a started :class:`Bridge` for this rank.
        writer: rank 0's ``MetricsWriter``; a ``NoMetricsWriter`` (or None) elsewhere.
        log: a callable taking one line (rank 0 prints progress with it).
        stop: the stop request that signals set (``flodl_mpi.runtime.signals``); each
            round carries it to every rank.
        progress: rank 0's bar within an epoch (`EpochProgress`); disabled by default.
        log_detail: a callable taking one line: rank 0's per-rank detail of each
            epoch (``-v``); default: dropped.
        task: what a step and an evaluation are (:mod:`flodl_mpi.training.task`): the
            optimizer it builds, a batch's loss, the step (learning rate,
            clipping), the epoch's end. Default: ``ClassificationTask``, the CLI's.
        replay: ``--replay-plan``'s recorded plan (`flodl_mpi.policy.replay`), already checked against
            this run: each window runs the quotas recorded for the round that closes it (the
            policy still observes every round: its guard verdicts and state are recorded).
        warn: a callable taking one line: rank 0's warnings during training (default: ``log``).

    Failure semantics: any exception leaves :meth:`fit`; the caller ends the
    job. Checkpoints already written stay; the one in progress is either
    complete under its final name or absent.
    """

    def __init__(self, cfg: TrainConfig, rank: int, world_size: int, data: Dataset, replica: Replica,
                 bridge: Bridge, writer=None, log=print,
                 stop: StopRequest | None = None, progress: EpochProgress | None = None,
                 log_detail=None, task=None, replay: RecordedPlan | None = None, warn=None) -> None:
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        #: Rank 0's metrics duty (`flodl_mpi.outputs.metrics.MetricsWriter`); a NoMetricsWriter elsewhere.
        self.writer = writer_or_none(writer)
        self.data, self.replica, self.bridge = data, replica, bridge
        #: Rank 0's checkpoint duty (`flodl_mpi.outputs.saver`); a NoSaver on every other rank.
        self.saver = saver_for(rank, self.writer)
        self.log = log
        self.progress = progress if progress is not None else EpochProgress(enabled=False)
        self.log_detail = log_detail if log_detail is not None else (lambda line: None)
        self.warn = warn if warn is not None else log
        self.task = task if task is not None else ClassificationTask(cfg, world_size)
        outer = bridge.outer
        #: Says once when a run with an outer optimizer is going wrong (issue 26 item 11).
        self.outer_watch = OuterWatch("avg" if outer is None else outer.kind, 1.0 if outer is None else outer.lr,
                                      0.0 if outer is None else outer.momentum,
                                      api=type(self.task) is not ClassificationTask)
        self.optimizer = self.task.make_optimizer(cfg, replica.model)
        # The named schedule spans the run's cohort steps (epochs x steps per epoch: not the world size).
        self.task.set_total_steps(cfg.epochs * num_batches(data.train.n, cfg.step_samples, cfg.drop_last))
        #: ``--amp``: the forward pass's autocast dtype on this device (None: off), and fp16's GradScaler.
        self.amp_dtype = AMP_DTYPES[cfg.amp]
        self.scaler = torch.amp.GradScaler(replica.device.type) if cfg.amp == "fp16" else None
        #: ``--keep-best`` / ``--early-stop``: the best validation epoch so far (None: neither asked).
        self.best = None if data.val is None or not (cfg.keep_best or cfg.early_stop) else \
            BestWatch(cfg.best_metric, cfg.early_stop, keep=cfg.keep_best is not None)
        #: The next window's plan (quotas, anchor): the policy's, the same on every rank.
        self.plan = bridge.policy.plan()
        #: ``--replay-plan``: each window runs the recorded plan of the round that closes it, not the policy's.
        self.replay = replay
        #: Rounds this trainer started (blocking or async), so the index of the round the next window closes.
        self.rounds_started = bridge.version
        #: Async's adoption of a round it trained past: "delta" or "easgd" (None: blocking).
        self.adoption = None if bridge.policy.blocking else cfg.async_adopt_value
        replica.keep_snapshot = self.adoption is not None  # both adoptions are relative to the snapshot
        #: Averages the optimizer state with the params (``--average-optimizer-state``), or None.
        #: Under async the state is adopted by the params' rule (decayed: OptimizerStateAverager.adopt).
        self.state_average: OptimizerStateAverager | None = None
        mode = resolve_mode(cfg.average_optimizer_state, self.optimizer)
        if mode != "off":
            averager = OptimizerStateAverager(self.optimizer, mode)  # refuses a state it cannot plan, at any size
            # A world of one: the consensus of one rank's state is its state (nothing travels, no second moment
            # is rebuilt), so the optimizer steps exactly as in a plain PyTorch loop (issue 26 item 10).
            if not bridge.alone:
                self.state_average = averager
                averager.keep_snapshot = self.adoption is not None
                bridge.attach_optimizer_state(averager)
        #: Async: an epoch's last round runs on while the next epoch's first window
        #: trains, and the epoch ends (evaluation, exchange, checkpoint) on its consensus
        #: when it arrives; the last epoch and a stop wait for it. ``flodl-mpi train``'s
        #: task only: the Python API's loop acts on each epoch's result before the next
        #: epoch trains, so there every epoch waits for its last round.
        self.carry_epoch_round = self.adoption is not None and type(self.task) is ClassificationTask
        self._open_end: _OpenEnd | None = None  # the epoch whose end waits for its carried round
        self._end_ms = 0.0  # ms this epoch spent ending the previous one (not this epoch's time)
        self.steps = 0            # n_r: optimizer steps since the consensus last adopted
        self.loss_finite = True   # every loss of the current window was finite
        self.global_step = 0      # this rank's optimizer steps in the run
        self.stop = stop if stop is not None else StopRequest()  # set by signals: stop and save
        #: The latest cohort epoch metrics, identical on every rank (SPEC §5).
        self.latest: EpochSummary | None = None
        self.history: list[EpochSummary] = []
        # Where training starts (moved by resume) and the rows metrics.h5 holds.
        self.start_epoch, self.start_cursor = 0, 0
        self.epoch_rows, self.batch_rows = 0, 0
        self._carried: EpochReport | None = None  # the stopped epoch's report, on resume
        self.made_progress = lambda what: None  # called after each batch (train.py: the stall watchdog's)
        #: After a resume at another world size: one line saying what was remapped.
        self.remapped = ""
        #: After a resume with a delta ``--wire``: one line saying what its state came back as.
        self.wire_resumed = ""
        #: ``--on-rank-failure shrink``: ``recover(trainer, failure, window)`` (`flodl_mpi.training.recovery`)
        #: shrinks the world after a peer died in a round; None: a death ends the job (``stop``).
        self.elastic = None
        #: The epoch's batches in the order windows hand them out (`flodl_mpi.training.resplit`): the
        #: whole plan, until a change re-splits what is left of it.
        self.queue: BatchQueue | None = None
        self._resume_queue: BatchQueue | None = None  # a mid-epoch checkpoint's queue after a change

    def resume(self, ckpt: CheckpointContents) -> None:
        """Continue from a checkpoint: counters, guard, per-rank state, the stopped epoch's report.

        The model's consensus parameters and buffers are loaded by the caller on
        every rank alike; this restores what differs per rank (SPEC §6): the
        optimizer state, the step count and the integer buffers (BatchNorm's
        ``num_batches_tracked`` counts this rank's batches), and the RNG
        (`flodl_mpi.training.resume_state`, the Averager's restore too).

        Another world size (W_old -> W): the consensus, the round and the global
        data cursor carry over exactly. New rank r takes the optimizer state, step
        count and integer buffers of old rank ``r mod W_old`` (so rank r < W_old
        keeps its own); its RNG is reseeded from ``(seed, rank, round)``, since
        old streams cannot be split or merged. A stopped epoch's reports carry
        over so the epoch still adds up: new rank r carries the sum of the
        reports of old ranks ``r' ≡ r (mod W)`` (losses, batches, samples, times),
        none when there is no such rank. :attr:`remapped` says so in one line.

        Raises:
            ValueError: the checkpoint holds no state for the rank this one takes
                over, or state of another optimizer or model.
        """
        old_size = ckpt.world_size
        mine = resume_state.restore_rank(ckpt, self.rank, self.world_size, self.optimizer, self.replica.model)
        self.global_step, same = mine.global_step, mine.same_world
        if self.best is not None:  # the best so far and the patience used, as the run left them
            self.best.restore(ckpt.extra)
        if self.scaler is not None and "grad_scaler" in mine.attrs:  # (a run without --amp fp16 starts it afresh)
            self.scaler.load_state_dict(dict(mine.attrs["grad_scaler"]))
        if self.state_average is not None:
            self.state_average.start()  # the saved state is the last round's consensus
        if not same:
            seed = np.random.SeedSequence([self.cfg.seed, self.rank, ckpt.round]).generate_state(1)[0]
            torch.manual_seed(int(seed))
        # Hyperparameters are the run's as configured now (a resume may change --lr); the weight
        # decay only when given (else the run's own, restored with the state: issue 26 item 11).
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] = self.cfg.lr  # what a schedule's factor multiplies, too
            if self.cfg.weight_decay is not None:
                group["weight_decay"] = self.cfg.weight_decay
            if "momentum" in group:
                group["momentum"] = self.cfg.momentum
        resume_state.restore_bridge(ckpt, self.bridge)  # round, policy (or guard), outer optimizer, clock
        self.wire_resumed = resume_state.restore_wire(ckpt, self.bridge, self.rank, self.world_size)
        self.plan = self.bridge.policy.plan()
        self.rounds_started = self.bridge.version  # no round in flight at a checkpoint
        self.start_epoch, self.start_cursor = ckpt.epoch, ckpt.cursor
        if ckpt.extra.get("batch_queue") is not None:  # stopped mid-epoch after a membership change
            n_batches = num_batches(self.data.train.n, self.cfg.step_samples, self.cfg.drop_last)
            self._resume_queue = BatchQueue.from_state_dict(ckpt.extra["batch_queue"], n_batches)
        if self.start_cursor:  # the epoch goes on: its report so far, re-evaluated at its end
            old = [r for r in range(old_size) if r % self.world_size == self.rank]
            reports = ckpt.stopped_reports(old)  # (schema 1, the same world size: from the state this rank read)
            mine_reports = [EpochReport(**reports[r]) for r in old]
            carried = EpochReport()
            for f in ("loss_sum", "batches", "nonfinite_batches", "samples", "epoch_ms", "compute_ms", "data_ms"):
                setattr(carried, f, sum((getattr(r, f) for r in mine_reports), type(getattr(carried, f))()))
            self._carried = carried
        self.epoch_rows = int(ckpt.metrics_rows["epochs"])
        self.batch_rows = int(ckpt.metrics_rows["batches"])
        self.remapped = "" if same else (
            f"world size {old_size} -> {self.world_size}: rank r took the optimizer state, step count and "
            f"integer buffers of old rank r mod {old_size}; RNG reseeded from (seed, rank, round {ckpt.round})"
            + (f"; the stopped epoch's reports of old rank r' carried by rank r' mod {self.world_size}"
               if self.start_cursor else ""))

    def fit(self) -> list[EpochSummary]:
        """Train up to ``cfg.epochs`` epochs (or until a stop round) and return the epoch summaries.

        Sets ``self.done``: every epoch is trained (also when a stop came in the
        last epoch's last window); False after a stop before that.
        """
        for _ in self.iter_epochs():
            pass
        return self.history

    def iter_epochs(self):
        """:meth:`fit` one epoch at a time: yields each epoch's :class:`EpochSummary` (the same on every rank)."""
        self.done = True
        for epoch in range(self.start_epoch, self.cfg.epochs):
            if self.best is not None and self.best.early_stopped:  # (a resumed run that had stopped early)
                break
            known = len(self.history)
            stopped = self._epoch(epoch, self.start_cursor if epoch == self.start_epoch else 0)
            if stopped:
                # The checkpoint is queued to rank 0's writer thread here, written by the final save.
                self.log(f"stopped on request in epoch {epoch + 1} at round {self.bridge.version}; its checkpoint "
                         "is queued (the final save writes it)")
                self.done = epoch == self.cfg.epochs - 1 and self._epoch_complete
            # An epoch carried into the next (async) ends during the next one: each
            # summary is yielded once, in order, when it exists.
            yield from self.history[known:]
            if stopped:
                break
            if self.best is not None and self.best.early_stopped:
                b = self.best
                self.log(f"early stop after epoch {epoch + 1}: no better {b.metric} in {b.bad_epochs} epoch(s) "
                         f"(--early-stop {b.patience}); the best, {b.best:.4f}, was epoch {b.best_epoch}")
                break

    # ---- one epoch -------------------------------------------------------------

    def _epoch(self, epoch: int, cursor: int = 0) -> bool:
        """One epoch from global batch ``cursor`` on; True when a stop round ended it.

        Windows are planned over :attr:`queue` (positions; each position one global batch):
        the whole plan, or after a membership change (`rollback.shrink`) the batches no consensus
        holds yet, so every batch is still trained once in the consensus.
        """
        cfg, model = self.cfg, self.replica.model
        t_epoch = time.perf_counter()
        perm = epoch_permutation(self.data.train.n, cfg.seed, epoch)
        n_batches = num_batches(self.data.train.n, cfg.step_samples, cfg.drop_last)
        self.queue = BatchQueue.whole(n_batches)
        if self._resume_queue is not None:  # the queue a change left, from the checkpoint's cursor on
            self.queue, self._resume_queue = self._resume_queue, None
            cursor = 0
        report, self._carried = (self._carried or EpochReport()), None
        rows: list[tuple] = []
        stopped = False
        model.train()
        self.progress.start(f"epoch {epoch + 1}/{cfg.epochs}", n_batches, cursor, self.bridge.version)
        while cursor < len(self.queue):
            # -- plan: the same on every rank, no communication (SPEC §4)
            plan = self.plan if self.replay is None else Plan(*self.replay.plan(self.rounds_started))
            window, ids = self.queue.window(plan.quotas, cursor)
            mine = ids[self.rank].tolist()
            if hasattr(self.data.train.x, "prefetch"):  # streamed (--data-loading): read ahead
                self._read_ahead(perm, plan, window, mine)
            mark = rollback.mark(self, report, rows) if self.elastic is not None else None
            # -- train this rank's batches of the window; time them for the balancer
            busy_ms = 0.0
            for b in mine:
                row = self._train_batch(perm, b, epoch, report, epoch * n_batches + b)
                busy_ms += row[3]  # batch_ms: data wait + compute, nothing else
                rows.append(row)
                self.made_progress(f"batch {b + 1} of epoch {epoch + 1}")
            cursor = window.end
            # -- snapshot, round, adopt (SPEC §2)
            hooks.call("round_start", self)  # extension point (flodl_mpi.runtime.hooks): none by default
            facts = dict(batch_ms=busy_ms / len(mine) if len(mine) else math.nan, quota=plan.quotas[self.rank],
                         anchor=plan.anchor)
            if self.bridge.policy.blocking:
                self._timed("snapshot", self.replica.snapshot, self.bridge)
                if self.state_average is not None:
                    self._timed("snapshot", self.state_average.fill, self.bridge.state_tensors)
                try:
                    update = self.bridge.round(self.steps, len(mine), stop=self.stop.requested,
                                               loss_finite=self.loss_finite, **facts)
                except RankFailure as failure:
                    if mark is None:
                        raise
                    report, rows = rollback.shrink(self, failure, window, mark, rows)
                    cursor = 0  # the new queue's first position: the abandoned window's batches first
                    continue
                self.rounds_started += 1
                self.loss_finite = True
                self._adopt(update)
            else:
                update = self._async_round(len(mine), facts)
            self.progress.update(n_batches - len(self.queue) + cursor, report.loss_sum / max(report.batches - report.nonfinite_batches, 1),
                                 self.bridge.version)
            self.writer.check()  # a disk error on rank 0 ends the job now, not at the epoch's end
            if update is not None and update.stop:
                stopped = True
                break
        self.progress.close()
        carry = self.bridge.in_flight and self.carry_epoch_round and not stopped and epoch < cfg.epochs - 1
        if self.bridge.in_flight and not carry:
            # -- async, the last epoch or a stop: the epoch's last round. Nothing trained
            # since its snapshot, so the consensus is adopted as it is: every rank
            # evaluates and saves the same model.
            update = self.bridge.wait()
            self._adopt(update)
            stopped = stopped or update.stop
        # The epoch's time: its windows and rounds, not the previous epoch's end done meanwhile.
        report.epoch_ms += 1e3 * (time.perf_counter() - t_epoch) - self._end_ms
        self._end_ms = 0.0
        cursor = n_batches - len(self.queue) + cursor  # the epoch's batches done (a queue position before)
        if carry:
            # -- async: the epoch's last round runs on while the next epoch's first
            # window trains; this epoch ends when it arrives (_end_carried). Decided
            # from the config and gathered values only: every rank carries alike.
            self._open_end = _OpenEnd(epoch, report, rows, cursor)
            return False
        return self._end_epoch(epoch, report, rows, cursor, stopped)

    def _end_epoch(self, epoch: int, report: EpochReport, rows: list, cursor: int, stopped: bool) -> bool:
        """Evaluate the model (the consensus), exchange the epoch's reports, report and save; returns ``stopped``."""
        n_batches = num_batches(self.data.train.n, self.cfg.step_samples, self.cfg.drop_last)
        # -- evaluate the consensus on this rank's slices of the validation and the test set; with a
        # validation set the test set only at the end (the last epoch, or one that may stop early: decided
        # from gathered values, the same on every rank) or with --test-every-epoch
        val, cfg = self.data.val, self.cfg
        test_now = val is None or cfg.test_every_epoch or epoch == cfg.epochs - 1 or \
            (self.best is not None and self.best.may_stop_next())
        with self.autocast():  # evaluated in the precision it trains in (--amp)
            if val is not None:
                report.val_loss_sum, report.val_correct, report.val_count = self.task.evaluate_val(self, val)
            if test_now or self.task.boundary_every_epoch:
                report.test_loss_sum, report.test_correct, report.test_count = self.task.end_epoch(
                    self, epoch, report, test_now)
        # -- epoch exchange: every rank gets the same summary; rank 0 writes metrics
        try:
            summary = self.bridge.epoch_end(report, np.array(rows, dtype=np.float64), epoch)
        except RankFailure as failure:  # --on-rank-failure shrink: go on without the dead, evaluate and exchange again
            if self.elastic is None:
                raise
            recovery.after_death_between_rounds(self, failure)
            return self._end_epoch(epoch, report, [(self.rank, *row[1:]) for row in rows], cursor, stopped)
        self.plan = self.bridge.policy.plan()  # the guard's verdict at the exchange may have moved the anchor
        self.epoch_rows += 1
        self.batch_rows += summary.batch_records
        self.latest = summary
        self.history.append(summary)
        self._epoch_complete = cursor >= n_batches
        if self.best is not None:
            self.best.is_best = False
            if self._epoch_complete:  # a stopped epoch's numbers are not an epoch's
                self.best.observe(epoch + 1, getattr(summary, cfg.best_metric))
        self.task.after_epoch(self, summary)
        report_epoch(self, summary, stopped, cursor, report)
        return stopped

    def _read_ahead(self, perm: np.ndarray, plan: Plan, window, mine: list[int]) -> None:
        """Hand the streamed features this window's batches of this rank (``mine``: global batch ids), then the
        next window's as planned now (read during this window and its round; a plan the round changes drops
        them: never served wrong)."""
        cfg = self.cfg
        if window.end < len(self.queue):
            mine = mine + self.queue.window(plan.quotas, window.end)[1][self.rank].tolist()
        # In the order _train_batch asks for them: each step's --accumulate micro-batches.
        self.data.train.x.prefetch([part for b in mine
                                    for part, _ in micro_batches(batch_indices(perm, cfg.step_samples, b, cfg.drop_last),
                                                                 cfg.batch_size)])

    def autocast(self):
        """``--amp``: torch.autocast on the run's device in its dtype; off: a no-op context."""
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.replica.device.type, dtype=self.amp_dtype)

    def _train_batch(self, perm: np.ndarray, b: int, epoch: int, report: EpochReport, cohort_step: int = 0) -> tuple:
        """One optimizer step on global step ``b``'s samples: ``--accumulate`` micro-batches, then the task's step.

        Each micro-batch's loss is weighted by its share of the step's samples
        (`flodl_mpi.training.accumulate.micro_batches`), so the accumulated gradient is the
        step's mean loss's. The step counts toward this rank's mass (``steps``) only when the
        optimizer stepped: a step fp16's GradScaler skipped changed nothing.
        """
        cfg, dev, model = self.cfg, self.replica.device, self.replica.model
        t0 = time.perf_counter()
        idx = batch_indices(perm, cfg.step_samples, b, cfg.drop_last)
        data_s, loss_value = 0.0, 0.0
        for j, (part, weight) in enumerate(micro_batches(idx, cfg.batch_size)):
            t_data = time.perf_counter()
            x = torch.from_numpy(self.data.train.x[part]).to(dev, non_blocking=True)
            y = torch.from_numpy(self.data.train.y[part]).to(dev, non_blocking=True)
            data_s += time.perf_counter() - t_data
            if j == 0:
                hooks.call("batch", self)
                self.optimizer.zero_grad(set_to_none=True)
            with self.autocast():
                loss = self.task.loss(model, (x, y), cohort_step)
                loss = hooks.fold("loss", loss, self)
            scaled = loss if weight == 1.0 else loss * weight
            (scaled if self.scaler is None else self.scaler.scale(scaled)).backward()
            loss_value += loss.item() * weight  # sync point: the micro-batch is done on the device
        stepped = self.task.step(model, self.optimizer, cohort_step, self.scaler)
        self.loss_finite = self.loss_finite and math.isfinite(loss_value)
        t2 = time.perf_counter()
        self.steps += 1 if stepped else 0
        self.global_step += 1
        if math.isfinite(loss_value):
            report.loss_sum += loss_value
        else:  # trained, quarantined by the round: left out of the epoch's loss, counted
            report.nonfinite_batches += 1
        report.batches += 1
        report.samples += len(idx)
        report.data_ms += 1e3 * data_s
        report.compute_ms += 1e3 * (t2 - t0 - data_s)
        norm = self.replica.param_norm() if self.global_step % PARAM_NORM_EVERY == 0 else math.nan
        lr = self.optimizer.param_groups[0]["lr"]
        return (self.rank, epoch + 1, self.global_step, 1e3 * (t2 - t0), 1e3 * data_s, loss_value, lr, norm)

    def _async_round(self, window: int, facts: dict) -> RoundUpdate | None:
        """Async (SPEC §4): adopt the round in flight, if any, then start this window's.

        The round in flight was snapshotted a window ago; this rank trained on since,
        so it adopts ``theta + alpha (consensus - theta_snapshot)``: its own steps since
        the snapshot kept, ``alpha`` 1 under ``--async-adopt delta``, ``--easgd-alpha``
        under ``easgd`` (:meth:`Replica.adopt`), and the steps the round
        covered are subtracted. At most one round is in flight. The plan of the next
        window is the adopted round's, one round older than a blocking policy's: the
        data each rank reads is still decided before the window, from gathered values.
        """
        update = None
        if self.bridge.in_flight:
            update = self.bridge.wait()
            if self._open_end is not None:
                self._end_carried(update)
            self._adopt(update, alpha=self.cfg.easgd_alpha_value, delta=True)
        self._timed("snapshot", self.replica.snapshot, self.bridge)
        if self.state_average is not None:
            self._timed("snapshot", self.state_average.fill, self.bridge.state_tensors)
        self.bridge.submit(self.steps, window, stop=self.stop.requested, loss_finite=self.loss_finite, **facts)
        self.rounds_started += 1
        self.loss_finite = True
        return update

    def _end_carried(self, update: RoundUpdate) -> None:
        """End the epoch whose last round just arrived (async), on its consensus.

        Every rank is here at the same point of the same window (the carry is decided
        from the config), with no round in flight, so the epoch exchange and the
        checkpoint's gather keep their order. The live model holds the consensus for
        the evaluation and the save (the same model on every rank, as at a blocking
        epoch's end), then takes back its own steps; the caller adopts next. The
        checkpoint's optimizer state is the rank's own, one window further on; a resume
        restarts the next epoch from the consensus (async resumes are not bit-exact).
        A stop in this round stops the current epoch after this window.
        """
        end, self._open_end = self._open_end, None
        t0 = time.perf_counter()
        if update.plan is not None:
            self.plan = update.plan
        # The staging holds the consensus, or (a round that realized no mass) this rank's
        # snapshot: the model at the epoch's end either way, as the waiting path evaluates.
        with self.replica.consensus_in_place(self.bridge):
            self._end_epoch(end.epoch, end.report, end.rows, end.cursor, stopped=False)
        self._end_ms += 1e3 * (time.perf_counter() - t0)

    def _timed(self, part: str, fn, *args, **kw) -> None:
        """``fn(*args, **kw)``, its time counted as the round's ``part`` (`Bridge.add_training_ms`: the
        snapshot's and adoption's copies, metrics.h5 ``rounds/snapshot_ms``, ``rounds/adopt_ms``)."""
        t0 = time.perf_counter()
        fn(*args, **kw)
        self.bridge.add_training_ms(part, 1e3 * (time.perf_counter() - t0))

    def _adopt(self, update: RoundUpdate, alpha: float = 1.0, delta: bool = False) -> None:
        if update.plan is not None:
            self.plan = update.plan
        # A world of one's consensus is its own values, bit for bit: copying it back changes nothing (bound
        # params are the staging, where an outer step already wrote; copied params differ only after one).
        same = self.bridge.alone and not delta and (self.replica.bound or not update.outer_stepped)
        if update.adopted and not same:
            # A quarantined rank's own values are not finite: it takes the consensus whole.
            whole = self.rank in update.quarantined
            self._timed("adopt", self.replica.adopt, self.bridge, 1.0 if whole else alpha, delta=delta and not whole)
            if self.state_average is not None:
                self._timed("adopt", self.state_average.adopt, self.bridge.state_tensors, delta=delta and not whole,
                            steps=self.steps - update.steps_at_snapshot, alpha=1.0 if whole else alpha)
        elif update.adopted:  # adopted in place already: the adoption took no time (0, not "not recorded")
            self.bridge.add_training_ms("adopt", 0.0)
        if update.quarantined:
            if self.writer.writes:
                self.log(f"round {update.version - 1}: rank(s) {', '.join(map(str, update.quarantined))} had a "
                         "non-finite loss or NaN/Inf parameters: quarantined (mass 0), adopted the consensus")
            if self.rank in update.quarantined and self.state_average is None:
                # The step that went non-finite most likely left NaN in the optimizer's
                # state too (momentum, Adam moments): start it afresh on the consensus.
                # (An averaged state was just overwritten with the consensus state.)
                self.optimizer.state.clear()
        if update.outer_stepped and self.cfg.outer_reset_inner:
            # DiLoCo-style: every rank restarts its inner optimizer from the new global
            # parameters (SPEC §7); decided from the round's outcome, the same on every rank.
            self.optimizer.state.clear()
            if self.state_average is not None:
                self.state_average.reset()
        # Subtract, don't zero: steps taken while a round runs count toward the
        # next window (SPEC §2 step 8).
        self.steps -= update.steps_at_snapshot

    # ---- checkpoints (flodl_mpi.training.trainer_checkpoint) --------------------

    def save_checkpoint(self, s: EpochSummary, reason: str, cursor: int = 0,
                        report: EpochReport | None = None) -> None:
        """Save a checkpoint: collective (each rank's state is gathered), rank 0 writes
        (`flodl_mpi.training.trainer_checkpoint.save`)."""
        trainer_checkpoint.save(self, s, reason, cursor, report)

    def check_saveable(self, directory, start_epoch: int = 0) -> None:
        """The save check at setup, before any epoch is trained (collective through ``agree``;
        `flodl_mpi.training.trainer_checkpoint.check_saveable`: its arguments and errors)."""
        trainer_checkpoint.check_saveable(self, directory, start_epoch)
