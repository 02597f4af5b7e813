"""The averaging policy: who trains how many batches before the next round, and the guard (SPEC §3-§4).

Invariant: a policy is a pure function of the gathered facts it is fed, round after
round; every rank feeds its own copy the same facts in the same order (the bridge does,
from the control gather), so every rank holds the same :class:`Plan` before each window.
No MPI, no threads, no clocks: the readings arrive as numbers.

- ``sync``: one batch per rank per round. ``window``: ``--window`` batches per rank.
- ``cadence``: the ElChe balancer (:mod:`flodl_mpi.policy.elche`) sets per-rank quotas from the
  ranks' measured speeds; the anchor grows with the round overhead when the divergence
  guard says ``Stable``.
- ``async``: cadence's plan; the training thread keeps training while the round runs
  (the trainer's concern, :attr:`Policy.blocking` is False), and the guard's threshold is
  0.3 when the EASGD blend is on (SPEC §3).

Which policies exist, their words, defaults and options, and how a config builds one:
:mod:`flodl_mpi.policy.registry` (:func:`~flodl_mpi.policy.registry.make_policy`). A new
policy subclasses :class:`Policy` (its :meth:`Policy.plan`, and :meth:`Policy.observe` when
it reads the rounds) and registers an entry there.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from flodl_mpi.policy.cadence import fixed_quotas
from flodl_mpi.protocol.divergence import TrendGuard, Verdict
from flodl_mpi.policy.elche import ElChe

__all__ = ["CadencePolicy", "FixedPolicy", "Plan", "Policy", "RoundFacts", "guard_threshold"]


@dataclass(frozen=True)
class Plan:
    """The next window's plan: batches per rank (index = rank, each >= 1) and the anchor."""

    quotas: tuple[int, ...]
    anchor: int


@dataclass(frozen=True)
class RoundFacts:
    """What a round's control gather tells the policy; identical on every rank.

    Attributes:
        batch_ms: float64 ``(W,)``: each rank's mean ms per batch in the window just
            trained (NaN where it ran none, and at an epoch exchange).
        window: int64 ``(W,)``: batches each rank ran in that window.
        round_ms: the previous round's reduce time after its control gather, ms,
            the slowest rank's; NaN when there was no previous round.
        wait_ms: how long the previous round kept a training thread waiting, ms, the
            longest over ranks (async: the part of the round compute did not hide);
            NaN when there was no previous round.
        max_divergence: the previous round's largest divergence over the ranks that
            contributed mass (0.0 when none did); None when there was no previous round.
        anchor: the anchor of the plan the window ran under (0: none, an epoch exchange).
        closes_window: the facts come from a round that closed a window (False: an
            epoch exchange, which carries the last round's acks and no window).
    """

    batch_ms: np.ndarray
    window: np.ndarray
    round_ms: float = math.nan
    max_divergence: float | None = None
    wait_ms: float = math.nan
    anchor: int = 0
    closes_window: bool = True


def guard_threshold(easgd_alpha: float | None) -> float:
    """The guard's divergence threshold: 0.05, or 0.3 when EASGD blends (``alpha < 1``) (SPEC §3)."""
    return 0.3 if easgd_alpha is not None and easgd_alpha < 1.0 else 0.05


class Policy(ABC):
    """Base of the policies: the guard, the current plan, and checkpoint state.

    A subclass gives :meth:`plan` (the next window's batches per rank, each >= 1, and its
    anchor); it may override :meth:`observe` to read each round's gathered facts, and
    :meth:`state_dict` / :meth:`load_state_dict` for state a resume must restore.
    :func:`~flodl_mpi.policy.registry.make_policy` sets :attr:`name` to its entry's.

    Args:
        world_size: ranks, >= 1.
        guard: the divergence guard the policy feeds (its verdicts are recorded
            whatever the policy does with them).
    """

    name = "policy"
    #: The training thread waits for each round (False: async).
    blocking = True

    def __init__(self, world_size: int, guard: TrendGuard | None = None) -> None:
        self.world_size = int(world_size)
        self.guard = guard if guard is not None else TrendGuard()

    @abstractmethod
    def plan(self) -> Plan:
        """The plan of the next window."""

    def observe(self, facts: RoundFacts) -> Verdict | None:
        """Feed one round's facts; returns the guard's verdict on the previous round (None: none)."""
        if facts.max_divergence is None:
            return None
        return self.guard.observe(facts.max_divergence)

    def without_ranks(self, ranks) -> None:
        """Re-plan, in place, for the world without ``ranks`` (positions before the shrink, SPEC §9).

        Every survivor calls it with the same agreed failed set, so every survivor holds
        the same plan for the new world's first window. The guard's trend stays (it
        reads the consensus' divergence, not a rank's). A policy with per-rank state
        overrides this and :meth:`with_new_ranks` (and calls them here).

        Raises:
            ValueError: a rank outside the world, named twice, or every rank.
        """
        gone = [int(r) for r in ranks]
        bad = [r for r in gone if not 0 <= r < self.world_size]
        if bad or len(set(gone)) != len(gone) or len(set(gone)) >= self.world_size:
            raise ValueError(f"without_ranks({gone}): each rank once, in the world of {self.world_size}, and not "
                             "every rank")
        self.world_size -= len(gone)

    def with_new_ranks(self, count: int) -> None:
        """Re-plan, in place, for ``count`` >= 1 newcomers above the current ranks (SPEC §9 "Join").

        A newcomer is then given :meth:`state_dict` and builds its policy at the new world
        size with :meth:`load_state_dict`, so it holds the same plan as the others.

        Raises:
            ValueError: ``count`` < 1.
        """
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"count must be an int >= 1, got {count!r}")
        self.world_size += count

    def state_dict(self) -> dict:
        """JSON-able state, saved in checkpoints (SPEC §6)."""
        return {"name": self.name, "guard": self.guard.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s values."""
        self.guard.load_state_dict(state["guard"])


class FixedPolicy(Policy):
    """``sync`` (``window == 1``) and ``window``: every rank runs ``window`` batches per round.

    The guard's verdicts are recorded; with a fixed window there is no anchor to act on.
    """

    def __init__(self, world_size: int, window: int = 1, guard: TrendGuard | None = None) -> None:
        super().__init__(world_size, guard)
        self.name = "sync" if window == 1 else "window"
        self._plan = Plan(tuple(fixed_quotas(world_size, window)), int(window))

    def plan(self) -> Plan:
        return self._plan

    def without_ranks(self, ranks) -> None:
        super().without_ranks(ranks)
        self._plan = Plan(tuple(fixed_quotas(self.world_size, self._plan.anchor)), self._plan.anchor)

    def with_new_ranks(self, count: int) -> None:
        super().with_new_ranks(count)
        self._plan = Plan(tuple(fixed_quotas(self.world_size, self._plan.anchor)), self._plan.anchor)


class CadencePolicy(Policy):
    """``cadence`` (and ``async``'s plan): ElChe quotas, an anchor the guard gates (SPEC §3-§4).

    Per round: the guard reads the previous round's divergence as soon as its acks
    arrive (at the next round, or at the epoch exchange); at the next round that closes
    a window, that round's overhead (its reduce time over the anchor rank's window time;
    under ``async`` its *exposed* time, the longest wait of a training thread for it, over
    the anchor rank's window time: a round hidden behind compute costs nothing, so it
    does not grow the anchor) may propose a larger anchor, which the verdict commits
    (``Stable``), drops and latches (``SuppressGrowth``), or which a ``NudgeDown``
    replaces by a smaller anchor; under ``async``, when no growth is proposed, the
    anchor shrinks towards the shortest window that still hides the round twice over
    (:meth:`~flodl_mpi.policy.elche.ElChe.propose_shrink`: at most halved per round), so the
    consensus a rank adopts is as fresh as hiding the round allows; then the balancer
    takes the window's speeds and rebalances. Acting only when a window
    closes keeps the plans the same whether or not an epoch exchange (or a stop and a
    resume, which adds one) came between two rounds: the verdict waits in the state.
    With ``act_on_guard=False`` (``--no-divergence-guard``) every verdict is still
    computed and recorded but read as ``Stable``.

    Args:
        world_size: ranks.
        elche: the balancer (its anchor and limits as configured).
        guard: the divergence guard.
        act_on_guard: whether verdicts gate the anchor.
        blocking: False for ``async``.
    """

    def __init__(self, world_size: int, elche: ElChe, guard: TrendGuard | None = None, act_on_guard: bool = True,
                 blocking: bool = True) -> None:
        super().__init__(world_size, guard)
        self.elche = elche
        self.act_on_guard = bool(act_on_guard)
        self.blocking = bool(blocking)
        self.name = "cadence" if blocking else "async"
        #: The anchor rank's latest window time, ms (the denominator of the next
        #: overhead), and the anchor that window ran under.
        self._window_ms, self._window_anchor = math.nan, 0
        #: The last acked round's (verdict, cost ms, round ms), waiting for the next window's close.
        self._pending: tuple[int, float, float] | None = None

    def plan(self) -> Plan:
        return Plan(tuple(self.elche.quotas()), self.elche.anchor)

    def observe(self, facts: RoundFacts) -> Verdict | None:
        verdict = super().observe(facts)
        if verdict is not None:
            # What the round cost the training threads: its reduce time when they wait
            # for it whole (cadence), the wait compute did not hide under async; and the
            # round's time (async sizes its windows to outlast it).
            cost = facts.round_ms if self.blocking else facts.wait_ms
            self._pending = (int(verdict), float(cost), float(facts.round_ms))
        if not facts.closes_window:
            return verdict
        if self._pending is not None:
            # The acked round closed the window timed last time: its overhead is read
            # against that window, before this window's speeds replace the anchor rank's.
            acked, cost, round_ms = self._pending
            self._pending = None
            proposal = self.elche.propose(cost, self._window_ms, self._window_anchor or None)
            self.elche.settle(proposal, Verdict(acked) if self.act_on_guard else Verdict.STABLE,
                              self.guard.nudge_factor)
            if not self.blocking and proposal is None:
                # Async: a window need only outlast the round; a shorter one averages more often.
                shrunk = self.elche.propose_shrink(round_ms)
                if shrunk is not None:
                    self.elche.shrink(shrunk)
        ms = np.asarray(facts.batch_ms, dtype=np.float64)
        if np.isfinite(ms).any():
            self.elche.observe(ms)
            a = self.elche.anchor_rank
            self._window_ms = float(ms[a] * facts.window[a]) if facts.window[a] > 0 else math.nan
            self._window_anchor = int(facts.anchor)
        return verdict

    def without_ranks(self, ranks) -> None:
        """ElChe re-plans without the ranks' rows (:meth:`~flodl_mpi.policy.elche.ElChe.without_ranks`).

        The anchor rank's window time is forgotten: it timed a window of the old world
        (whose round was abandoned), so the next round proposes no growth; a verdict
        waiting for the next window's close still acts then.
        """
        super().without_ranks(ranks)
        self.elche.without_ranks(ranks)
        self._window_ms, self._window_anchor = math.nan, 0

    def with_new_ranks(self, count: int) -> None:
        """ElChe gives each newcomer the anchor until it is timed
        (:meth:`~flodl_mpi.policy.elche.ElChe.with_new_ranks`)."""
        super().with_new_ranks(count)
        self.elche.with_new_ranks(count)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "elche": self.elche.state_dict(), "window_ms": self._window_ms,
                "window_anchor": self._window_anchor,
                "pending": None if self._pending is None else list(self._pending)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if "elche" in state:
            self.elche.load_state_dict(state["elche"])
            self._window_ms = float(state.get("window_ms", math.nan))
            self._window_anchor = int(state.get("window_anchor", 0))
            pending = state.get("pending")
            if pending is not None and len(pending) == 2:  # an older checkpoint kept only the cost
                pending = [*pending, pending[1] if self.blocking else math.nan]
            self._pending = None if pending is None else (int(pending[0]), float(pending[1]), float(pending[2]))
