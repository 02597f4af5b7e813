"""Optimizer state under averaging (issue 12): which state travels, and Adam's second moment.

Invariant: the plan is made once from the optimizer's structure (its class, its
param groups and the keys and shapes its state takes, found by a step on
``meta`` copies of the parameters), never from a rank-local fact, so every
rank's frame has the same layout. Step counters and integer or scalar state
never travel: each rank keeps its own. Pure math: no MPI, no threads.

Why a second moment is rebuilt rather than averaged. After one step from the
consensus state ``(m_prev, v_prev)`` rank r holds ``m_r = β1·m_prev + (1-β1)·g_r``
and ``v_r = β2·v_prev + (1-β2)·g_r²`` (Kingma & Ba 2015, arXiv:1412.6980, Alg. 1).
Their mean keeps ``m`` exact but gives ``mean_r(g_r²) = ḡ² + Var_r(g_r)``: the
ranks' disagreement counts as gradient noise, and the step shrinks (measured:
0.73x DistributedDataParallel's at 2 ranks, 0.63x at 3; benchmarks/README.md).
DDP's optimizer sees ``ḡ``. Since ``m`` is linear in ``g``, the mean gradient
is recovered from the averaged first moment and the previous consensus,
``ḡ = (m̄ - β1·m_prev) / (1-β1)``, and ``v = β2·v_prev + (1-β2)·ḡ²`` is DDP's
second moment, exactly, with no extra bytes: ``v`` does not even travel
(:func:`rebuild_second_moment`; the general form for windows is there).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from flodl_mpi.config import AVERAGE_OPTIMIZER_STATE

__all__ = ["AVERAGE_OPTIMIZER_STATE", "COUNTER_KEYS", "NON_NEGATIVE_KEYS", "OptimizerStateAverager", "StateEntry",
           "StatePlan", "adopt_delta", "decay_base", "rebuild_second_moment", "resolve_mode"]

#: State keys that count, whatever their shape (Adam's ``step`` is a 0-d float
#: tensor, NAdam's ``mu_product`` too: each would pass for a 0-d parameter's state).
COUNTER_KEYS = frozenset({"step", "mu_product"})

#: State keys that hold a running average of squares (or a maximum of them), never negative:
#: Adam's ``exp_avg_sq`` and AMSGrad's ``max_exp_avg_sq``, Adamax's ``exp_inf``, RMSprop's
#: ``square_avg``, Adagrad's ``sum``, Adadelta's ``acc_delta``. A delta adoption clamps them at 0.
NON_NEGATIVE_KEYS = frozenset({"exp_avg_sq", "max_exp_avg_sq", "exp_inf", "square_avg", "sum", "acc_delta"})


def resolve_mode(mode: str, optimizer: torch.optim.Optimizer) -> str:
    """``auto`` made concrete: ``corrected`` for an optimizer with an Adam-family
    second moment (``exp_avg`` and ``exp_avg_sq`` with ``betas``), else ``off``.

    Measured (benchmarks/README.md, "convergence.py"): averaging the state brings
    Adam and AdamW to DDP's accuracy; SGD's momentum under sync needs nothing.

    Raises:
        ValueError: an unknown mode.
    """
    if mode not in AVERAGE_OPTIMIZER_STATE:
        raise ValueError(f"mode must be one of {', '.join(AVERAGE_OPTIMIZER_STATE)}, got {mode!r}")
    if mode != "auto":
        return mode
    plan = StatePlan(optimizer, correct=True)
    return "corrected" if plan.pairs else "off"


@dataclass(frozen=True)
class StateEntry:
    """One state tensor that travels (or is rebuilt): ``optimizer.state[param][key]``.

    Attributes:
        index: the parameter's index in the optimizer's param groups, in order
            (the index ``optimizer.state_dict()`` uses).
        key: the state key, e.g. ``exp_avg``.
        shape: the parameter's shape (the entry's, too).
    """

    index: int
    key: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class MomentPair:
    """An Adam-family parameter's moments: where ``m`` travels and where ``v`` is kept.

    Attributes:
        first: position of ``exp_avg`` among :attr:`StatePlan.wire`.
        second: position of ``exp_avg_sq`` among :attr:`StatePlan.rebuilt`.
        beta1, beta2: the group's ``betas``.
    """

    first: int
    second: int
    beta1: float
    beta2: float


class StatePlan:
    """Which optimizer state travels, planned once from the optimizer's structure.

    The floating state tensors shaped like their parameter (momentum buffers,
    Adam's moments, RMSprop's averages, ...) are found by one step of a copy of
    the optimizer, with the same class and param groups, on ``meta`` copies of
    the parameters with zero gradients: it allocates nothing, and touches
    neither the optimizer nor its parameters. Keys in :data:`COUNTER_KEYS`,
    integer tensors and tensors of another shape stay local.

    Args:
        optimizer: the rank's optimizer (its state may be empty: before the first step).
        correct: recognise the Adam family (``exp_avg`` and ``exp_avg_sq`` in the
            state, ``betas`` in the group) and rebuild its second moment
            (:func:`rebuild_second_moment`) instead of averaging it.

    Attributes:
        wire: entries averaged (mass-weighted mean), in travel order: parameters
            in param-group order, keys sorted.
        rebuilt: second moments rebuilt from the averaged first moment (empty
            unless ``correct``); they never travel.
        pairs: one :class:`MomentPair` per rebuilt entry.

    Raises:
        ValueError: the optimizer's state cannot be found this way (its step
            fails on meta tensors); the message names the optimizer.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, correct: bool = True) -> None:
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        keys, groups = _probe(optimizer)
        #: Each parameter's group settings (hyperparameters), by parameter index.
        self.groups = groups
        self.wire: list[StateEntry] = []
        self.rebuilt: list[StateEntry] = []
        self.pairs: list[MomentPair] = []
        for index, p in enumerate(self.params):
            shape = tuple(p.shape)
            group = groups[index]
            found = keys.get(index, [])
            adam = correct and {"exp_avg", "exp_avg_sq"} <= set(found) and _betas(group) is not None
            for key in sorted(found):
                entry = StateEntry(index, key, shape)
                if adam and key == "exp_avg_sq":
                    continue
                self.wire.append(entry)
                if adam and key == "exp_avg":
                    beta1, beta2 = _betas(group)
                    self.pairs.append(MomentPair(len(self.wire) - 1, len(self.rebuilt), beta1, beta2))
                    self.rebuilt.append(StateEntry(index, "exp_avg_sq", shape))

    @property
    def wire_shapes(self) -> list[tuple[int, ...]]:
        return [e.shape for e in self.wire]

    @property
    def wire_bytes(self) -> int:
        """float32 bytes of the travelling state (the mass slot not counted)."""
        return 4 * sum(math.prod(e.shape) for e in self.wire)


def _betas(group: dict) -> tuple[float, float] | None:
    betas = group.get("betas")
    try:
        b1, b2 = (float(b) for b in betas)
    except (TypeError, ValueError):
        return None
    return (b1, b2) if 0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0 else None


def _probe(optimizer: torch.optim.Optimizer) -> tuple[dict[int, list[str]], list[dict]]:
    """Step a meta copy of ``optimizer``; the param-shaped floating keys per parameter index."""
    groups, meta_groups, owner = [], [], []
    for group in optimizer.param_groups:
        clones = [torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=True)
                  for p in group["params"]]
        settings = {k: v for k, v in group.items() if k != "params"}
        meta_groups.append({**settings, "params": clones})
        groups += [settings] * len(clones)
        owner += clones
    try:
        # The groups carry every hyperparameter; the constructor gets the defaults it takes.
        takes = inspect.signature(type(optimizer).__init__).parameters
        probe = type(optimizer)(meta_groups, **{k: v for k, v in optimizer.defaults.items() if k in takes})
        for p in owner:
            p.grad = torch.zeros_like(p)
        probe.step()
    except Exception as exc:  # noqa: BLE001 - a foreign optimizer may not take meta tensors
        raise ValueError(f"cannot find which state of {type(optimizer).__name__} to average (a step on meta "
                         f"tensors failed: {type(exc).__name__}: {exc}); use --average-optimizer-state off") from None
    keys: dict[int, list[str]] = {}
    for index, p in enumerate(owner):
        for key, value in probe.state.get(p, {}).items():
            if (key not in COUNTER_KEYS and torch.is_tensor(value) and value.is_floating_point()
                    and value.device.type == "meta" and tuple(value.shape) == tuple(p.shape)):
                keys.setdefault(index, []).append(key)
    return keys, groups


def rebuild_second_moment(m_bar: np.ndarray, m_prev: np.ndarray, v_prev: np.ndarray, weights: Sequence[float],
                          steps: Sequence[float], beta1: float, beta2: float, out: np.ndarray) -> None:
    """DDP's second moment from the averaged first moment: ``out = B2·v_prev + (1-B2)·ḡ²``.

    With ``B1 = Σ_r w_r·β1^k_r`` and ``B2 = Σ_r w_r·β2^k_r`` (``w`` the round's
    masses normalised to sum 1, ``k_r`` rank r's optimizer steps since the
    consensus), ``ḡ = (m̄ - B1·m_prev) / (1-B1)``.

    Exact (up to float32 rounding) when every contributing rank took one step
    from ``(m_prev, v_prev)`` (``--policy sync``; idle ranks have weight 0): then
    ``ḡ`` is the weighted mean of the ranks' gradients and ``out`` is the second
    moment Adam would hold after a step on ``ḡ``, as under DDP (the module
    docstring). With windows of ``k > 1`` steps it assumes each rank's gradient
    constant over its window: ``m_r = β1^k m_prev + (1-β1^k) g_r``; the
    gradients' variance *within* a window, which DDP's ``v`` would count, is
    then left out, and a rank whose window differs (cadence) enters through
    its ``β^k_r``. Weights with no step at all (a synthetic round that hands a
    quarantined rank the last consensus back: ``B1 == 1``) leave ``v_prev``.

    Args:
        m_bar, m_prev, v_prev: float32 arrays of one shape: the averaged first
            moment, and the consensus moments the ranks started the window from.
        weights: every rank's mass (any scale; 0 for idle or quarantined ranks).
        steps: every rank's optimizer steps since the consensus.
        beta1, beta2: the optimizer's ``betas``.
        out: float32, the same shape; may be ``v_prev``.
    """
    w = np.asarray(weights, dtype=np.float64)
    k = np.asarray(steps, dtype=np.float64)
    w = w / w.sum()
    b1 = float(np.dot(w, np.power(beta1, k)))
    b2 = float(np.dot(w, np.power(beta2, k)))
    if 1.0 - b1 <= 0.0:
        np.copyto(out, v_prev)
        return
    g = (m_bar - np.float32(b1) * m_prev) / np.float32(1.0 - b1)
    np.multiply(v_prev, np.float32(b2), out=out)
    out += np.float32(1.0 - b2) * g * g


def decay_base(key: str, group: dict) -> float:
    """Per-step decay of a state entry that is a running average: ``β`` in ``s ← β·s + (...)``.

    Adam family: ``exp_avg`` ``betas[0]``, ``exp_avg_sq`` and ``max_exp_avg_sq`` ``betas[1]``
    (Kingma & Ba 2015, Alg. 1); SGD's and RMSprop's ``momentum_buffer`` ``momentum``;
    RMSprop's ``square_avg`` and ``grad_avg`` ``alpha`` (torch.optim docs). Anything else:
    1.0 (the entry is treated as a sum that never forgets).
    """
    try:
        if key == "exp_avg":
            return float(group["betas"][0])
        if key in ("exp_avg_sq", "max_exp_avg_sq"):
            return float(group["betas"][1])
        if key == "momentum_buffer":
            return float(group["momentum"])
        if key in ("square_avg", "grad_avg"):
            return float(group["alpha"])
    except (KeyError, TypeError, IndexError, ValueError):
        pass
    return 1.0


@torch.no_grad()
def adopt_delta(live: torch.Tensor, consensus: torch.Tensor, kept: torch.Tensor | None, decay: float = 1.0,
                non_negative: bool = False) -> None:
    """Async's delta adoption of one state tensor, in place: ``live += decay · (consensus - kept)``.

    The round averaged the state as it was at the snapshot (``kept``); the rank took
    ``n`` steps since. A running average ``s ← β·s + c·x`` after ``n`` steps from
    ``kept`` is ``β^n·kept + (own part)``; had the rank held the consensus at the
    snapshot, the same steps would give ``β^n·consensus + (own part)``. So
    ``decay = β^n`` (:func:`decay_base`) gives exactly the state the rank would hold
    had it adopted the consensus at the snapshot, the optimizer-state counterpart of
    the parameters' ``consensus + (θ - θ_snapshot)`` (flodl_mpi.training.replica.Replica.adopt;
    Shen et al. 2019, arXiv:1906.12043), where ``decay = 1``. With ``decay = 1`` a
    momentum would get back the whole difference to the others' *stale* momentum,
    which its own steps had already forgotten (measured on MNIST-1D: 9 points under
    each rank's own state, one seed; benchmarks/README.md, "async_adoption.py"). For
    a second moment (``non_negative``) the result is ``>= β^n·consensus >= 0`` in
    exact arithmetic (its own part is >= 0); it is clamped at 0 against
    rounding (a negative ``exp_avg_sq`` is a NaN in Adam's square root).

    Args:
        live: the optimizer's state tensor (any floating dtype, any device); written.
        consensus: float32, the same shape: the round's averaged (or rebuilt) value.
        kept: float32 copy of ``live`` at the snapshot (never a view of it), the same
            shape; None: the rank held no state then (the optimizer's zeros).
        decay: ``β^n``, in [0, 1].
        non_negative: clamp the result at 0.
    """
    diff = consensus.to(live.device, live.dtype)
    if kept is not None:
        diff = diff - kept.to(live.device, live.dtype)
    live.add_(diff, alpha=float(decay))
    if non_negative:
        live.clamp_(min=0.0)


class OptimizerStateAverager:
    """One rank's side of the optimizer-state average: fill the frame, finish, adopt.

    The training thread calls :meth:`fill` before each round (the live state
    into the staging) and :meth:`adopt` after a realized one (the consensus
    back into the live state); the bridge reduces the staging with the
    parameters' masses and calls :meth:`finish` on the result, before anyone
    adopts. Between those calls nothing else touches the state, as with the
    parameters.

    Args:
        optimizer: the rank's optimizer.
        mode: ``mean`` (every floating state tensor shaped like its parameter
            travels, mass-weighted mean) or ``corrected`` (as ``mean``, but an
            Adam-family second moment is rebuilt, :func:`rebuild_second_moment`).

    A state entry that a rank does not hold yet (the optimizer creates state
    at a parameter's first step; a parameter with no gradient has none)
    enters as zeros, the value those optimizers start from, and receives
    nothing at adoption: the rank keeps no state for it.

    The consensus moments ``(m_prev, v_prev)`` of the last round are kept here
    (two float32 copies of the Adam parameters' sizes). They start from the
    optimizer's own state (zeros before the first step; the saved consensus on
    a resume, which is the same on every rank when the run averaged its state)
    and :meth:`reset` zeroes them when the cohort clears its state.

    Raises:
        ValueError: an unknown mode, or from :class:`StatePlan`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, mode: str) -> None:
        if mode not in ("mean", "corrected"):
            raise ValueError(f"mode must be 'mean' or 'corrected', got {mode!r}")
        self.mode = mode
        self.plan = StatePlan(optimizer, correct=mode == "corrected")
        self.optimizer = optimizer
        # Where each rebuilt v lives in one flat array, and the kept consensus moments.
        sizes = [math.prod(e.shape) for e in self.plan.rebuilt]
        self._v_offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).tolist()
        n = int(self._v_offsets[-1])
        self.m_prev = np.zeros(n, dtype=np.float32)
        self.v_prev = np.zeros(n, dtype=np.float32)
        self._v_new = np.zeros(n, dtype=np.float32)
        #: Async's delta adoption: keep the state :meth:`fill` copied (its own copy, never a
        #: view of the live state or of the staging), wire entries then rebuilt entries.
        self.keep_snapshot = False
        self.kept: list[torch.Tensor | None] = []
        self.start()

    @property
    def wire_shapes(self) -> list[tuple[int, ...]]:
        """Shapes of the travelling entries, in order: the layout of the state frame."""
        return self.plan.wire_shapes

    def _v_view(self, flat: np.ndarray, j: int) -> np.ndarray:
        return flat[self._v_offsets[j]:self._v_offsets[j + 1]]

    def _live(self, entry: StateEntry) -> torch.Tensor | None:
        state = self.optimizer.state.get(self.plan.params[entry.index])
        value = None if state is None else state.get(entry.key)
        if value is None:
            return None
        if tuple(value.shape) != entry.shape or not value.is_floating_point():
            raise ValueError(f"optimizer state {entry.key!r} of parameter {entry.index} is a {tuple(value.shape)} "
                             f"{value.dtype} tensor; it was planned as {entry.shape} floating")
        return value

    @torch.no_grad()
    def start(self) -> None:
        """Take ``(m_prev, v_prev)`` from the optimizer's state now (zeros where it has none)."""
        for pair in self.plan.pairs:
            m = self._live(self.plan.wire[pair.first])
            v = self._live(self.plan.rebuilt[pair.second])
            for src, flat in ((m, self.m_prev), (v, self.v_prev)):
                dst = self._v_view(flat, pair.second)
                if src is None:
                    dst.fill(0.0)
                else:
                    dst[:] = src.detach().reshape(-1).to("cpu", torch.float32).numpy()

    def reset(self) -> None:
        """The cohort cleared its optimizer state (an outer step with a reset): start from zeros."""
        self.m_prev.fill(0.0)
        self.v_prev.fill(0.0)

    @torch.no_grad()
    def fill(self, views: Sequence[torch.Tensor]) -> None:
        """Copy the live state into ``views`` (float32, :attr:`wire_shapes`); zeros where it has none.

        With :attr:`keep_snapshot`, the live state (wire entries, then the rebuilt
        second moments) is also copied into :attr:`kept`, float32 CPU tensors
        allocated once (None where the rank holds no state yet).
        """
        for entry, dst in zip(self.plan.wire, views):
            src = self._live(entry)
            if src is None:
                dst.zero_()
            else:
                dst.copy_(src.detach())
        if self.keep_snapshot:
            entries = [*self.plan.wire, *self.plan.rebuilt]
            if not self.kept:
                self.kept = [None] * len(entries)
            for i, entry in enumerate(entries):
                src = self._live(entry)
                if src is None:
                    self.kept[i] = None
                    continue
                if self.kept[i] is None:
                    self.kept[i] = torch.empty(entry.shape, dtype=torch.float32)
                self.kept[i].copy_(src.detach())

    def finish(self, staging: np.ndarray, offsets: Sequence[int], weights: Sequence[float],
               steps: Sequence[float]) -> None:
        """After the reduce, on the consensus: rebuild each Adam second moment (``corrected``).

        Args:
            staging: float32, the reduced frame's tensors (the consensus).
            offsets: where each wire entry starts in ``staging`` (``WireLayout.offsets``).
            weights, steps: every rank's mass and step count in this round (same on every rank).

        Every rank computes the same values from the same consensus and the
        same kept moments; ``(m_prev, v_prev)`` become this round's consensus.
        """
        for pair in self.plan.pairs:
            lo = offsets[pair.first]
            m_bar = staging[lo:lo + (self._v_offsets[pair.second + 1] - self._v_offsets[pair.second])]
            m_prev, v_prev = self._v_view(self.m_prev, pair.second), self._v_view(self.v_prev, pair.second)
            v_new = self._v_view(self._v_new, pair.second)
            rebuild_second_moment(m_bar, m_prev, v_prev, weights, steps, pair.beta1, pair.beta2, v_new)
            np.copyto(m_prev, m_bar)
        self.v_prev, self._v_new = self._v_new, self.v_prev

    @torch.no_grad()
    def adopt(self, views: Sequence[torch.Tensor], delta: bool = False, steps: int = 0, alpha: float = 1.0) -> None:
        """Overwrite the live state with the consensus (``views``) and the rebuilt second moments.

        Args:
            views: the state staging holding the round's consensus (float32, :attr:`wire_shapes`).
            delta: async's delta adoption instead (:func:`adopt_delta`): each running
                average becomes ``live + β^steps · (consensus - kept)``, second moments
                clamped at 0. Needs a :meth:`fill` with :attr:`keep_snapshot` before the round.
            steps: (``delta``) this rank's optimizer steps since that fill, >= 0.
            alpha: (``delta``) async's pull in (0, 1] (``--easgd-alpha``; 1 under
                ``--async-adopt delta``): each running average becomes
                ``live + alpha · β^steps · (consensus - kept)``, the state the rank would
                hold had it taken ``kept + alpha (consensus - kept)`` at the fill, as its
                parameters do (flodl_mpi.training.replica.Replica.adopt).

        Raises:
            ValueError: ``delta`` without a kept snapshot, ``steps < 0``, or ``alpha`` outside
                (0, 1] or below 1 without ``delta``.
        """
        if not 0 < alpha <= 1 or (alpha != 1.0 and not delta):
            raise ValueError(f"alpha must be in (0, 1], and 1 without delta; got {alpha!r}")
        if delta and not self.kept:
            raise ValueError("a delta adoption of the optimizer state needs the state kept at the last fill "
                             "(keep_snapshot = True before it)")
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps!r}")
        consensus = [*views, *(torch.from_numpy(self._v_view(self.v_prev, j)).reshape(e.shape)
                               for j, e in enumerate(self.plan.rebuilt))]
        for i, (entry, src) in enumerate(zip([*self.plan.wire, *self.plan.rebuilt], consensus)):
            dst = self._live(entry)
            if dst is None:
                continue
            if delta:
                decay = alpha * decay_base(entry.key, self.plan.groups[entry.index]) ** int(steps)
                adopt_delta(dst, src, self.kept[i], decay, non_negative=entry.key in NON_NEGATIVE_KEYS)
            else:
                dst.copy_(src)
