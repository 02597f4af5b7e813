"""A rank's replica: its model and the tensors that travel in a round (params, then floating buffers).

Invariant: the wire order is ``named_parameters()`` then the floating ``named_buffers()``,
fixed by the model's structure, never by rank-local state (SPEC §2 step 1); every
snapshot and adoption resolves the live tensors by name, so a replaced tensor of the
same shape and dtype is still averaged, and one of another shape or dtype is refused
(`ReplacedTensorError`). No MPI here: the snapshot and the adoption copy to and from
the bridge's staging.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch
from torch import nn

from flodl_mpi.protocol.optimizer_state import adopt_delta
from flodl_mpi.transport.bridge import Bridge

__all__ = ["ReplacedTensorError", "Replica", "running_stat_decay", "state_arrays"]


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
