"""One rank's training loop: windows of batches, snapshot, round, adopt, report.

Invariant: every rank runs the same sequence of windows, rounds and epoch
exchanges — the plan is a function of the config, the data size and the world
size only (SPEC §4) — so every collective is entered in the same order, idle
ranks included. This module never calls MPI: it talks to the bridge.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from flodl_mpi import rank_state
from flodl_mpi.bridge import Bridge, RoundUpdate
from flodl_mpi.cadence import fixed_quotas, plan_window
from flodl_mpi.checkpoint import Checkpoint, checkpoint_name
from flodl_mpi.config import TrainConfig
from flodl_mpi.data import Dataset, Split, batch_indices, epoch_permutation, num_batches
from flodl_mpi.faults import Fault, InjectedFault
from flodl_mpi.reporting import EpochReport, EpochSummary
from flodl_mpi.signals import StopRequest

__all__ = ["Replica", "Trainer", "evaluate", "make_optimizer", "state_arrays"]

#: Every this many steps a batch record carries the L2 norm of all params (SPEC §5).
PARAM_NORM_EVERY = 10


def make_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    """The inner optimizer named by ``cfg.optimizer``."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)


@dataclass
class Replica:
    """A rank's model and the tensors that travel: params, then floating buffers.

    The order is ``named_parameters()`` then ``named_buffers()``, fixed by the
    model's structure, never filtered by rank-local state (SPEC §2 step 1).
    Integer buffers (``num_batches_tracked``) never travel: they keep their
    local values.
    """

    model: nn.Module
    device: torch.device
    params: list[torch.Tensor] = field(init=False)
    float_buffers: list[torch.Tensor] = field(init=False)
    #: True once :meth:`bind` made the params views of the bridge's staging.
    bound: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.params = [p for _, p in self.model.named_parameters()]
        self.float_buffers = [b for _, b in self.model.named_buffers() if b.is_floating_point()]

    @torch.no_grad()
    def bind(self, bridge: Bridge) -> bool:
        """Make the parameters live in the bridge's params staging, when they can.

        With every parameter a float32 CPU tensor, each ``p.data`` becomes its
        view of the staging, so the snapshot and the adoption copies vanish: the
        pack reads the live parameters and the unpack writes the consensus into
        them, one pass each (DESIGN, "Where the time goes"). This departs from
        SPEC §2's separate staging on purpose and is only sound while the
        training thread waits for every round (the ``sync`` and ``window``
        policies): nothing touches the parameters while the bridge works. Call
        before the optimizer is built. Buffers keep the copy path (they are small).

        Returns:
            Whether the parameters were bound (False: CUDA or non-float32 params).
        """
        if not all(p.device.type == "cpu" and p.dtype == torch.float32 for p in self.params):
            return False
        for p, view in zip(self.params, bridge.param_tensors):
            view.copy_(p.detach())
            p.data = view
        self.bound = True
        return True

    @torch.no_grad()
    def snapshot(self, bridge: Bridge) -> None:
        """Copy params and floating buffers (as float32) into the bridge's staging."""
        if not self.bound:
            for dst, src in zip(bridge.param_tensors, self.params):
                dst.copy_(src.detach())
        for dst, src in zip(bridge.buffer_tensors, self.float_buffers):
            dst.copy_(src)

    @torch.no_grad()
    def adopt(self, bridge: Bridge) -> None:
        """Overwrite params and floating buffers with the consensus in the staging."""
        if not self.bound:
            for dst, src in zip(self.params, bridge.param_tensors):
                dst.copy_(src)
        for dst, src in zip(self.float_buffers, bridge.buffer_tensors):
            dst.copy_(src)

    @torch.no_grad()
    def param_norm(self) -> float:
        """L2 norm of all parameters together, accumulated in float64."""
        return math.sqrt(sum(float(torch.sum(p.detach().double() ** 2)) for p in self.params))


@torch.no_grad()
def evaluate(model: nn.Module, split: Split, rank: int, world_size: int, device: torch.device,
             batch_size: int) -> tuple[float, int, int]:
    """Evaluate this rank's contiguous slice of ``split`` (eval mode).

    Returns:
        ``(loss_sum, correct, count)`` — summed cross-entropy over the slice,
        correct top-1 predictions and samples; the epoch exchange sums them over
        ranks, so the cohort covers the whole split exactly once.
    """
    lo, hi = (split.n * rank) // world_size, (split.n * (rank + 1)) // world_size
    was_training = model.training
    model.eval()
    loss_sum, correct = 0.0, 0
    for start in range(lo, hi, batch_size):
        x = torch.from_numpy(split.x[start : min(start + batch_size, hi)]).to(device)
        y = torch.from_numpy(split.y[start : min(start + batch_size, hi)]).to(device)
        logits = model(x)
        loss_sum += float(nn.functional.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(dim=1) == y).sum())
    model.train(was_training)
    return loss_sum, correct, hi - lo


def state_arrays(model: nn.Module) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], list[str]]:
    """The model's state dict as numpy copies, split into params and buffers.

    Returns:
        ``(params, buffers, order)``: floating tensors as float32, integer
        buffers as they are, by state-dict name; ``order`` is the state-dict order.
    """
    param_names = {name for name, _ in model.named_parameters()}
    params, buffers = {}, {}
    for name, t in model.state_dict().items():
        t = t.detach().cpu()
        arr = (t.float() if t.is_floating_point() else t).numpy().copy()
        (params if name in param_names else buffers)[name] = arr
    return params, buffers, list(model.state_dict().keys())


class Trainer:
    """Runs a rank's epochs; the same object on every rank, rank 0 adds the writer.

    Args:
        cfg: the validated config.
        rank, world_size: this rank's place.
        data: the dataset (every rank holds it; each reads only its batches).
        replica: the model on its device.
        bridge: a started :class:`Bridge` for this rank.
        writer: rank 0's ``MetricsWriter``; None elsewhere.
        fault: an injected fault (tests), or None.
        log: a callable taking one line (rank 0 prints progress with it).
        stop: the stop request that signals set (``flodl_mpi.signals``); each
            round carries it to every rank.

    Failure semantics: any exception leaves :meth:`fit`; the caller ends the
    job. Checkpoints already written stay; the one in progress is either
    complete under its final name or absent.
    """

    def __init__(self, cfg: TrainConfig, rank: int, world_size: int, data: Dataset, replica: Replica,
                 bridge: Bridge, writer=None, fault: Fault | None = None, log=print,
                 stop: StopRequest | None = None) -> None:
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.data, self.replica, self.bridge, self.writer = data, replica, bridge, writer
        self.fault, self.log = fault, log
        self.optimizer = make_optimizer(cfg, replica.model)
        self.quotas = fixed_quotas(world_size, cfg.window)
        self.steps = 0            # n_r: optimizer steps since the consensus last adopted
        self.global_step = 0      # this rank's optimizer steps in the run
        self.stop = stop if stop is not None else StopRequest()  # set by signals: stop and save
        #: The latest cohort epoch metrics, identical on every rank (SPEC §5).
        self.latest: EpochSummary | None = None
        self.history: list[EpochSummary] = []
        # Where training starts (moved by resume) and the rows metrics.h5 holds.
        self.start_epoch, self.start_cursor = 0, 0
        self.epoch_rows, self.batch_rows = 0, 0
        self._carried: EpochReport | None = None  # the stopped epoch's report, on resume

    def resume(self, ckpt: Checkpoint) -> None:
        """Continue from a checkpoint: counters, guard, this rank's optimizer and RNG.

        The model's consensus parameters and buffers are loaded by the caller on
        every rank alike; this restores what differs per rank (SPEC §6).

        Raises:
            ValueError: the checkpoint holds no state for this rank, or state of
                another optimizer.
        """
        meta = ckpt.meta
        if self.rank not in ckpt.ranks:
            raise ValueError(f"checkpoint {ckpt.path}: no state read for rank {self.rank}")
        arrays, attrs = ckpt.ranks[self.rank]
        self.global_step = rank_state.restore(self.optimizer, arrays, attrs)
        # Hyperparameters are the run's as configured now (a resume may change --lr).
        for group in self.optimizer.param_groups:
            group["lr"], group["weight_decay"] = self.cfg.lr, self.cfg.weight_decay
            if "momentum" in group:
                group["momentum"] = self.cfg.momentum
        self.bridge.version = int(meta["round"])
        self.bridge.guard.load_state_dict(meta["guard"])
        self.start_epoch, self.start_cursor = int(meta["epoch"]), int(meta["cursor"])
        self.bridge.resume_clock(float(meta["elapsed_s"]))
        if self.start_cursor:  # the epoch goes on: its report so far, re-evaluated at its end
            self._carried = EpochReport(**attrs["epoch_report"])
            self._carried.test_loss_sum, self._carried.test_correct, self._carried.test_count = 0.0, 0, 0
        self.epoch_rows = int(meta["metrics_rows"]["epochs"])
        self.batch_rows = int(meta["metrics_rows"]["batches"])

    def fit(self) -> list[EpochSummary]:
        """Train up to ``cfg.epochs`` epochs (or until a stop round) and return the epoch summaries.

        Sets ``self.done``: every epoch is trained (also when a stop came in the
        last epoch's last window); False after a stop before that.
        """
        self.done = True
        for epoch in range(self.start_epoch, self.cfg.epochs):
            stopped = self._epoch(epoch, self.start_cursor if epoch == self.start_epoch else 0)
            if stopped:
                self.log(f"stopped on request in epoch {epoch + 1} at round {self.bridge.version}; checkpoint saved")
                self.done = epoch == self.cfg.epochs - 1 and self._epoch_complete
                break
        return self.history

    # ---- one epoch -------------------------------------------------------------

    def _epoch(self, epoch: int, cursor: int = 0) -> bool:
        """One epoch from global batch ``cursor`` on; True when a stop round ended it."""
        cfg, model = self.cfg, self.replica.model
        t_epoch = time.perf_counter()
        perm = epoch_permutation(self.data.train.n, cfg.seed, epoch)
        n_batches = num_batches(self.data.train.n, cfg.batch_size)
        report, self._carried = (self._carried or EpochReport()), None
        rows: list[tuple] = []
        stopped = False
        model.train()
        while cursor < n_batches:
            # -- plan: the same on every rank, no communication (SPEC §4)
            window = plan_window(self.quotas, cursor, n_batches)
            first = window.starts[self.rank]
            mine = range(first, first + window.counts[self.rank])
            # -- train this rank's batches of the window
            for b in mine:
                rows.append(self._train_batch(perm, b, epoch, report))
            cursor = window.end
            # -- snapshot, round, adopt (SPEC §2)
            self._fault_hook("nan")
            self._fault_hook("disk")
            self.replica.snapshot(self.bridge)
            update = self.bridge.round(self.steps, len(mine), stop=self.stop.requested)
            self._adopt(update)
            if self.writer is not None:
                self.writer.check()  # a disk error on rank 0 ends the job now, not at the epoch's end
            if update.stop:
                stopped = True
                break
        # -- evaluate the consensus on this rank's slice of the test set
        t_eval = time.perf_counter()
        report.test_loss_sum, report.test_correct, report.test_count = evaluate(
            model, self.data.test, self.rank, self.world_size, self.replica.device, cfg.eval_batch_size)
        report.epoch_ms += 1e3 * (t_eval - t_epoch)
        # -- epoch exchange: every rank gets the same summary; rank 0 writes metrics
        summary = self.bridge.epoch_end(report, np.array(rows, dtype=np.float64), epoch)
        self.epoch_rows += 1
        self.batch_rows += summary.batch_records
        self.latest = summary
        self.history.append(summary)
        self._epoch_complete = cursor >= n_batches
        self._report(summary, stopped, cursor, report)
        return stopped

    def _train_batch(self, perm: np.ndarray, b: int, epoch: int, report: EpochReport) -> tuple:
        cfg, dev = self.cfg, self.replica.device
        t0 = time.perf_counter()
        idx = batch_indices(perm, cfg.batch_size, b)
        x = torch.from_numpy(self.data.train.x[idx]).to(dev, non_blocking=True)
        y = torch.from_numpy(self.data.train.y[idx]).to(dev, non_blocking=True)
        t1 = time.perf_counter()
        self._fault_hook("step")
        self._fault_hook("hang")
        self.optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(self.replica.model(x), y)
        loss.backward()
        self.optimizer.step()
        loss_value = loss.item()  # sync point: the step is done on the device
        t2 = time.perf_counter()
        self.steps += 1
        self.global_step += 1
        report.loss_sum += loss_value
        report.batches += 1
        report.samples += len(idx)
        report.data_ms += 1e3 * (t1 - t0)
        report.compute_ms += 1e3 * (t2 - t1)
        norm = self.replica.param_norm() if self.global_step % PARAM_NORM_EVERY == 0 else math.nan
        lr = self.optimizer.param_groups[0]["lr"]
        return (self.rank, epoch, self.global_step, 1e3 * (t2 - t0), 1e3 * (t1 - t0), loss_value, lr, norm)

    def _adopt(self, update: RoundUpdate) -> None:
        if update.adopted:
            self.replica.adopt(self.bridge)
        # Subtract, don't zero: steps taken while a round runs count toward the
        # next window (SPEC §2 step 8).
        self.steps -= update.steps_at_snapshot

    def _report(self, s: EpochSummary, stopped: bool, cursor: int, report: EpochReport) -> None:
        cfg = self.cfg
        last = s.epoch == cfg.epochs - 1
        if self.writer is not None:
            self.writer.check()  # a disk error on rank 0 ends the job now, not at the end
            partial = ""
            if stopped:
                partial = f" (stopped after {cursor} of {num_batches(self.data.train.n, cfg.batch_size)} batches)"
            self.log(f"epoch {s.epoch + 1}/{cfg.epochs}{partial}  loss {s.avg_loss:.4f}  "
                     f"test_loss {s.test_loss:.4f}  test_acc {s.test_accuracy:.4f}  rounds {s.rounds}  "
                     f"{s.epoch_ms / 1e3:.1f} s")
        # Decided from the config and gathered values only: every rank agrees, and
        # every rank joins the state gather of the save.
        due = cfg.checkpoint_every and (s.epoch + 1) % cfg.checkpoint_every == 0
        if due or last or stopped:
            # A stop in the epoch's last window ended the epoch anyway: save it complete.
            in_epoch = stopped and cursor < num_batches(self.data.train.n, cfg.batch_size)
            self.save_checkpoint(s, reason="graceful_shutdown" if stopped else "checkpoint",
                                 cursor=cursor if in_epoch else 0, report=report)

    def save_checkpoint(self, s: EpochSummary, reason: str, cursor: int = 0,
                        report: EpochReport | None = None) -> None:
        """Save a checkpoint: collective (each rank's state is gathered), rank 0 writes.

        ``epoch`` in the meta counts completed epochs and ``cursor`` the global
        batches of the next one already trained (non-zero after a stop mid-epoch),
        which is where a resumed run goes on.
        """
        arrays, attrs = rank_state.capture(self.optimizer, self.global_step)
        if cursor:  # stopped mid-epoch: the resumed run finishes this epoch's report
            attrs["epoch_report"] = dataclasses.asdict(report)
        ranks = self.bridge.gather_to_root((arrays, attrs))
        if self.writer is None:
            return
        params, buffers, order = state_arrays(self.replica.model)
        meta = {
            "epoch": s.epoch + 1 if cursor == 0 else s.epoch,
            "epoch_complete": cursor == 0,
            "cursor": cursor,
            "batches_done": s.batches,
            # A stopped epoch's row is dropped on resume: the finished epoch gets one row.
            "metrics_rows": {"rounds": self.bridge.version, "epochs": self.epoch_rows - (1 if cursor else 0),
                             "batches": self.batch_rows},
            "elapsed_s": self.bridge.elapsed,
            "round": self.bridge.version,
            "global_step": self.global_step,
            "reason": reason,
            "world_size": self.world_size,
            "test_accuracy": s.test_accuracy,
            "test_loss": s.test_loss,
            "test_count": s.test_count,
            "config": self.cfg.to_dict(),
            "guard": self.bridge.guard.state_dict(),
            "time_unix": time.time(),
        }
        self.writer.save_checkpoint(checkpoint_name(s.epoch + 1, self.bridge.version), params, buffers, meta, order,
                                    ranks)

    def _fault_hook(self, kind: str) -> None:
        f = self.fault
        if f is None or not f.fires(kind, self.rank, self.bridge.version):
            return
        if kind == "step":
            raise InjectedFault(f"injected fault in the training step (rank {self.rank}, round {f.round})")
        if kind == "hang":
            while True:  # the peers' watchdogs must end the job
                time.sleep(1.0)
        if kind == "nan":
            with torch.no_grad():
                self.replica.params[0].fill_(math.nan)
        if kind == "disk" and self.writer is not None:
            self.writer.flush_wait()  # what was queued before the fault is written, however slow the writer
            moved = self.writer.checkpoint_dir.with_name("checkpoints.moved-by-fault")
            self.writer.checkpoint_dir.rename(moved)
            self.writer.checkpoint_dir.write_text("not a directory (injected fault)\n")
