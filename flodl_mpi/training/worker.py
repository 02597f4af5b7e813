"""One rank's training loop: windows of batches, snapshot, round, adopt, report.

Invariant: every rank runs the same sequence of windows, rounds and epoch
exchanges — the plan is a function of the config, the data size and the world
size only (SPEC §4) — so every collective is entered in the same order, idle
ranks included. This module never calls MPI: it talks to the bridge.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import time

import numpy as np
import torch
from torch import nn

from flodl_mpi.outputs import checkpoint_room
from flodl_mpi.training import rank_state, resume_state
from flodl_mpi.errors import RankFailure
from flodl_mpi.transport.bridge import Bridge, RoundUpdate
from flodl_mpi.training.resplit import BatchQueue, lost_positions
from flodl_mpi.outputs.checkpoint_contents import CheckpointContents
from flodl_mpi.outputs.metrics import writer_or_none
from flodl_mpi.outputs.saver import saver_for
from flodl_mpi.config import TrainConfig
from flodl_mpi.training.accumulate import micro_batches
from flodl_mpi.training.data import Dataset, batch_indices, epoch_permutation, num_batches
from flodl_mpi.runtime import hooks
from flodl_mpi.training.model_record import model_record
from flodl_mpi.protocol.optimizer_state import OptimizerStateAverager, adopt_delta, resolve_mode
from flodl_mpi.protocol.outer_watch import OuterWatch
from flodl_mpi.policy.policies import Plan
from flodl_mpi.training.progress import EpochProgress
from flodl_mpi.policy.replay import RecordedPlan
from flodl_mpi.protocol.epoch_report import EPOCH_FIELDS, EpochReport, EpochSummary, aggregate_epoch, excluded_words
from flodl_mpi.runtime.signals import StopRequest
from flodl_mpi.training.best_model import BestWatch
from flodl_mpi.training.task import ClassificationTask

__all__ = ["ReplacedTensorError", "Replica", "Trainer", "state_arrays"]

#: Every this many steps a batch record carries the L2 norm of all params (SPEC §5).
PARAM_NORM_EVERY = 10

#: ``--amp``'s autocast dtype (`flodl_mpi.config.AMP_MODES`); None: no autocast.
AMP_DTYPES = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class ReplacedTensorError(ValueError):
    """A parameter or buffer the model replaced no longer fits the round's layout.

    The wire layout is planned once from the model's structure (shapes and
    dtypes); a tensor replaced by one of another shape or dtype cannot travel.
    """


def _wait_for_device(*groups) -> None:
    """Wait for the copies queued from CUDA tensors in ``groups`` (no-op for CPU tensors).

    A non-blocking device-to-host copy returns before the bytes land; the
    staging must hold them before the bridge thread reads it.
    """
    if not torch.cuda.is_initialized():  # no tensor can be on a CUDA device: nothing to look at (every round)
        return
    devices = {t.device for g in groups for t in g if t.device.type == "cuda"}
    for d in devices:
        torch.cuda.current_stream(d).synchronize()


def running_stat_decay(momentum: float | None, count_then: int, count_now: int) -> float:
    """How much of a norm layer's running statistic at a snapshot is left ``n`` updates later.

    BatchNorm's (and InstanceNorm's) update is ``r <- (1 - m)·r + m·x`` with ``m`` its
    ``momentum``, so after ``n = count_now - count_then`` training batches the value at
    the snapshot is weighted by ``(1 - m)^n``; with ``momentum=None`` the statistic is the
    cumulative mean, ``r_k = r_{k-1} + (x_k - r_{k-1}) / k``, which leaves
    ``count_then / count_now`` of it (torch.nn.BatchNorm1d docs). Async's delta adoption
    of the statistic, ``r += decay·(consensus - r_snapshot)``, then gives exactly the
    value the rank would hold had it taken the consensus at the snapshot, as for the
    optimizer's running averages (flodl_mpi.protocol.optimizer_state.adopt_delta).

    Args:
        momentum: the layer's ``momentum`` (a float in [0, 1]) or None.
        count_then: its ``num_batches_tracked`` at the snapshot (int, >= 0).
        count_now: its ``num_batches_tracked`` now.

    Returns:
        float in [0, 1]; 1.0 when no batch was tracked since the snapshot.
    """
    n = count_now - count_then
    if n <= 0:
        return 1.0
    if momentum is None:
        return count_then / count_now
    return (1.0 - float(momentum)) ** n


def _norm_layer_of(model: nn.Module, name: str) -> nn.Module | None:
    """The norm layer whose running statistic buffer ``name`` is (it tracks its batches), else None."""
    path, _, attr = name.rpartition(".")
    if attr not in ("running_mean", "running_var"):
        return None
    try:
        layer = model.get_submodule(path) if path else model
    except AttributeError:
        return None
    if not isinstance(layer, nn.modules.batchnorm._NormBase) or getattr(layer, "num_batches_tracked", None) is None:
        return None
    return layer


def _tracked_counts(layers: list[nn.Module | None]) -> list[int | None]:
    """Each layer's ``num_batches_tracked`` (None for None), read in one transfer from the device."""
    counts = [layer.num_batches_tracked for layer in layers if layer is not None]
    if not counts:
        return [None] * len(layers)
    values = iter(torch.stack([c.to(counts[0].device) for c in counts]).tolist())
    return [None if layer is None else next(values) for layer in layers]


class Replica:
    """A rank's model and the tensors that travel: params, then floating buffers.

    The order is ``named_parameters()`` then ``named_buffers()``, fixed by the
    model's structure, never filtered by rank-local state (SPEC §2 step 1).
    Integer buffers (``num_batches_tracked``) never travel: they keep their
    local values.

    Tensors are resolved **by name at every snapshot and adoption**: a module
    that re-assigns a registered buffer in ``forward`` (``self.stat =
    x.mean(0).detach()``), a parameter whose ``.data`` is replaced, or a
    parameter re-registered under its name is still averaged, and the live
    tensor receives the consensus. Each tensor's owning table
    (``_parameters`` / ``_buffers`` of its submodule) is found once by name; per
    round a tensor costs one dict look-up and two compares (same object, same
    storage), plus one look-up per submodule to notice a replaced submodule,
    whose tables are then found again.

    Args:
        model: the rank's model, already on ``device``.
        device: where the model lives.

    Raises:
        ReplacedTensorError: (from :meth:`snapshot`, :meth:`adopt`,
            :attr:`params`) a tensor was replaced by one of another shape or
            dtype, or removed; the message names it.
    """

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        #: True once :meth:`bind` made the params views of the bridge's staging.
        self.bound = False
        self._views: list[torch.Tensor] = []
        named_params = list(model.named_parameters())
        named_buffers = [(n, b) for n, b in model.named_buffers() if b.is_floating_point()]
        #: State-dict names of the travelling params and floating buffers, in wire order.
        self.param_names = [n for n, _ in named_params]
        self.buffer_names = [n for n, _ in named_buffers]
        self._param_specs = [(tuple(t.shape), t.dtype) for _, t in named_params]
        self._buffer_specs = [(tuple(t.shape), t.dtype) for _, t in named_buffers]
        # The tensors seen last, with their storage: a different object or a moved
        # storage is checked against the spec; an unchanged one costs two compares.
        self._param_seen = [(t, t.data_ptr()) for _, t in named_params]
        self._buffer_seen = [(t, t.data_ptr()) for _, t in named_buffers]
        self._plan_slots()
        self._live: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        #: The params as the last :meth:`snapshot` saw them, kept apart from the staging and
        #: from the live tensors (``keep_snapshot``: the ``delta`` adoption reads them).
        self.kept: list[torch.Tensor] = []
        #: The floating buffers at the last snapshot, likewise (``keep_snapshot``).
        self.kept_buffers: list[torch.Tensor] = []
        #: At the last kept snapshot, per floating buffer: the norm layer whose running
        #: statistic it is (else None) and that layer's ``num_batches_tracked`` then.
        self._kept_norms: tuple[list[nn.Module | None], list[int | None]] = ([], [])
        self.keep_snapshot = False

    def _plan_slots(self) -> None:
        """Find each tensor's owning table by name; note the module tree to notice a swapped submodule."""

        def owner(name: str, table: str) -> tuple[dict, str]:
            path, _, attr = name.rpartition(".")
            try:
                return getattr(self.model.get_submodule(path), table), attr
            except AttributeError:
                return {}, attr  # the submodule is gone: the tensor reads as removed

        self._param_slots = [owner(n, "_parameters") for n in self.param_names]
        self._buffer_slots = [owner(n, "_buffers") for n in self.buffer_names]
        #: Per floating buffer, the norm layer whose running statistic it is (async's delta decays those).
        self._norm_layers = [_norm_layer_of(self.model, n) for n in self.buffer_names]
        self._edges = [(m._modules, name, child) for m in self.model.modules() for name, child in m._modules.items()]

    @property
    def params(self) -> list[torch.Tensor]:
        """The live parameters, resolved by name now (``named_parameters()`` order)."""
        return self._resolve()[0]

    @property
    def float_buffers(self) -> list[torch.Tensor]:
        """The live floating buffers, resolved by name now (``named_buffers()`` order)."""
        return self._resolve()[1]

    def _resolve(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return self._resolve_changes()[:2]

    def _resolve_changes(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
        """The live params and floating buffers, and the indices of the params found changed."""
        if not all(modules.get(name) is child for modules, name, child in self._edges):
            self._plan_slots()  # a submodule was replaced: find the tables again (rare)
        params, changed = self._check(self._param_slots, self._param_seen, self._param_specs, self.param_names,
                                      "parameter")
        buffers, _ = self._check(self._buffer_slots, self._buffer_seen, self._buffer_specs, self.buffer_names,
                                 "buffer")
        return params, buffers, changed

    @staticmethod
    def _check(slots, seen, specs, names, kind: str) -> tuple[list[torch.Tensor], list[int]]:
        out, changed = [], []
        for i, (table, attr) in enumerate(slots):
            t = table.get(attr)
            last, ptr = seen[i]
            if t is not last or t.data_ptr() != ptr:
                shape, dtype = specs[i]
                if t is None or tuple(t.shape) != shape or t.dtype != dtype:
                    got = "removed" if t is None else f"replaced by a {tuple(t.shape)} {t.dtype} tensor"
                    raise ReplacedTensorError(
                        f"model {kind} {names[i]!r} was {got}; it was {shape} {dtype} when training started, and "
                        "averaging needs every parameter and buffer to keep its shape and dtype (copy new "
                        f"values into it in place, e.g. self.{attr}.copy_(...))")
                seen[i] = (t, t.data_ptr())
                changed.append(i)
            out.append(t)
        return out, changed

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

        A parameter whose ``.data`` the model later replaces (or a new
        parameter under the same name) is found at the next :meth:`snapshot`
        (one pointer compare per parameter) and bound again: its values are
        copied into its view, once.

        Returns:
            Whether the parameters were bound (False: CUDA or non-float32 params).
        """
        params = self.params
        if not all(p.device.type == "cpu" and p.dtype == torch.float32 for p in params):
            return False
        self._views = list(bridge.param_tensors)
        for i, (p, view) in enumerate(zip(params, self._views)):
            view.copy_(p.detach())
            p.data = view
            self._param_seen[i] = (p, p.data_ptr())
        self.bound = True
        return True

    @torch.no_grad()
    def snapshot(self, bridge: Bridge) -> None:
        """Copy params and floating buffers (as float32) into the bridge's staging.

        Bound params are not copied; one the model swapped out is bound again.
        The tensors found here are the ones the next :meth:`adopt` writes into.
        """
        params, buffers, changed = self._resolve_changes()
        if self.bound:
            for i in changed:  # a new parameter, or p.data replaced: bind again (one copy)
                p, view = params[i], self._views[i]
                if p.data_ptr() != view.data_ptr():
                    view.copy_(p.detach())
                    p.data = view
                    self._param_seen[i] = (p, p.data_ptr())
        else:
            # Device to host: queued without waiting (into pinned staging they run
            # asynchronously), then one wait for the stream: the bridge reads the
            # staging on another thread as soon as the round starts.
            for dst, src in zip(bridge.param_tensors, params):
                dst.copy_(src.detach(), non_blocking=True)
        for dst, src in zip(bridge.buffer_tensors, buffers):
            dst.copy_(src, non_blocking=True)
        if self.keep_snapshot:
            if not self.kept:  # allocated once, on the params' device, in their dtype: never a view of them
                self.kept = [torch.empty_like(p, memory_format=torch.contiguous_format) for p in params]
                self.kept_buffers = [torch.empty_like(b, memory_format=torch.contiguous_format) for b in buffers]
            for dst, src in zip(self.kept, params):
                dst.copy_(src.detach())
            for dst, src in zip(self.kept_buffers, buffers):
                dst.copy_(src)
            self._kept_norms = (self._norm_layers, _tracked_counts(self._norm_layers))
        _wait_for_device(params, buffers)
        self._live = (params, buffers)

    @torch.no_grad()
    def adopt(self, bridge: Bridge, alpha: float = 1.0, delta: bool = False) -> None:
        """Adopt the consensus in the staging into the live params and floating buffers, in place.

        Writes into the tensors the last :meth:`snapshot` found (the training
        thread does not touch the model while a blocking round runs); without
        one, it resolves them by name now. Without ``delta`` each param and
        floating buffer is overwritten with the consensus (the blocking policies).

        Args:
            delta: the ``async`` policy's adoption of a round the rank trained past:
                each param and floating buffer becomes
                ``theta + alpha * (consensus - theta_snapshot)``. The round averaged the
                snapshots, so the pull is computed where the round measured it, at the
                snapshot, and this rank's own steps since (``theta - theta_snapshot``)
                are kept whole. ``alpha`` 1 (``--async-adopt delta``) is the consensus
                plus those steps (delayed averaging: Shen et al. 2019, "Faster
                Distributed Deep Net Training: Computation and Communication Decoupled
                SGD", arXiv:1906.12043); ``alpha < 1`` (``--async-adopt easgd``) is
                EASGD's elastic pull ``x_i -= alpha (x_i - x_center)`` (Zhang, Choromanska
                and LeCun 2015, "Deep learning with Elastic Averaging SGD", Alg. 1) with
                the round's consensus as the center and ``x_i`` the snapshot the round
                averaged. Blending the *live* values instead (``theta + alpha (consensus -
                theta)``) would also pull back ``alpha`` of the steps trained since the
                snapshot, every round: the ranks' mean would advance at ``1 - alpha`` of
                their pace (0 at ``alpha`` 1). Needs ``keep_snapshot``.
            alpha: the pull, in (0, 1]; below 1 only with ``delta``.

        Buffers follow the params' rule: under async the rank trained on since the
        snapshot, and its buffers (BatchNorm's running statistics) moved with it;
        overwriting them with the consensus of the snapshot would throw those moves
        away at every round, and the snapshot after the adoption would hold the
        previous consensus again: the statistics would stay at the first round's.
        A norm layer's running mean and variance are running averages that forget the
        snapshot as the rank trains on: ``delta`` adds ``alpha·decay·(consensus - snapshot)``
        with the decay of its own updates since (:func:`running_stat_decay`), the value
        it would hold had it taken its pulled value at the snapshot (a variance stays >= 0).

        Raises:
            ValueError: ``alpha`` outside (0, 1], ``alpha != 1`` without ``delta``,
                ``delta`` with bound params, or ``delta`` without a kept snapshot.
        """
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        if alpha != 1.0 and not delta:
            raise ValueError("a pull alpha < 1 is computed at the snapshot: it needs delta = True")
        if delta and self.bound:
            raise ValueError("a delta adoption needs params apart from the staging; this replica is bound")
        if delta and (not self.kept or self._live is None):
            raise ValueError("a delta adoption needs the params kept at the last snapshot "
                             "(keep_snapshot = True before it)")
        if self._live is None:  # no snapshot since the last adoption: bind what changed
            params, buffers, changed = self._resolve_changes()
            for i in changed if self.bound else ():
                params[i].data = self._views[i]
                self._param_seen[i] = (params[i], params[i].data_ptr())
        else:
            params, buffers = self._live
        self._live = None
        # Host to device: asynchronous from pinned staging; the training step that
        # follows runs on the same stream, after the copies, and the bridge writes the
        # staging again only in the next round, after the next snapshot's wait.
        if delta:
            for dst, src, kept in zip(params, bridge.param_tensors, self.kept):
                if alpha == 1.0:
                    # (theta - snapshot) + consensus: the own steps first, exact 0 when there were none,
                    # so a rank that trained nothing since the snapshot takes the consensus bit for bit.
                    dst.sub_(kept).add_(src.to(dst.device, dst.dtype, non_blocking=True))
                else:
                    dst.add_(src.to(dst.device, dst.dtype, non_blocking=True) - kept, alpha=alpha)
        elif not self.bound:
            for dst, src in zip(params, bridge.param_tensors):
                dst.copy_(src, non_blocking=True)
        if delta:
            layers, then = self._kept_norms
            now = _tracked_counts(layers)
            for name, dst, src, kept, layer, k0, k in zip(self.buffer_names, buffers, bridge.buffer_tensors,
                                                          self.kept_buffers, layers, then, now):
                decay = 1.0 if layer is None else running_stat_decay(layer.momentum, k0, k)
                if decay == 1.0 and alpha == 1.0:  # the params' rule; exact consensus when nothing moved
                    dst.sub_(kept).add_(src.to(dst.device, dst.dtype, non_blocking=True))
                else:
                    adopt_delta(dst, src, kept, alpha * decay, non_negative=name.endswith("running_var"))
        else:
            for dst, src in zip(buffers, bridge.buffer_tensors):
                dst.copy_(src, non_blocking=True)

    @contextlib.contextmanager
    def consensus_in_place(self, bridge: Bridge):
        """Within the block, the live params and floating buffers hold the consensus in the staging.

        For the epoch's end of an ``async`` round carried into the next epoch: the
        rank trained on since the round's snapshot, yet every rank must evaluate and
        save the same model, the consensus. The live values are copied aside (one
        copy per tensor, allocated per call: once an epoch), the consensus is
        written in, and on leaving the block the live values are written back, so a
        regular :meth:`adopt` follows. Not for bound params (they are the staging).

        Raises:
            ValueError: the replica is bound.
        """
        if self.bound:
            raise ValueError("consensus_in_place() is for params apart from the staging; this replica is bound")
        params, buffers = self._live if self._live is not None else self._resolve()
        live = [*params, *buffers]
        with torch.no_grad():
            aside = [t.detach().clone() for t in live]
            for dst, src in zip(live, [*bridge.param_tensors, *bridge.buffer_tensors]):
                dst.copy_(src)
        try:
            yield
        finally:
            with torch.no_grad():
                for dst, src in zip(live, aside):
                    dst.copy_(src)

    @torch.no_grad()
    def param_norm(self) -> float:
        """L2 norm of all parameters together, accumulated in float64."""
        return math.sqrt(sum(float(torch.sum(p.detach().double() ** 2)) for p in self.params))


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


@dataclasses.dataclass
class _Mark:
    """The state every rank shares at a window's start (the last consensus), kept for a shrink.

    ``--on-rank-failure shrink`` only: a copy of the model and the optimizer state per window.
    """

    rows: int            # batch records of the epoch so far
    report: EpochReport  # the epoch's report so far (a copy)
    global_step: int
    model: list          # the params then the floating buffers (clones)
    optimizer: dict      # the optimizer's state dict (a deep copy)


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

    # ---- a peer's death (--on-rank-failure shrink) ----------------------------------

    def _mark(self, report: EpochReport, rows: list) -> _Mark:
        """What a window starts from, kept to go back to when its round is abandoned (`_shrink`)."""
        with torch.no_grad():
            model = [t.detach().clone() for t in (*self.replica.params, *self.replica.float_buffers)]
        return _Mark(len(rows), dataclasses.replace(report), self.global_step, model,
                     copy.deepcopy(self.optimizer.state_dict()))

    def _shrink(self, failure: RankFailure, window, mark: _Mark, rows: list) -> tuple[EpochReport, list]:
        """Go on without the ranks that died in this window's round (SPEC §9 "Shrink").

        ``self.elastic`` agrees the failed set with the other survivors and rebuilds the
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
        old_size = self.world_size
        done = self.elastic(self, failure, window)
        self.bridge, self.rank, self.world_size = done.bridge, done.rank, done.world_size
        self.writer = writer_or_none(done.writer)
        self.saver = saver_for(self.rank, self.writer)
        self.task.world_size = self.world_size
        params, buffers = self.replica.params, self.replica.float_buffers
        with torch.no_grad():
            if self.replica.bound:
                self.replica.bind(self.bridge)
            for dst, src in zip((*params, *buffers), mark.model):
                dst.copy_(src)
        self.optimizer.load_state_dict(mark.optimizer)
        self.steps, self.global_step, self.loss_finite = 0, mark.global_step, True
        self.plan = self.bridge.policy.plan()
        self.rounds_started = self.bridge.version
        self.queue = self.queue.after_change(window.end, lost_positions([window], range(old_size)))
        done.finish(self, window)
        # this rank's records of the epoch before the window, under its new rank
        return dataclasses.replace(mark.report), [(self.rank, *row[1:]) for row in rows[:mark.rows]]

    # ---- one epoch -------------------------------------------------------------

    def _epoch(self, epoch: int, cursor: int = 0) -> bool:
        """One epoch from global batch ``cursor`` on; True when a stop round ended it.

        Windows are planned over :attr:`queue` (positions; each position one global batch):
        the whole plan, or after a membership change (`_shrink`) the batches no consensus
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
            mark = self._mark(report, rows) if self.elastic is not None else None
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
                    report, rows = self._shrink(failure, window, mark, rows)
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
        summary = self.bridge.epoch_end(report, np.array(rows, dtype=np.float64), epoch)
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
        self._report(summary, stopped, cursor, report)
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

    def _report(self, s: EpochSummary, stopped: bool, cursor: int, report: EpochReport) -> None:
        cfg = self.cfg
        last = s.epoch == cfg.epochs - 1
        self.writer.check()  # a disk error on rank 0 ends the job now, not at the end
        if self.writer.writes:  # rank 0's epoch line
            partial = ""
            if stopped:
                n_batches = num_batches(self.data.train.n, cfg.step_samples, cfg.drop_last)
                partial = (f" (stopped after {cursor} of {n_batches} batches)" if cursor < n_batches else
                           " (complete: the stop came with its last round)")
            # What was measured, no more: an epoch not evaluated has no test numbers, a regression no accuracy.
            tests = "".join(f"  {name} {value:.4f}" for name, value in
                            (("val_loss", s.val_loss), ("val_acc", s.val_accuracy), ("test_loss", s.test_loss),
                             ("test_acc", s.test_accuracy)) if math.isfinite(value))
            if self.best is not None and self.best.is_best:
                tests += f"  (best {self.best.metric}" + (", kept)" if self.best.keep else ")")
            self.log(f"epoch {s.epoch + 1}/{cfg.epochs}{partial}  loss {s.avg_loss:.4f}"
                     f"{excluded_words(s.nonfinite_batches)}{tests}"
                     f"{self.task.epoch_words()}  rounds {s.rounds}  {s.epoch_ms / 1e3:.1f} s")
            self.log_detail("  per rank: " + "; ".join(
                f"r{r} {s.per_rank_throughput[r]:.0f} samples/s, {s.per_rank_batches[r]} batches, "
                f"data wait {s.per_rank_data_ms[r] / 1e3:.2f} s" for r in range(self.world_size)))
        if not stopped:  # a complete epoch's loss (every rank's watch sees the same; rank 0 says it)
            line = self.outer_watch.observe(s.epoch, s.avg_loss)
            if line is not None and self.rank == 0:
                self.warn(line)
        # Decided from the config and gathered values only: every rank agrees, and
        # every rank joins the state gather of the save.
        due = (cfg.checkpoint_every and (s.epoch + 1) % cfg.checkpoint_every == 0) or self.task.checkpoint_now
        best = self.best is not None and ((self.best.is_best and self.best.keep) or self.best.early_stopped)
        if due or last or stopped or best:  # (a new best epoch is kept: --keep-best; an early stop is the end)
            # A stop in the epoch's last window ended the epoch anyway: save it complete.
            in_epoch = stopped and cursor < num_batches(self.data.train.n, cfg.step_samples, cfg.drop_last)
            self.save_checkpoint(s, reason="graceful_shutdown" if stopped else "checkpoint",
                                 cursor=cursor if in_epoch else 0, report=report)

    def save_checkpoint(self, s: EpochSummary, reason: str, cursor: int = 0,
                        report: EpochReport | None = None) -> None:
        """Save a checkpoint: collective (each rank's state is gathered), rank 0 writes.

        ``epoch`` in the meta counts completed epochs and ``cursor`` the global
        batches of the next one already trained (non-zero after a stop mid-epoch),
        which is where a resumed run goes on; ``epoch_reports`` then holds every
        rank's report of that epoch so far.
        """
        arrays, attrs = self._rank_state()
        ranks = self.bridge.gather_to_root((arrays, attrs, dataclasses.asdict(report) if cursor else None))
        self.saver.save(lambda: self._contents(s, reason, cursor, ranks))  # rank 0 (the others gathered no state)

    def _rank_state(self) -> tuple[dict, dict]:
        """This rank's state for a checkpoint (`flodl_mpi.training.rank_state.capture`), with fp16's
        GradScaler state (``grad_scaler``: its scale and growth tracker) so a resume scales alike."""
        arrays, attrs = rank_state.capture(self.optimizer, self.global_step, self.replica.model)
        if self.scaler is not None:
            attrs["grad_scaler"] = self.scaler.state_dict()
        wire = self.bridge.wire_state(cohort=False)
        if wire is not None:  # the delta wire's error feedback: this rank's own (its reference is the cohort's)
            arrays.update(wire[2])
        return arrays, attrs

    def check_saveable(self, directory, start_epoch: int = 0) -> None:
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
        arrays, attrs = self._rank_state()

        def trial() -> CheckpointContents:
            s = aggregate_epoch(np.zeros((self.world_size, len(EPOCH_FIELDS))), -1, 0)
            contents = self._contents(s, "checkpoint", 1, [(arrays, attrs, dataclasses.asdict(EpochReport()))]
                                      * self.world_size)
            wire = self.bridge.wire_state(cohort=False)
            if wire is not None:  # the delta wire's reference, which the first round makes: in every later save
                held, more = contents.cohort or ({}, wire[1])
                sized = {f"wire_reference_{k.rsplit('/', 1)[1]}": e for k, e in wire[2].items()}  # its shape, dtype
                contents.cohort = ({**held, **sized}, more)
            return contents

        cfg = self.cfg
        best = cfg.keep_best is not None  # one more file (checkpoints/best/), and a save at any epoch may be one
        self.saver.check(directory, trial, self.optimizer, cfg.keep_checkpoints + int(best),
                         checkpoint_room.saves_ahead(cfg.epochs, start_epoch, 1 if best else cfg.checkpoint_every))

    def _queue_meta(self, cursor: int) -> dict:
        """A mid-epoch checkpoint's ``batch_queue`` after a membership change: the batches not trained yet, in
        their queue's order (a resume plans over them; `BatchQueue.state_dict`); ``{}`` otherwise."""
        if not cursor or self.queue is None or self.queue.is_whole:
            return {}
        n_batches = num_batches(self.data.train.n, self.cfg.step_samples, self.cfg.drop_last)
        return {"batch_queue": BatchQueue(self.queue.batches[cursor - (n_batches - len(self.queue)):]).state_dict()}

    def _contents(self, s: EpochSummary, reason: str, cursor: int, ranks: list) -> CheckpointContents:
        """The checkpoint of this run now, from the gathered ``(arrays, attrs, epoch report or None)``
        of every rank; its cohort state what every rank holds alike (:meth:`_cohort_state`)."""
        params, buffers, order = state_arrays(self.replica.model)
        stopped = self.task.stopped_epoch_meta() if cursor else {}  # the API's scalar books of the epoch so far
        return CheckpointContents(
            params=params, buffers=buffers, order=order,
            epoch=s.epoch + 1 if cursor == 0 else s.epoch,
            epoch_complete=cursor == 0,
            cursor=cursor,
            batches_done=s.batches,
            # A stopped epoch's row is dropped on resume: the finished epoch gets one row.
            metrics_rows={"rounds": self.bridge.version, "epochs": self.epoch_rows - (1 if cursor else 0),
                          "batches": self.batch_rows},
            elapsed_s=self.bridge.elapsed,
            round=self.bridge.version,
            global_step=self.global_step,
            reason=reason,
            world_size=self.world_size,
            test_accuracy=s.test_accuracy,
            test_loss=s.test_loss,
            test_count=s.test_count,
            config=self.cfg.to_dict(),
            guard=self.bridge.guard.state_dict(),
            policy=self.bridge.policy.state_dict(),  # the balancer (anchor, speeds, latch) and the guard
            time_unix=time.time(),
            model=model_record(self.replica.model),  # what a resume compares its model with
            # stopped mid-epoch: the resumed run finishes this epoch's report
            epoch_reports=[report for _, _, report in ranks] if cursor else None,
            epoch_scalars=stopped.pop("epoch_scalars", None),
            epoch_intents=stopped.pop("epoch_intents", None),
            extra={**stopped, **(self.best.meta() if self.best is not None else {}), **self._queue_meta(cursor)},
            ranks={r: (arrays, attrs) for r, (arrays, attrs, _) in enumerate(ranks)},
            cohort=self._cohort_state(),
        )

    def _cohort_state(self) -> tuple[dict, dict] | None:
        """What every rank holds alike, saved once (``/cohort``): the outer optimizer's state when it steps,
        and the delta wire's reference (`flodl_mpi.transport.bridge.Bridge.wire_state`); None when neither."""
        outer, wire = self.bridge.outer, self.bridge.wire_state(mine=False)
        arrays, attrs = outer.state_dict() if outer is not None and outer.kind != "avg" else ({}, {})
        if wire is not None:
            arrays, attrs = {**arrays, **wire[0]}, {**attrs, **wire[1]}
        return (arrays, attrs) if arrays or attrs else None
