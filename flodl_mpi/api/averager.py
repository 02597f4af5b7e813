"""Work-weighted parameter averaging for a training loop you already have (the PostLocalSGD shape).

Invariant: the averager only counts and averages. Your loop keeps its optimizer,
schedule, AMP scaler and clipping; after each optimizer step it calls
:meth:`Averager.step`, and every ``window`` calls a round runs in the bridge
thread (SPEC §2) and the consensus is adopted before ``step`` returns. Every rank
calls ``step`` the same number of times (in :meth:`Averager.join`, a rank out of
data makes idle calls until the gathered round says every rank is), so every
rank enters the same rounds.
"""

from __future__ import annotations

import math
import operator
import os
import time

import numpy as np
import torch
from torch import nn

from flodl_mpi.api import averager_checkpoint
from flodl_mpi.api.averager_args import check_arguments
from flodl_mpi.api.epoch_result import EpochResult, check_metrics, fill_test
from flodl_mpi.api.own_loop_front import OwnLoop
from flodl_mpi.training import scalars as _scalars
from flodl_mpi.config import TrainConfig, check_int
from flodl_mpi.policy.registry import describe as describe_policy

__all__ = ["Averager"]


class Averager:
    """Average a model across ranks from your own loop: call :meth:`step` after each optimizer step.

    Collective contract: every rank builds it with the same arguments (same
    model structure: checked), calls :meth:`step` the same number of times
    (a rank without a batch calls ``step(realized=False)``: it joins the round
    with mass 0; ranks with unequal numbers of batches run the loop in
    :meth:`join`, which makes those calls for a rank out of data), and calls
    :meth:`end_epoch` and :meth:`close` at the same points. Every ``window``-th call of :meth:`step` in an epoch runs one round, and
    :meth:`end_epoch` closes an unfinished window with one: each rank's
    parameters weighted by its realized steps since its last consensus,
    ``mass = steps ** gamma`` (SPEC §1), floating buffers averaged among ranks
    that moved, integer buffers kept local. Under plain ``python`` the world is
    one rank and the consensus is the model itself.

    Args:
        model: ``nn.Module`` with floating-point parameters, on its device. It is
            set to rank 0's parameters and buffers at construction (``broadcast``).
        comm: an ``mpi4py`` intracommunicator of the ranks that train together;
            None: ``MPI.COMM_WORLD`` (a world of 1 without a launcher).
        optimizer: your optimizer, optional. Given, the averager counts the
            optimizer steps that really happened (a post-step hook: an AMP
            ``GradScaler`` that skips a step on inf/NaN gradients makes no
            mass), clears its state when this rank is quarantined, and saves it
            in checkpoints. Without it each :meth:`step` call is one step.
        policy: ``"sync"`` (a round after every step) or ``"window"`` (after every ``window`` steps),
            or a policy registered with ``own_loop=True`` (`flodl_mpi.policy.registry`).
        window: calls of :meth:`step` per rank between rounds, >= 1 (1 with ``"sync"``).
        gamma: mass exponent, finite (SPEC §1): 1 weights by work.
        run_dir: directory for ``config.json`` (the model and optimizer as built),
            ``train.log``, ``metrics.h5`` and ``checkpoints/`` (new or empty), written
            by rank 0 as ``flodl-mpi train`` does; None: no files.
        checkpoint_every: epochs (:meth:`end_epoch` calls) between checkpoints, >= 0
            (0: only the one at :meth:`close`).
        keep_checkpoints: newest checkpoints kept, >= 1.
        stall_timeout: seconds, > 0, without progress on any rank before the job
            ends with exit status 3 (a rank hung in its step, or gone).
        on_non_finite: ``"quarantine"`` (a rank with a NaN/Inf loss or parameters
            sends mass 0 for the round and adopts the others' consensus) or ``"stop"``
            (:class:`~flodl_mpi.errors.NonFiniteError` on every rank; on one node, CPU
            parameters, the round then skips its read of the parameters before the
            gather, and after the error they may hold the consensus in part: keep
            the checkpoints, not the model).
        chunk_elems: float32 elements per Allreduce piece.
        node_reduce, hierarchical, bf16_wire: how a round's frames travel, as ``flodl-mpi train``'s
            ``--node-reduce`` (``"auto"``, ``"shm"``, ``"mpi"``), ``--hierarchical`` (``"auto"``,
            ``"on"``, ``"off"``) and ``--bf16-wire`` (params and float buffers as bfloat16 on the
            wire; SPEC §7); train.log's averaging path and metrics.h5's config record them.
        wire: what a round's frames carry, as ``flodl-mpi train --wire`` (`flodl_mpi.config.WIRES`):
            ``"fp32"``, ``"bf16"`` (``bf16_wire=True``'s alias), ``"bf16-delta"`` or ``"int8-delta"``
            (each rank's change since the last consensus, quantised, with error feedback: one Allgather
            over the world); None (default): fp32, or bf16 with ``bf16_wire``. Refused (``InputError``):
            ``bf16_wire=True`` with another wire, and a delta wire with ``node_reduce="shm"`` or
            ``hierarchical="on"``. A delta wire's reference and each rank's error feedback are saved in
            the checkpoints and restored by ``resume`` (the same world size: bit for bit).
        pin_staging: the bridge's staging in pinned (page-locked) host memory, for a model on
            CUDA; None (default): pinned when the model is on CUDA, as the CLI's.
        broadcast: start every rank from rank 0's parameters and buffers (default True).
        resume: continue the run in ``run_dir`` from its newest checkpoint: the
            consensus, this rank's optimizer state, torch RNG (CPU), step count and
            integer buffers, the round count, and where your loop goes on:
            :attr:`start_epoch` (the epochs done) and :attr:`start_step` (the step()
            calls of the next epoch done before a stop cut it short; 0 after a
            complete epoch). Start your epoch loop at ``start_epoch`` and skip the
            first ``start_step`` batches of that epoch (:meth:`batches` does), and
            the resumed run is the uninterrupted one, bit for bit, on the same
            world size when your batch order is a function of the epoch (not of
            the global RNG) and your other RNGs (numpy, CUDA) are yours to restore;
            the cut-short epoch's loss, sample counts and ``record_scalar`` sums
            carry over, so its rows read as one epoch. metrics.h5 keeps the rows
            the checkpoint had seen. A ``run_dir`` that does not exist or holds no
            checkpoint is refused (``InputError``); ``resume="auto"`` starts the run
            then, saying so. Needs ``run_dir``.
        **options: none; an unknown keyword is bad input (``InputError``), its line
            naming the closest keyword (``windw (did you mean window?)``), as ``fit``'s.

    Attributes:
        rank (int): this rank's index in ``comm``, 0 to ``world_size - 1``.
        world_size (int): the number of ranks that train together (1 under plain ``python``).
        start_epoch (int): the epochs a resumed run had done (0 for a new run): start your epoch loop here.
        start_step (int): the :meth:`step` calls a stop had made into epoch ``start_epoch + 1`` (0 after a
            complete epoch); :meth:`batches` skips that many.

    Raises:
        flodl_mpi.errors.InputError: a bad argument (the message names it as the
            signature spells it), the model differs across ranks, the run dir is
            not new or empty, or the launcher is another MPI's: every rank raises
            it; uncaught, one line from rank 0 and exit status 2.

    Failure semantics: an error on one rank of a larger world (in your loop or in
    a round) ends the whole job within seconds with exit status 1 and the rank's
    error printed (use the averager as a context manager, or let the exception
    reach the top: flodl_mpi's exception hook aborts the job); a non-finite
    consensus raises :class:`flodl_mpi.errors.NonFiniteError` on every rank alike.
    Checkpoints already written stay.

    Example (docs/tutorial/own-loop.rst has a complete one)::

        with flodl_mpi.Averager(model, optimizer=opt, run_dir="runs/a", resume=resuming) as avg:
            for epoch in range(avg.start_epoch, epochs):      # a resumed run goes on where it stopped
                for x, y in avg.batches(my_batches(epoch, avg.rank, avg.world_size)):
                    opt.zero_grad()
                    loss = loss_fn(model(x), y)
                    loss.backward()
                    opt.step()
                    avg.step(loss, samples=len(x))   # counts the step; every window steps, a round
                avg.end_epoch()             # closes the window; metrics.h5 row, checkpoint (collective)
    """

    def __init__(self, model: nn.Module, comm=None, *, optimizer: torch.optim.Optimizer | None = None,
                 policy: str = "sync", window: int = 1, gamma: float = 1.0, run_dir: str | os.PathLike | None = None,
                 checkpoint_every: int = 1, keep_checkpoints: int = 3, stall_timeout: float = 600.0,
                 on_non_finite: str = "quarantine", chunk_elems: int = 1 << 18, broadcast: bool = True,
                 resume: bool | str = False, node_reduce: str = "auto", hierarchical: str = "auto",
                 bf16_wire: bool = False, wire: str | None = None, pin_staging: bool | None = None, **options) -> None:
        # -- validate every argument (STYLE 13), agreed by every rank: bad input is one
        # line from rank 0 and exit status 2, as the CLI's (flodl_mpi.errors.InputError)
        def validate() -> TrainConfig:
            return check_arguments(Averager, model, optimizer, options, policy=policy, window=window, gamma=gamma,
                                   run_dir=run_dir, checkpoint_every=checkpoint_every,
                                   keep_checkpoints=keep_checkpoints, stall_timeout=stall_timeout,
                                   on_non_finite=on_non_finite, chunk_elems=chunk_elems, resume=resume,
                                   node_reduce=node_reduce, hierarchical=hierarchical, bf16_wire=bf16_wire,
                                   wire=wire, pin_staging=pin_staging)

        self.model, self.optimizer = model, optimizer
        self._closed = True  # until setup is complete

        # -- MPI, then everything that needs it (imported late: MPI starts in open_session)
        from flodl_mpi.errors import InputError
        from flodl_mpi.runtime.launcher import launch_env
        from flodl_mpi.runtime.session import api_words, leave_on_error, open_session
        from flodl_mpi.runtime.world import agree

        if launch_env().launcher is None:  # a world of 1: refused before MPI starts
            try:
                validate()
            except ValueError as exc:  # a combination the config refuses names the keywords (api_words)
                raise api_words(InputError(str(exc))) from None
        timeout = stall_timeout if isinstance(stall_timeout, (int, float)) and stall_timeout > 0 else 600.0
        self._session = open_session(comm, timeout)
        from flodl_mpi.outputs.metrics import NoMetricsWriter

        self._writer = NoMetricsWriter()  # rank 0 with a run dir: its MetricsWriter, once setup opens it
        try:
            self.cfg = agree(self._session.world.comm, "arguments", validate, self._session.watchdog)
            self._setup(broadcast, pin_staging)
        except BaseException as exc:
            import contextlib

            with contextlib.suppress(Exception):  # close metrics.h5: no "open for write" flag left
                self._writer.close(timeout=10.0)
            leave_on_error(self._session, exc)
            if api_words(exc) is not exc:  # the CLI's flags named as the keywords
                raise api_words(exc) from exc.__cause__
            raise
        self._closed = False

    # ---- setup -----------------------------------------------------------------------

    def _setup(self, broadcast: bool, pin_staging: bool | None) -> None:
        """The one setup (`flodl_mpi.training.setup.setup_rank`) with this own loop as its front end."""
        from flodl_mpi.training.setup import setup_rank

        world = self._session.world
        # -- counters (SPEC §2: n_r, subtracted after each adoption)
        self.steps = 0            # realized optimizer steps since the consensus last adopted
        self.global_step = 0      # this rank's realized steps in the run
        self._calls = 0           # step() calls in the current window
        self._hooked = 0          # optimizer steps seen by the hook since the last step()
        self._loss_finite = True
        self.epoch = 0            # epochs ended (end_epoch calls)
        self._saved_version = 0
        #: The latest ended epoch's test figures (accuracy, loss, count): its checkpoints' (NaN, NaN, 0: none).
        self._tests = (math.nan, math.nan, 0)
        #: Rows metrics.h5 holds per table (a checkpoint records them for a resume).
        self._metrics_rows = {"epochs": 0, "batches": 0, "scalars": 0}
        self._round_pending = False
        self._join: _Join | None = None  # the join block this rank is in (Averager.join)
        self._idle = False  # in the join's idle rounds: this rank's loop is out of data
        self.world = world
        #: This rank and the world size (1 under plain ``python``).
        self.rank, self.world_size = world.rank, world.size
        self.device = next(self.model.parameters()).device
        self.run_dir = None
        self._train_log = None
        self._hook = None
        setup_rank(self.cfg, world, self._session.watchdog, self.model, self.device,
                   OwnLoop(self, broadcast, pin_staging))
        _scalars.activate(self._book)
        if self.optimizer is not None:
            self._hook = self.optimizer.register_step_post_hook(self._count_step)
        now = time.perf_counter()  # the epoch's clock: its time before the stop, then from here
        self._t_epoch, self._t_last = now - self._carried_ms / 1e3, now
        self.bridge.start()

    def _header(self, devices: list) -> None:
        """Rank 0's train.log header, as the CLI's: a line per epoch follows, and a last line at close."""
        from flodl_mpi import __version__
        from flodl_mpi.training.train_log import log

        policy = describe_policy(self.cfg.policy, self.cfg.to_dict(), "step() call")  # the report's words too
        log.info(f"flodl-mpi {__version__}: {self.world_size} rank{'s' if self.world_size > 1 else ''}, your own "
                 f"loop (flodl_mpi.Averager), {policy}, gamma "
                 f"{self.cfg.gamma:g}, {sum(p.numel() for p in self.model.parameters())} params on {devices}; "
                 f"run dir {self.run_dir}")
        if self.world_size > 1:  # how the rounds travel (node_reduce, hierarchical, bf16_wire), as the CLI's
            from flodl_mpi.training.train import describe_averaging_path

            log.info(describe_averaging_path(self.cfg, self.bridge.reducer.path, self.bridge.reducer.nodes))

    def _log(self, line: str) -> None:
        if self._train_log is not None:
            from flodl_mpi.training.train_log import log

            log.info(line)

    def _say(self, line: str) -> None:
        """Rank 0: a line of the run's events in train.log and on the terminal (stderr)."""
        if self.rank == 0:
            import sys

            self._log(line)
            print(f"flodl-mpi: {line}", file=sys.stderr, flush=True)

    def _count_step(self, optimizer, args, kwargs) -> None:
        self._hooked += 1

    def _new_epoch(self) -> None:
        self._t_epoch = self._t_last = time.perf_counter()
        self._loss_sum, self._batches, self._samples, self._compute_ms = 0.0, 0, 0, 0.0
        self._nonfinite = 0  # batches with a given loss that was NaN/Inf: out of _loss_sum, counted
        self._samples_known = True  # every realized step of the epoch gave samples=
        self._epoch_calls = 0  # step() calls in this epoch: end_epoch() and close() check they agree
        self._rows: list[tuple] = []

    # ---- the loop's side ----------------------------------------------------------------

    def step(self, loss=None, *, realized: bool | None = None, samples: int | None = None):
        """Count one step of this rank; every ``window`` calls, run a round and adopt its consensus.

        Collective: every rank calls it the same number of times (a round is
        entered on every ``window``-th call). Blocks for the round's duration.

        Args:
            loss: this step's loss (float or one-element tensor), optional: its
                finiteness decides quarantine (SPEC §2) and it is the
                ``avg_loss`` of ``metrics.h5`` (NaN, "not recorded", for an epoch in
                which a step of the rank gave none). A tensor costs a ``.item()`` (a sync point).
            realized: whether an optimizer step happened. Default: with an
                ``optimizer`` given, the steps its post-step hook counted since
                the last call (0 when an AMP scaler skipped it); else True.
                ``realized=False``: this rank had no batch; it joins the round with mass 0.
            samples: samples in this step's batch, int >= 0, for the ``per_rank_samples``
                and ``per_rank_throughput`` columns; an epoch in which a step of
                this rank did not give it records -1 samples ("not recorded") and
                NaN throughput for the rank, not a made-up count.

        Returns:
            The round's :class:`flodl_mpi.transport.bridge.RoundUpdate` when a round ran, else None.

        Raises:
            RuntimeError: after :meth:`close`.
            flodl_mpi.errors.NonFiniteError: the same on every rank (see ``on_non_finite``).
            flodl_mpi.errors.CohortError: the same on every rank: another rank reached
                :meth:`end_epoch` or :meth:`close` after fewer calls (names each rank's count).
            flodl_mpi.errors.RoundError: the round failed on this rank.
            flodl_mpi.Stopped: a stop signal (SIGUSR1, SIGTERM, Ctrl-C) reached some rank:
                every rank raises it after this round, the checkpoint saved (with
                ``run_dir``) and the averager closed; uncaught, exit status 4.
        """
        if self._closed:
            raise RuntimeError("Averager.step() after close()")
        if samples is not None:
            check_int(operator.index(samples) if hasattr(samples, "__index__") else samples, "samples", 0)
        if realized is None:
            n = self._hooked if self.optimizer is not None else 1
        else:
            n = 1 if realized else 0
        if self._join is not None:
            self._join.settled = False  # this rank stepped: its join is not over
        return self._count(loss, n, samples)

    def _count(self, loss, n: int, samples: int | None):
        """One step() call of ``n`` realized steps (0: an idle call); every ``window`` calls, the round."""
        self._hooked = 0
        now = time.perf_counter()
        batch_ms = 1e3 * (now - self._t_last)
        self._t_last = now
        loss_value = math.nan
        if loss is not None:
            loss_value = float(loss.item() if hasattr(loss, "item") else loss)
            self._loss_finite = self._loss_finite and math.isfinite(loss_value)
        self.steps += n
        self.global_step += n
        self._calls += 1
        self._epoch_calls += 1
        if n:
            self._batches += 1
            if loss is not None and not math.isfinite(loss_value):
                self._nonfinite += 1  # quarantined by the round: out of the epoch's loss, counted
            else:
                self._loss_sum += loss_value  # NaN without a loss: avg_loss says "not recorded", not 0
            if samples is None:
                self._samples_known = False
            else:
                self._samples += operator.index(samples)
            self._compute_ms += batch_ms
            if self.run_dir is not None:
                lr = self.optimizer.param_groups[0]["lr"] if self.optimizer is not None else math.nan
                self._rows.append((self.rank, self.epoch + 1, self.global_step, batch_ms, math.nan, loss_value,
                                   float(lr), math.nan))
        self._session.watchdog.progress(f"step {self.global_step}")
        if self._calls < self.cfg.window:
            return None
        try:
            return self._round()
        except BaseException as exc:
            words = self._failing(exc)
            if words is exc:
                raise
            raise words from exc.__cause__

    def join(self) -> _Join:
        """A context manager for loops whose ranks have unequal numbers of batches (``torch.distributed``'s ``Join``).

        ``with avg.join(): for batch in mine: ... avg.step(...)``. A rank whose loop
        leaves the block (or calls :meth:`end_epoch` or :meth:`close` inside it) while
        others still step goes on as an idle rank: it makes ``step(realized=False)``
        calls, so it enters every round the others enter, with the steps it had not
        averaged yet in its first one and mass 0 (SPEC §1: nothing of its
        parameters in the consensus) after that, adopting each consensus. It stops
        after the first round in which every rank is out of data: each rank says so
        in the round's control gather (``joined``), so the decision is the gathered
        matrix's, the same on every rank, and every rank leaves in that round, after
        as many ``step()`` calls. :meth:`end_epoch` and :meth:`close` then see equal
        counts. The decision costs one round after the last rank's last step (a
        skipped one, a control gather only, when no rank has steps left to average).

        Every rank must use the join around the same loop (a rank outside one that
        reaches :meth:`end_epoch` while another idles in one gets the
        unequal-count :class:`~flodl_mpi.errors.CohortError`, as without join).
        Inside the block, :meth:`end_epoch` idles until every rank is out of data,
        then ends the epoch for all (so one join may hold the whole epoch loop); the
        block's exit right after an :meth:`end_epoch` runs no round. An exception
        leaving the block runs no round (the job ends as any error ends it).

        Returns:
            The context manager; ``with avg.join() as a`` binds the averager.

        Raises:
            RuntimeError: after :meth:`close`, or inside another ``join()`` of this averager.
        """
        if self._closed:
            raise RuntimeError("Averager.join() after close()")
        return _Join(self)

    def shard(self, n_samples: int, epoch: int, *, batch_size: int, seed: int = 0, drop_last: bool = False,
              uneven: str = "join"):
        """This rank's batches of ``epoch`` under the CLI's plan: :func:`flodl_mpi.shard` with this averager's
        rank, world size and window (``for idx in avg.batches(avg.shard(len(data), epoch, batch_size=32)): ...``).

        Arguments, return value and errors as :func:`flodl_mpi.shard`'s (``uneven="join"``: run the loop in
        :meth:`join`, the ranks' counts may differ by up to ``window``).
        """
        from flodl_mpi.training.shard import shard

        return shard(n_samples, epoch, seed, batch_size=batch_size, rank=self.rank, world_size=self.world_size,
                     window=self.cfg.window, drop_last=drop_last, uneven=uneven)

    def _join_rounds(self) -> None:
        """Collective: idle step() calls (mass 0) until the round in which every rank sends ``joined`` 1."""
        self._idle = True
        try:
            while True:
                update = self._count(None, 0, None)
                if update is not None and update.all_joined:  # gathered: every rank leaves in this round
                    return
        finally:
            self._idle = False

    def _leave_join(self) -> None:
        """A join block's normal exit: its idle rounds, an error in them raised in the API's words."""
        try:
            self._join_rounds()
        except BaseException as exc:  # the exception itself, or its API words (_failing), with its cause
            raise self._failing(exc) from exc.__cause__

    def batches(self, batches):
        """Your epoch's batches less those a stopped run trained already: ``for b in avg.batches(mine): ...``.

        The first call after a resume skips the first :attr:`start_step` items of
        ``batches`` (the step() calls the cut-short epoch had made: see the class
        docstring); every other call passes ``batches`` through. Call it once per
        epoch, on the batches you call :meth:`step` for, in the same order as the
        stopped run (derive the epoch's order from the epoch, not from the global
        RNG). The skipped items are iterated past (a DataLoader loads them); to
        skip without loading, start your own index at :attr:`start_step` instead.

        Args:
            batches: any iterable.

        Returns:
            An iterator over the items left.
        """
        import itertools

        skip, self._skip = self._skip, 0
        return itertools.islice(batches, skip, None)

    def _round(self, final: bool = False):
        t0 = time.perf_counter()  # the snapshot's and the adoption's copies: rounds/snapshot_ms, adopt_ms
        self.replica.snapshot(self.bridge)
        self.bridge.add_training_ms("snapshot", 1e3 * (time.perf_counter() - t0))
        stop = self._session.stop is not None and self._session.stop.requested
        update = self.bridge.round(self.steps, self._calls, stop=stop, loss_finite=self._loss_finite,
                                   calls=self._epoch_calls, joined=1.0 if self._idle else 0.0)
        self._calls, self._loss_finite = 0, True
        self._round_pending = True
        if update.adopted and not self.bridge.alone:  # a world of one's consensus is its own values
            t0 = time.perf_counter()
            self.replica.adopt(self.bridge)
            self.bridge.add_training_ms("adopt", 1e3 * (time.perf_counter() - t0))
        elif update.adopted:  # a world of one adopts in place: no time (0, not "not recorded")
            self.bridge.add_training_ms("adopt", 0.0)
        if update.quarantined:  # gathered: the same on every rank; rank 0 says it, as fit does
            self._say(f"round {update.version - 1}: rank(s) {', '.join(map(str, update.quarantined))} had a "
                      "non-finite loss or NaN/Inf parameters: quarantined (mass 0), adopted the consensus")
        if self.rank in update.quarantined and self.optimizer is not None:
            self.optimizer.state.clear()  # the non-finite step most likely poisoned it
        self.steps -= update.steps_at_snapshot  # subtract, don't zero (SPEC §2 step 8)
        self._t_last = time.perf_counter()  # the round is not the next step's compute
        if update.stop and not final:  # gathered: every rank stops after this round
            self._stop_now()
        return update

    def _stop_now(self) -> None:
        """A stop signal reached some rank: save (collective), close, raise :class:`Stopped` on every rank."""
        from flodl_mpi.errors import Stopped

        stop = self._session.stop
        self._flush_round()  # the stop round's row reaches metrics.h5 before the writer closes
        # An epoch the stop cut short (end_epoch() not called) is saved incomplete, named as the CLI's
        # mid-epoch stop: the epoch it stopped in, "epoch" counting the epochs done.
        complete = self._epoch_calls == 0
        self._write_cut_rows()  # the batches of the epoch the stop cut short, before the save counts them
        if self.run_dir is not None:
            averager_checkpoint.save(self, None, "graceful_shutdown", complete=complete)
        where = (f"checkpoint saved in {self.run_dir / 'checkpoints'}; run the same script with resume=True "
                 "to go on" if self.run_dir is not None else "no run_dir: nothing was saved")
        at = f"in epoch {self.epoch + 1}" if not complete else f"at the end of epoch {self.epoch}"
        line = (f"stopped on request ({stop.signal_name or 'a stop signal'}) {at} "
                f"after round {self.bridge.version}; {where}; exit status 4")
        # train.log records the stop (flodl-mpi report counts it) and ends with the stop's last line, as fit's
        rounds = f"{self.bridge.version} round{'' if self.bridge.version == 1 else 's'}"
        last = (f"stopped, not done: {self.epoch} epoch(s) of your loop, {rounds}; "
                "exit status 4: to go on, run the same script with resume=True")
        self._finish(last=[line, last])
        self._session.close()
        if self.rank == 0:
            import sys

            print(f"flodl-mpi: {line}", file=sys.stderr, flush=True)
        raise Stopped(stop.signal_name, self.bridge.version)

    def _flush_round(self) -> None:
        """Collective: a boundary gather that carries the last round's acks, so its ``rounds`` row is written."""
        if self._round_pending:
            self.bridge.boundary(2, self._epoch_calls)
            self._round_pending = False

    def end_epoch(self, metrics: dict | None = None) -> EpochResult:
        """Close an epoch for the cohort: exchange reports, write ``metrics.h5`` rows, checkpoint when due.

        Collective: every rank calls it at the same point (after the same number
        of :meth:`step` calls). An unfinished window (calls since the last round)
        is closed with a round first, as ``flodl-mpi train`` closes an epoch's
        last window, so the checkpoint and every rank's model are the consensus of
        every rank's steps; windows count afresh from each epoch's start. The
        ``metrics`` you pass were measured before that round, on this rank's model.

        Args:
            metrics: this rank's evaluation sums, ``{name: (sum, count)}`` (e.g.
                over its slice of a test set); the cohort's value is
                ``Σ sum / Σ count``. ``loss`` and ``accuracy`` also fill the
                ``test_loss`` / ``test_accuracy`` columns.

        Returns:
            :class:`EpochResult`, identical on every rank.

        Raises:
            TypeError: ``metrics`` is not a dict of ``(sum, count)`` pairs.
            flodl_mpi.Stopped: a stop signal rode the round that closed the window:
                the epoch ended (its rows written), then as in :meth:`step`.
            flodl_mpi.errors.CohortError: on every rank alike, when the ranks called
                :meth:`step` a different number of times in this epoch (one line
                naming each rank and its count; exit status 1 uncaught).
        """
        if self._closed:
            raise RuntimeError("Averager.end_epoch() after close()")
        sums = check_metrics(metrics)
        try:
            if self._join is not None:  # in a join: every rank out of data first (equal counts)
                self._join_rounds()
            result = self._end_epoch(sums)
            if self._join is not None:
                self._join.settled = True  # the epoch ended for every rank: the block's exit runs no round
            return result
        except BaseException as exc:
            words = self._failing(exc)
            if words is exc:
                raise
            raise words from exc.__cause__

    def _end_epoch(self, sums: dict[str, tuple[float, float]]) -> EpochResult:
        from flodl_mpi.protocol.epoch_report import EpochReport, excluded_words

        # Shaped like a round: a peer still in step() sees this rank's end in its round (clear error, not a hang)
        self.bridge.boundary(1, self._epoch_calls)
        stop = False
        if self._calls:  # the same count on every rank (the boundary checked): the epoch's last window is short
            # closed with a round, as the CLI closes an epoch's last window: the checkpoint below, and the
            # model every rank goes on from, are the consensus of everyone's steps (not rank 0's own)
            stop = self._round(final=True).stop  # gathered: a stop in it ends the run after this epoch's end
        report = EpochReport(loss_sum=self._loss_sum, batches=self._batches, nonfinite_batches=self._nonfinite,
                             samples=self._samples if self._samples_known else -1,
                             epoch_ms=1e3 * (time.perf_counter() - self._t_epoch), compute_ms=self._compute_ms)
        fill_test(report, sums)
        boundary = _scalars.exchange(self.bridge.allgather, self._book, self._batches, sums)
        summary = self.bridge.epoch_end(report, np.array(self._rows, dtype=np.float64), self.epoch)
        self._round_pending = False
        self.epoch += 1
        self._tests = (summary.test_accuracy, summary.test_loss, summary.test_count)
        path = None
        rows = _scalars.scalar_rows(self.epoch, {**boundary.scalars, **boundary.eval_values},
                                    {**boundary.counts, **boundary.eval_counts}, boundary.per_rank, self.world_size)
        self._metrics_rows["epochs"] += 1
        self._metrics_rows["batches"] += summary.batch_records
        self._metrics_rows["scalars"] += 0 if rows is None else len(rows["epoch"])
        if rows is not None:
            self._writer.append("scalars", rows)
        due = self.cfg.checkpoint_every and self.epoch % self.cfg.checkpoint_every == 0
        if self.run_dir is not None and (due or "checkpoint" in boundary.intents) and not stop:
            path = averager_checkpoint.save(self, summary, "checkpoint")
        tests = "".join(f"  test_{k} {v:.4f}" for k, v in boundary.metrics.items())
        self._log(f"epoch {self.epoch}  loss {summary.avg_loss:.4f}{excluded_words(summary.nonfinite_batches)}"
                  f"{tests}  rounds {summary.rounds}  "
                  f"{summary.epoch_ms / 1e3:.1f} s")
        self._new_epoch()
        if stop:  # the stop came with the epoch's last round: the epoch is complete, saved as such (the CLI's)
            self._stop_now()
        return EpochResult(self.epoch, summary, dict(boundary.scalars), dict(boundary.metrics), boundary.intents,
                           path)

    def request(self, intent: str) -> None:
        """Ask for ``"checkpoint"`` (saved at the next :meth:`end_epoch`, whoever asks) or ``"eval"``
        (reported in the next :class:`EpochResult`'s ``intents`` on every rank)."""
        self._book.request(intent)

    # ---- the end ------------------------------------------------------------------

    def close(self) -> None:
        """Average any unfinished window, save the last checkpoint (with a run dir), stop the bridge.

        Collective: every rank calls it (idempotent). Afterwards the model holds
        the cohort's consensus on every rank.
        """
        if self._closed:
            return
        try:
            if self._join is not None and not self._join.settled:  # in a join: every rank out of data first
                self._join_rounds()
            self._close()
        except BaseException as exc:
            words = self._failing(exc)
            if words is exc:
                raise
            raise words from exc.__cause__

    def _close(self) -> None:
        self.bridge.boundary(2, self._epoch_calls)  # every rank here after as many step() calls, or an error
        self._round_pending = False  # the boundary carried the last round's acks
        if self._calls:  # the same count on every rank: a last round for the pending steps
            self._round(final=True)  # a stop asked now ends nothing: the run is done
            self._flush_round()  # its row reaches metrics.h5 before the writer closes
        if self._epoch_calls:  # the same count on every rank: steps after the last end_epoch()
            self._write_cut_rows()
        if self.run_dir is not None and self.bridge.version != self._saved_version:
            averager_checkpoint.save(self, None, "checkpoint", complete=self._epoch_calls == 0)
        last = None
        if self.run_dir is not None:
            rounds = f"{self.bridge.version} round{'' if self.bridge.version == 1 else 's'}"
            last = [(f"done: {self.epoch} epoch(s) of your loop, {rounds}; metrics "
                     f"{self.run_dir / 'metrics.h5'}, checkpoints {self.run_dir / 'checkpoints'}")]
        self._finish(last=last)
        self._session.close()

    def _finish(self, last: list[str] | None = None) -> None:
        """Local clean-up: bridge thread, writer, hook, scalar book, train.log (ending with the ``last`` lines)."""
        self._closed = True
        if self._hook is not None:
            self._hook.remove()
        _scalars.activate(None)
        self.bridge.close()
        self._writer.close(timeout=None)
        for line in last or ():
            self._log(line)
        from flodl_mpi.training.train_log import close_train_log

        close_train_log(self._train_log)
        self._train_log = None
        if self.run_dir is not None:
            from flodl_mpi.outputs import run_dir_lock

            run_dir_lock.release(self.run_dir)  # the run is over: the directory is free for the next one

    def _write_cut_rows(self) -> None:
        """Collective: the batch rows of an epoch :meth:`end_epoch` did not close reach metrics.h5.

        A stop, :meth:`close` after more steps, or a cohort-wide error cut the epoch
        short; its batches were trained, so the ``batches`` table holds them (the
        ``epochs`` table gets no row: the epoch did not end). Every rank calls it at
        the same point: after a round or boundary check that every rank passed, or
        that raised the same :class:`CohortError` on every rank (then the bridge is
        done, on every rank, and the rows go over its communicator directly).
        """
        from flodl_mpi.errors import RoundError
        from flodl_mpi.protocol.epoch_report import BATCH_COLUMNS

        if self.run_dir is None:  # no rows were kept (the same on every rank: the run dir is agreed)
            return
        rows = np.array(self._rows, dtype=np.float64).reshape(-1, len(BATCH_COLUMNS))
        self._rows = []
        try:
            gathered = self.bridge.gather_to_root(rows)
        except RoundError:  # the bridge failed (before any collective): its thread is done
            from mpi4py.util import pkl5

            gathered = pkl5.Intracomm(self.bridge.comm).gather(rows, root=0)
        if gathered is None:  # not rank 0
            return
        table = np.concatenate(gathered)
        self._metrics_rows["batches"] += len(table)  # rank 0's count: the checkpoints' metrics_rows
        if len(table):
            from flodl_mpi.outputs.recorder import batch_columns

            self._writer.append("batches", batch_columns(table))

    def _failing(self, exc: BaseException) -> BaseException:
        """An error leaves :meth:`step`, :meth:`end_epoch` or :meth:`close`: the exception to raise.

        A :class:`CohortError` (the same on every rank, decided from a gathered
        verdict: unequal step counts, non-finite values) writes the cut-short
        epoch's batch rows first, and names ``fit``'s keywords, not the CLI's flags
        (``on_non_finite='stop'``); train.log ends with it.
        """
        import contextlib

        from flodl_mpi.errors import CohortError
        from flodl_mpi.runtime.session import api_words

        if isinstance(exc, CohortError) and not self._closed:
            with contextlib.suppress(Exception):  # the error is the news: the rows are a courtesy
                self._write_cut_rows()
        words = api_words(exc)
        self._note_failure(words)
        return words

    def _note_failure(self, exc: BaseException) -> None:
        """train.log ends with why the run failed, as the CLI's (a cohort error: rank 0's line; a rank's own: its)."""
        from flodl_mpi.errors import Stopped

        if self.run_dir is None or isinstance(exc, Stopped) or getattr(exc, "_flodl_noted", False):
            return
        from flodl_mpi.training.train_log import note_failure

        note_failure(self.run_dir, self.rank, exc)
        try:
            exc._flodl_noted = True  # once, whether the averager or its context manager sees it first
        except AttributeError:
            pass

    def __enter__(self) -> Averager:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        from flodl_mpi.errors import Stopped

        if exc is None:
            self.close()
            return False
        if isinstance(exc, Stopped) and self._closed:  # every rank stopped after the same round, saved, closed
            return False
        from flodl_mpi.runtime.session import leave_on_error, leaves_together

        self._note_failure(exc)  # an error of your loop too: train.log says why the run ended
        if leaves_together(self._session, exc):  # the one abort decision (flodl_mpi.runtime.world.decide)
            import contextlib

            self._closed = True
            with contextlib.suppress(Exception):
                self._finish()
        leave_on_error(self._session, exc)  # aborts the job unless the ranks can leave together
        return False


class _Join:
    """:meth:`Averager.join`'s context manager: on a normal exit, idle rounds until every rank is out of data."""

    def __init__(self, avg: Averager) -> None:
        self.avg = avg
        #: No step() since an end_epoch() in this block: the exit needs no round (every rank ended the epoch).
        self.settled = False

    def __enter__(self) -> Averager:
        if self.avg._join is not None:
            raise RuntimeError("Averager.join() inside another join() of the same averager")
        self.avg._join = self
        return self.avg

    def __exit__(self, exc_type, exc, tb) -> bool:
        avg = self.avg
        avg._join = None
        if exc is None and not avg._closed and not self.settled:
            avg._leave_join()
        return False
