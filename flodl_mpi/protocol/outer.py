"""Outer optimizers: one step on the params consensus of each realized round (SPEC §7).

Invariant: the outer step is a pure function of the consensus and of outer state
that is identical on every rank (the previous global parameters and the outer
momentum), so every rank computes the same new parameters with no communication;
buffers never take an outer step. A round that realizes no mass does not call
:meth:`OuterOptimizer.step`, so it does not step.

The variants (SPEC §7; SlowMo: Wang et al. 2020, arXiv:1910.00643, Alg. 1 with
``beta = momentum``, ``alpha = lr``; DiLoCo: Douillard et al. 2023,
arXiv:2311.08105, Alg. 1 with Nesterov momentum as the outer optimizer)::

    g   = prev - consensus                    the outer "gradient"
    v   = momentum * v + g                    (v starts at 0, so the first is v = g)
    avg:      new = consensus
    slowmo:   new = prev - lr * v
    nesterov: new = prev - lr * (momentum * v + g)
    prev = new

``prev`` is the previous global parameters; the first realized round has no
``prev``, takes the consensus as it and steps by zero. Memory: two float32
buffers the size of the parameters (``prev`` and ``v``) plus two pieces of
scratch; ``avg`` holds none.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from flodl_mpi.config import OUTERS

__all__ = ["OUTERS", "OUTER_DEFAULTS", "OUTER_DEFAULTS_BEFORE", "SHORT_WINDOW", "STRONG_GAIN", "OuterOptimizer", "short_window_warning",
           "settled_outer", "strong_momentum_warning"]

#: ``(lr, momentum)`` when not given: lr 0.7 (DiLoCo's) and momentum 0.5 for both (the papers' 0.9 lost
#: 2.4 and 4.5 points to DDP, and SlowMo diverged, on MNIST-1D at a window of 50: `STRONG_GAIN`'s comment;
#: SlowMo at lr 1.0 and momentum 0.5 did not diverge but ended 1.6 points below DDP, at 0.7 0.2 above). Why 0.9 does not pay there: successive pseudo-gradients are close to orthogonal (mean
#: cos(g, v) +0.00 to +0.09, ``benchmarks/outer_probe.py``), so the velocity accumulates no common
#: direction and only amplifies each round's change 2-3x; the parameters' norm grows round after round
#: (52 against 25 for momentum 0.5 at Adam 1e-3 after 40 epochs) and the test loss with it.
OUTER_DEFAULTS = {"avg": (1.0, 0.0), "slowmo": (0.7, 0.5), "nesterov": (0.7, 0.5)}
#: The defaults before 2026-12-03 (lr 1.0 for slowmo, momentum 0.9 for both): what a run whose checkpoint's config
#: left the outer lr or momentum unset (None, as every run made before then did) trained at.
OUTER_DEFAULTS_BEFORE = {"avg": (1.0, 0.0), "slowmo": (1.0, 0.9), "nesterov": (0.7, 0.9)}


def settled_outer(kind: str, lr: float | None, momentum: float | None,
                  saved: Mapping[str, Any] | None = None) -> tuple[float, float]:
    """The outer ``(lr, momentum)`` a run trains at, each as given; one not given (None) is the run's own.

    A new run (``saved`` None) takes :data:`OUTER_DEFAULTS`; a resume takes what its checkpoint's
    config ``saved`` recorded: a number as it is, None (a run made before the values were recorded)
    as :data:`OUTER_DEFAULTS_BEFORE`, the defaults it trained at. So a change of the defaults never
    changes a run that resumes.

    Args:
        kind: one of :data:`OUTERS`.
        lr, momentum: the options given (None: not given).
        saved: the resumed checkpoint's config (``outer_lr``, ``outer_momentum``), or None.

    Raises:
        ValueError: an unknown ``kind``.
    """
    if kind not in OUTERS:
        raise ValueError(f"kind must be one of {', '.join(OUTERS)}, got {kind!r}")
    if saved is None:
        own = OUTER_DEFAULTS[kind]
    else:
        before = OUTER_DEFAULTS_BEFORE[kind]
        own = tuple(before[i] if saved.get(key) is None else float(saved[key])
                    for i, key in enumerate(("outer_lr", "outer_momentum")))
    return (own[0] if lr is None else float(lr)), (own[1] if momentum is None else float(momentum))


def _amplification(kind: str, lr: float | None, momentum: float | None) -> tuple[float, float, float]:
    """``(lr, momentum, lr / (1 - momentum))``: the outer's settings (None: today's default) and how much each
    round's change is amplified in the long run (the velocity's geometric sum)."""
    lr, momentum = settled_outer(kind, lr, momentum)
    return lr, momentum, lr / (1.0 - momentum)


#: The settings the digits figures `short_window_warning` quotes were measured at (the defaults then).
_MEASURED_AT = {"slowmo": (1.0, 0.9), "nesterov": (0.7, 0.9)}

#: Rounds closer than this many batches per rank (the window; the anchor for cadence) cost
#: accuracy with an outer step at its usual lr and momentum. Measured on the built-in digits
#: (2 ranks, Adam 1e-3, 10 epochs; ``python benchmarks/outer.py --datasets digits --windows 1 5 10
#: 20 50``): slowmo ends at 0.850 (window 5), 0.817 (10), 0.919 (20), 0.953 (50); nesterov at
#: 0.925, 0.953, 0.961, 0.975; --outer avg at 0.975-0.981 at every window. At sync both trail
#: early (3 epochs: 0.678 and 0.767 against 0.950) and end within a point (0.972, 0.969 against
#: 0.975). docs/benchmarks.rst, "Outer optimizers, measured".
SHORT_WINDOW = {"slowmo": 50, "nesterov": 50}
#: The steady-state amplification ``lr / (1 - momentum)`` from which a short window is warned about.
_AMPLIFIED = 2.0

#: Elements per pass piece: small enough that the piece's operands stay in cache.
_PIECE = 1 << 16


def short_window_warning(kind: str, window: int, cadence: str, lr: float | None = None,
                         momentum: float | None = None, api: bool = False) -> str | None:
    """One line warning that an outer step taken this often costs accuracy, or None.

    An outer step on rounds that come after every batch or few batches takes each step on a
    small change, and its momentum multiplies it: under a steady change ``g`` the velocity
    tends to ``g / (1 - momentum)`` and the step to ``lr / (1 - momentum)`` times ``g`` (10x
    for slowmo's usual lr 1.0 and momentum 0.9), on top of the inner optimizer's own momentum.
    SlowMo and DiLoCo are meant for rounds tens to hundreds of batches apart.

    Args:
        kind: ``--outer`` (``avg`` never warns).
        window: batches per rank between rounds: 1 for ``--policy sync``, ``--window``, the
            cadence's first anchor.
        cadence: how the rounds come, in the options' words (``--policy sync``, ``--window 5``).
        lr, momentum: the outer lr and momentum (None: :data:`OUTER_DEFAULTS`).
        api: word the options as :func:`flodl_mpi.fit`'s keywords (``outer='avg'``), not the CLI's flags.

    Returns:
        The line, when ``window`` is below :data:`SHORT_WINDOW` for ``kind`` and the
        amplification ``lr / (1 - momentum)`` is at least 2; else None. The digits figures are
        quoted at the settings they were measured at (lr 1.0 or 0.7 with momentum 0.9).
    """
    if kind not in SHORT_WINDOW or window >= SHORT_WINDOW[kind]:
        return None
    lr, momentum, gain = _amplification(kind, lr, momentum)
    if gain < _AMPLIFIED:
        return None
    every = "a round after every batch" if window == 1 else f"a round every {window} batches"
    seen = ""
    if (lr, momentum) == _MEASURED_AT[kind]:  # quoted at the measured settings only
        at = max(w for w in _MEASURED[kind] if w <= window)
        where = "at sync" if at == 1 else f"at --window {at}"
        if at == 1:
            seen = (f"; on the built-in digits (2 ranks, Adam) it ended at {_EARLY[kind]:.3f} test accuracy after 3 "
                    f"epochs and {_MEASURED[kind][1]:.3f} after 10 {where}, against {_EARLY['avg']:.3f} and "
                    f"{_MEASURED['avg'][1]:.3f} for --outer avg")
        else:
            seen = (f"; on the built-in digits (2 ranks, Adam, 10 epochs) it ended at {_MEASURED[kind][at]:.3f} test "
                    f"accuracy {where} against {_MEASURED['avg'][at]:.3f} for --outer avg")
        # MNIST-1D's Adam runs gained from nesterov at a window of 10: the cost depends on the task.
        seen += " (the cost depends on the task: the docs' Benchmarks page, 'Outer optimizers, measured')"
    if api:
        outer, avg, wider = f"outer={kind!r}", "outer='avg'", f"policy='window', window={SHORT_WINDOW[kind]}"
        seen = seen.replace("--outer avg", avg).replace("--window ", "window=")
    else:
        outer, avg, wider = f"--outer {kind}", "--outer avg", f"--policy window --window {SHORT_WINDOW[kind]}"
    return (f"warning: {outer} with {every} ({cadence}) amplifies each round's change about {gain:.0f}x "
            f"(lr {lr:g} / (1 - momentum {momentum:g})){seen}; outer steps are meant for rare rounds: use "
            f"{avg} at this cadence, or {wider} or more")


#: From this amplification ``lr / (1 - momentum)`` an outer step is warned about at any window.
#: Measured on MNIST-1D (2 ranks, the paper's CNN, Adam, batch 32, window 50, 40 epochs, inner lr
#: swept in x2 steps; ``python benchmarks/outer_sweep.py``, docs/howto/optimizers.rst): at momentum
#: 0.9 (amplification 7-10) nesterov and slowmo end 2.4 and 4.5 points below DDP's best at their
#: best inner lr and slowmo diverges at inner lr 4e-3; at momentum 0.5 (1.4-2) neither diverges at
#: inner lr 1e-3 to 8e-3 and nesterov ends 1.4 points above DDP (`_LONG`).
STRONG_GAIN = 5.0
#: What :func:`strong_momentum_warning` quotes: ``(best final test accuracy at momentum 0.9, its
#: inner lr)`` per kind, slowmo's final accuracy at inner lr 4e-3, and the references (DDP's and
#: --outer avg's best at the same window), from the sweep above.
_LONG = {"nesterov": (0.911, "2e-3"), "slowmo": (0.890, "1e-3"), "slowmo_4e-3": 0.324, "ddp": 0.935, "avg": 0.937}


def strong_momentum_warning(kind: str, window: int, lr: float | None = None, momentum: float | None = None,
                            api: bool = False) -> str | None:
    """One line warning that an outer momentum this strong lost accuracy, or diverged, where it was measured; or None.

    For the windows :func:`short_window_warning` leaves alone (``window`` >= :data:`SHORT_WINDOW`):
    when the amplification ``lr / (1 - momentum)`` is at least :data:`STRONG_GAIN` (DiLoCo's
    0.7 / 0.9 and SlowMo's 1.0 / 0.9 included).

    Args:
        kind: ``--outer`` (``avg`` never warns).
        window: batches per rank between rounds (as :func:`short_window_warning`).
        lr, momentum: the outer lr and momentum (None: :data:`OUTER_DEFAULTS`).
        api: word the options as :func:`flodl_mpi.fit`'s keywords.

    Returns:
        The line, or None.
    """
    if kind not in SHORT_WINDOW or window < SHORT_WINDOW[kind]:
        return None
    lr, momentum, gain = _amplification(kind, lr, momentum)
    if gain < STRONG_GAIN:
        return None
    acc, at = _LONG[kind]
    worse = f", and diverged at inner lr 4e-3 ({_LONG['slowmo_4e-3']:.3f})" if kind == "slowmo" else ""
    if api:
        outer, lower, avg = f"outer={kind!r}", f"outer_momentum={OUTER_DEFAULTS[kind][1]:g}", "outer='avg'"
    else:
        outer, lower, avg = f"--outer {kind}", f"--outer-momentum {OUTER_DEFAULTS[kind][1]:g}", "--outer avg"
    return (f"warning: {outer} at lr {lr:g}, momentum {momentum:g} amplifies each round's change about {gain:.0f}x "
            f"(lr / (1 - momentum)); on MNIST-1D (2 ranks, Adam, a round every 50 batches, 40 epochs) momentum "
            f"0.9 (outer lr {_MEASURED_AT[kind][0]:g}) ended at {acc:.3f} test accuracy at best (inner lr {at}){worse}, against {_LONG['ddp']:.3f} for "
            f"DDP and {_LONG['avg']:.3f} for {avg} at their best inner lr (the docs' 'Adam and outer optimizers' "
            f"page; the cost depends on the task): lower the momentum ({lower}, the default) or the outer lr")


#: Final test accuracy :func:`short_window_warning` quotes, by window (1: sync): the digits runs of
#: `SHORT_WINDOW`'s comment, 10 epochs; ``avg`` is --outer avg at the same window.
_MEASURED = {"slowmo": {1: 0.972, 5: 0.850, 10: 0.817, 20: 0.919},
             "nesterov": {1: 0.969, 5: 0.925, 10: 0.953, 20: 0.961},
             "avg": {1: 0.975, 5: 0.978, 10: 0.981, 20: 0.975}}
#: The same at sync after 3 epochs (``--windows 1 --epochs 3``).
_EARLY = {"slowmo": 0.678, "nesterov": 0.767, "avg": 0.950}

class OuterOptimizer:
    """Outer step on a flat float32 params consensus, in place.

    Args:
        kind: one of :data:`OUTERS`.
        n: number of parameter elements (the consensus length), >= 0.
        lr: outer learning rate, finite and > 0 (default per kind, :data:`OUTER_DEFAULTS`).
        momentum: outer momentum in ``[0, 1)`` (default per kind).

    Raises:
        ValueError: an unknown ``kind``, a negative ``n``, ``lr`` not finite and
            > 0, ``momentum`` outside ``[0, 1)``.

    Example (what the bridge does after each params reduce)::

        outer = OuterOptimizer("nesterov", layout.n)
        stats = sumcount_reduce(...)          # staging now holds the consensus
        if stats.realized:
            outer.step(staging)               # staging now holds the new global params
    """

    def __init__(self, kind: str, n: int, lr: float | None = None, momentum: float | None = None) -> None:
        if kind not in OUTERS:
            raise ValueError(f"kind must be one of {', '.join(OUTERS)}, got {kind!r}")
        if int(n) < 0:
            raise ValueError(f"n must be >= 0, got {n!r}")
        d_lr, d_mu = OUTER_DEFAULTS[kind]
        lr = d_lr if lr is None else float(lr)
        momentum = d_mu if momentum is None else float(momentum)
        if not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
        if not (math.isfinite(momentum) and 0.0 <= momentum < 1.0):
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        self.kind, self.n, self.lr, self.momentum = kind, int(n), lr, momentum
        #: Outer steps taken so far (realized rounds seen), the zero step included.
        self.steps = 0
        size = 0 if kind == "avg" else self.n
        self.prev = np.zeros(size, dtype=np.float32)
        self.velocity = np.zeros(size, dtype=np.float32)
        piece = min(_PIECE, max(size, 1))
        self._g = np.empty(piece, dtype=np.float32)
        self._t = np.empty(piece, dtype=np.float32)

    @property
    def extra_bytes(self) -> int:
        """Bytes of outer state held beside the parameters (``prev`` and ``v``)."""
        return self.prev.nbytes + self.velocity.nbytes

    def step(self, consensus: np.ndarray) -> None:
        """Replace ``consensus`` (float32, shape ``(n,)``) by the new global params, in place.

        Call once per round that realized mass, on every rank, with the same
        consensus; never for a skipped or unrealized round.

        Raises:
            ValueError: ``consensus`` is not a float32 array of shape ``(n,)``.
        """
        if consensus.dtype != np.float32 or consensus.shape != (self.n,):
            raise ValueError(f"consensus must be float32 of shape ({self.n},), got {consensus.dtype} {consensus.shape}")
        if self.kind == "avg":
            self.steps += 1
            return
        if self.steps == 0:  # no previous global params yet: a zero step (SPEC §7)
            np.copyto(self.prev, consensus)
            self.velocity.fill(0.0)
            self.steps = 1
            return
        lr, mu = np.float32(self.lr), np.float32(self.momentum)
        nesterov = self.kind == "nesterov"
        for lo in range(0, self.n, self._g.size):
            hi = min(lo + self._g.size, self.n)
            c, prev, v = consensus[lo:hi], self.prev[lo:hi], self.velocity[lo:hi]
            g, t = self._g[: hi - lo], self._t[: hi - lo]
            np.subtract(prev, c, out=g)          # g = prev - consensus
            np.multiply(v, mu, out=v)
            np.add(v, g, out=v)                  # v = mu v + g
            if nesterov:
                np.multiply(v, mu, out=t)
                np.add(t, g, out=t)              # t = mu v + g
            else:
                t = v
            np.multiply(t, lr, out=g)
            np.subtract(prev, g, out=c)          # new = prev - lr t
            np.copyto(prev, c)
        self.steps += 1

    def state_dict(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """``(arrays, attrs)`` for a checkpoint: ``prev`` and ``velocity`` (float32,
        shape ``(n,)``; empty for ``avg``) and the JSON-able settings and step count."""
        attrs = {"kind": self.kind, "lr": self.lr, "momentum": self.momentum, "steps": self.steps, "n": self.n}
        return {"prev": self.prev.copy(), "velocity": self.velocity.copy()}, attrs

    def load_state_dict(self, arrays: dict[str, np.ndarray], attrs: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` gave, exactly.

        The learning rate and momentum stay this optimizer's (a resume may change
        them, like the inner ``--lr``); the kind and size must match.

        Raises:
            ValueError: another kind or parameter count, or arrays of the wrong shape.
        """
        if attrs.get("kind") != self.kind or int(attrs.get("n", -1)) != self.n:
            raise ValueError(f"outer state is for --outer {attrs.get('kind')!r} over {attrs.get('n')} params, "
                             f"not {self.kind!r} over {self.n}")
        for name in ("prev", "velocity"):
            arr = np.asarray(arrays[name])
            dest = getattr(self, name)
            if arr.shape != dest.shape:
                raise ValueError(f"outer state {name!r} has shape {arr.shape}, expected {dest.shape}")
            np.copyto(dest, arr.astype(np.float32, copy=False))
        self.steps = int(attrs["steps"])
