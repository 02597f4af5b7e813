"""ElChe, the cadence balancer: per-rank quotas so uneven ranks reach each round together (SPEC §4).

Invariant: the balancer is a deterministic function of the values it is fed. Every rank
feeds it the same gathered readings in the same order, so every rank holds the same
anchor and the same quotas before each window starts, and the data each rank reads
needs no communication. No MPI, no threads, no clocks here.

The controller, in one paragraph: each rank's speed is the mean of its last
``history`` valid ms-per-batch readings; the slowest rank (the *anchor rank*) trains
``anchor`` batches per window and every other rank proportionally more,
``counts[r] = round(anchor · min(slow_ms / ms_r, max_ratio))``, at least 1, so all ranks
finish their window at about the same time. Quotas are recomputed only when some rank's
speed ratio moved by more than ``dead_zone`` (relative), or the anchor changed, so noise
does not churn them. The anchor grows when a round's overhead (reduce time over the
anchor rank's window time) exceeds ``overhead_target``: the proposal is
``ceil(anchor · min(overhead / target, 2))``, capped at ``max_anchor``. A proposal is only
committed by the divergence guard's ``Stable`` (see :meth:`ElChe.settle`). Under
``async`` the anchor also shrinks, towards the shortest window that still hides the
round (:meth:`ElChe.propose_shrink`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from flodl_mpi.policy.defaults import BALANCER_DEFAULTS
from flodl_mpi.protocol.divergence import Verdict

__all__ = ["HIDE_HEADROOM", "REARM_STABLE_ROUNDS", "ElChe"]

#: Stable verdicts in a row that re-arm anchor growth after a suppression (SPEC §4).
REARM_STABLE_ROUNDS = 5

#: Async: how many times over the anchor rank's window should outlast a round (see :meth:`ElChe.propose_shrink`).
HIDE_HEADROOM = 2.0


def _ranks_in(ranks, world_size: int) -> list[int]:
    """``ranks`` as ints, each checked to be in ``[0, world_size)`` (ValueError names the first that is not)."""
    out = [int(r) for r in ranks]
    bad = [r for r in out if not 0 <= r < world_size]
    if bad:
        raise ValueError(f"ranks {bad} are not in the world of {world_size} ranks")
    return out


def _round_half_up(x: float) -> int:
    """Round to nearest, halves up (Python's ``round`` rounds halves to even)."""
    return math.floor(x + 0.5)


class ElChe:
    """The cadence balancer's state and its three moves: observe, propose, settle.

    Args:
        world_size: ranks, >= 1.
        anchor: initial batches of the slowest rank per window, >= 1 (default
            ``BALANCER_DEFAULTS["anchor"]``, 10: `flodl_mpi.policy.defaults`).
        max_anchor: the anchor never grows past this, >= ``anchor`` (default
            ``BALANCER_DEFAULTS["max_anchor"]``, 1000).
        overhead_target: round overhead (reduce ms / anchor rank's window ms) above
            which the anchor grows, > 0 (default ``BALANCER_DEFAULTS["overhead_target"]``, 0.05).
        history: valid readings averaged per rank, >= 1 (default 5).
        dead_zone: relative change of a speed ratio below which quotas stay, >= 0
            (default 0.05).
        max_ratio: a rank runs at most this many times the anchor, >= 1 (default 64).

    Raises:
        ValueError: an argument out of its range (the message names it).

    Example (what the cadence policy does after each round, on every rank alike)::

        elche.observe(gathered_batch_ms)                 # ms per batch, one per rank
        proposal = elche.propose(round_ms, window_ms)    # None when no growth is due
        elche.settle(proposal, verdict)                  # the guard commits or drops it
        counts = elche.quotas()                          # the next window's plan
    """

    def __init__(self, world_size: int, anchor: int = BALANCER_DEFAULTS["anchor"],
                 max_anchor: int = BALANCER_DEFAULTS["max_anchor"],
                 overhead_target: float = BALANCER_DEFAULTS["overhead_target"], history: int = 5, dead_zone: float = 0.05, max_ratio: float = 64.0) -> None:
        def need(ok: bool, name: str, value, allowed: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {allowed}, got {value!r}")

        need(isinstance(world_size, int) and world_size >= 1, "world_size", world_size, "an int >= 1")
        need(isinstance(anchor, int) and anchor >= 1, "anchor", anchor, "an int >= 1")
        need(isinstance(max_anchor, int) and max_anchor >= anchor, "max_anchor", max_anchor,
             f"an int >= anchor ({anchor})")
        need(math.isfinite(overhead_target) and overhead_target > 0, "overhead_target", overhead_target,
             "a finite number > 0")
        need(isinstance(history, int) and history >= 1, "history", history, "an int >= 1")
        need(math.isfinite(dead_zone) and dead_zone >= 0, "dead_zone", dead_zone, "a finite number >= 0")
        need(math.isfinite(max_ratio) and max_ratio >= 1, "max_ratio", max_ratio, "a finite number >= 1")
        self.world_size = world_size
        self.anchor = anchor
        self.max_anchor = max_anchor
        self.overhead_target = float(overhead_target)
        self.history = history
        self.dead_zone = float(dead_zone)
        self.max_ratio = float(max_ratio)
        #: Per rank, the last ``history`` valid ms-per-batch readings (oldest first).
        self.readings: list[list[float]] = [[] for _ in range(world_size)]
        #: The slowest rank by smoothed ms (runs ``anchor`` batches); 0 until known.
        self.anchor_rank = 0
        #: The speed ratios (slow_ms / ms_r) behind the current quotas.
        self.ratios = [1.0] * world_size
        self._counts = [anchor] * world_size
        #: Anchor growth is latched off (after a SuppressGrowth or NudgeDown).
        self.latched = False
        #: Stable verdicts in a row while latched.
        self.stable_run = 0

    # ---- reading the speeds ----------------------------------------------------

    @property
    def phase(self) -> str:
        """``"warmup"`` until every rank has a valid reading, then ``"balanced"``."""
        return "balanced" if all(self.readings) else "warmup"

    def smoothed_ms(self) -> list[float]:
        """Per rank, the mean of its valid readings (NaN while it has none)."""
        return [math.fsum(r) / len(r) if r else math.nan for r in self.readings]

    def observe(self, batch_ms: Sequence[float]) -> None:
        """Take one window's ms-per-batch reading per rank and rebalance the quotas.

        A reading that is not a finite number > 0 (a rank that ran no batch: NaN) is
        not valid and leaves that rank's history as it was.

        Raises:
            ValueError: ``len(batch_ms) != world_size``.
        """
        if len(batch_ms) != self.world_size:
            raise ValueError(f"batch_ms has {len(batch_ms)} ranks, the balancer {self.world_size}")
        for ring, ms in zip(self.readings, batch_ms):
            ms = float(ms)
            if math.isfinite(ms) and ms > 0:
                ring.append(ms)
                del ring[: -self.history]
        self._rebalance()

    def _rebalance(self, force: bool = False) -> None:
        ms = self.smoothed_ms()
        known = [(m, r) for r, m in enumerate(ms) if not math.isnan(m)]
        if not known:
            return
        slow, self.anchor_rank = max(known, key=lambda t: (t[0], -t[1]))  # ties: the lowest rank
        ratios = [1.0 if math.isnan(m) else min(slow / m, self.max_ratio) for m in ms]
        moved = any(abs(new / old - 1.0) > self.dead_zone for new, old in zip(ratios, self.ratios))
        if moved or force:
            self.ratios = ratios
        self._counts = [max(1, _round_half_up(self.anchor * q)) for q in self.ratios]

    def quotas(self) -> list[int]:
        """Batches per rank for the next window (index = rank), each >= 1."""
        return list(self._counts)

    # ---- the anchor ----------------------------------------------------------------

    def propose(self, round_ms: float, window_ms: float, window_anchor: int | None = None) -> int | None:
        """The anchor the round's overhead asks for, or None when no growth is due.

        Args:
            round_ms: the round's reduce time, ms (the slowest rank's).
            window_ms: the anchor rank's window time, ms (its batches × its ms per batch).
            window_anchor: the anchor that window ran under (default: the current one).
                The readings describe that window, so growth scales its anchor: a
                reading taken before the last growth does not grow the anchor twice.

        Returns:
            ``min(max_anchor, ceil(window_anchor · min(overhead / overhead_target, 2)))``
            when ``overhead = round_ms / window_ms`` exceeds ``overhead_target`` and that
            is more than the current anchor; None otherwise, or when either reading is
            not a finite number (> 0 for ``window_ms``, >= 0 for ``round_ms``).
        """
        if not (math.isfinite(round_ms) and math.isfinite(window_ms) and window_ms > 0 and round_ms >= 0):
            return None
        overhead = round_ms / window_ms
        if overhead <= self.overhead_target:
            return None
        base = self.anchor if window_anchor is None else int(window_anchor)
        grown = min(self.max_anchor, math.ceil(base * min(overhead / self.overhead_target, 2.0)))
        return grown if grown > self.anchor else None

    def propose_shrink(self, round_ms: float, headroom: float = HIDE_HEADROOM) -> int | None:
        """Async: the smaller anchor whose window still hides the round, or None when none is due.

        Under ``async`` the round runs while the next window trains, so a window only
        has to outlast the round; a longer one averages less often and the consensus a
        rank adopts is a window old (measured on MNIST-1D: anchor 3 above the default,
        benchmarks/README.md, "async_adoption.py"). The anchor rank trains ``anchor``
        batches of ``slow_ms`` (its smoothed ms per batch) while the round runs, so it
        hides a round of ``round_ms`` ``headroom`` times over from
        ``need = ceil(headroom · round_ms / slow_ms)`` batches on.

        Args:
            round_ms: the round's time, ms (the slowest rank's reduce after the control gather).
            headroom: how many times over a window should cover the round, >= 1.

        Returns:
            ``max(need, ceil(anchor / 2), 1)`` (at most halved per round, as growth at
            most doubles) when that is below the current anchor; None otherwise, before
            every rank has a speed reading, or when ``round_ms`` is not a finite number >= 0.

        Raises:
            ValueError: ``headroom < 1``.
        """
        if not (math.isfinite(headroom) and headroom >= 1):
            raise ValueError(f"headroom must be a finite number >= 1, got {headroom!r}")
        if not (math.isfinite(round_ms) and round_ms >= 0) or self.phase != "balanced":
            return None
        slow_ms = self.smoothed_ms()[self.anchor_rank]
        need = math.ceil(headroom * round_ms / slow_ms)
        target = max(need, math.ceil(self.anchor / 2), 1)
        return target if target < self.anchor else None

    def shrink(self, anchor: int) -> None:
        """Lower the anchor to ``anchor`` (a :meth:`propose_shrink`), at least 1; the quotas follow.

        Not gated by the guard: a shorter window averages more often, the guard's own
        remedy (``NudgeDown``). The growth latch is left as it is.

        Raises:
            ValueError: ``anchor`` above the current anchor.
        """
        if anchor > self.anchor:
            raise ValueError(f"shrink() lowers the anchor ({self.anchor}), got {anchor!r}")
        if max(1, int(anchor)) != self.anchor:
            self.anchor = max(1, int(anchor))
            self._rebalance(force=True)

    def settle(self, proposal: int | None, verdict: Verdict, nudge_factor: float = 0.5) -> None:
        """Act on the guard's verdict (SPEC §3-§4); the same verdict on every rank, the same anchor.

        - ``STABLE``: commits ``proposal`` unless growth is latched; while latched it
          counts towards re-arming: the ``REARM_STABLE_ROUNDS``-th Stable in a row
          unlatches, and that round's proposal is committed.
        - ``SUPPRESS_GROWTH``: drops ``proposal`` and latches growth off.
        - ``NUDGE_DOWN``: shrinks the anchor to ``max(1, floor(anchor · nudge_factor))``,
          drops ``proposal`` and latches growth off (re-growing at once would undo it).

        The quotas follow the new anchor at once.

        Raises:
            ValueError: ``nudge_factor`` not in (0, 1) for ``NUDGE_DOWN``.
        """
        verdict = Verdict(verdict)
        old = self.anchor
        if verdict == Verdict.STABLE:
            if self.latched:
                self.stable_run += 1
                if self.stable_run >= REARM_STABLE_ROUNDS:
                    self.latched, self.stable_run = False, 0
            if not self.latched and proposal is not None:
                self.anchor = int(min(max(proposal, 1), self.max_anchor))
        else:
            if verdict == Verdict.NUDGE_DOWN:
                if not 0 < nudge_factor < 1:
                    raise ValueError(f"nudge_factor must be in (0, 1), got {nudge_factor!r}")
                self.anchor = max(1, math.floor(self.anchor * nudge_factor))
            self.latched, self.stable_run = True, 0
        if self.anchor != old:
            self._rebalance(force=True)

    # ---- membership (SPEC §9) ------------------------------------------------------

    def without_ranks(self, ranks) -> None:
        """Re-plan for the world without ``ranks`` (positions before the shrink; survivors keep their order).

        The survivors' smoothed speeds stay (SPEC §9: "re-plans from its smoothed speeds
        without the dead ranks' rows"); the slowest survivor becomes the anchor rank and
        every quota is recomputed against it at once (the dead zone does not apply: the
        world changed). The anchor and the growth latch stay.

        Raises:
            ValueError: a rank outside the world, or every rank.
        """
        gone = set(_ranks_in(ranks, self.world_size))
        if len(gone) >= self.world_size:
            raise ValueError(f"without_ranks({sorted(gone)}) leaves no rank of the {self.world_size}")
        keep = [r for r in range(self.world_size) if r not in gone]
        self.world_size = len(keep)
        self.readings = [self.readings[r] for r in keep]
        self.ratios = [self.ratios[r] for r in keep]
        self.anchor_rank = 0
        self._counts = [self._counts[r] for r in keep]
        self._rebalance(force=True)

    def with_new_ranks(self, count: int) -> None:
        """Re-plan for ``count`` >= 1 newcomers above the current ranks: each has no reading yet, so
        it runs the anchor (as the slowest would) until its first window is timed (the phase is
        ``warmup`` until then); the others' quotas are unchanged.

        Raises:
            ValueError: ``count`` < 1.
        """
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"count must be an int >= 1, got {count!r}")
        self.world_size += count
        self.readings += [[] for _ in range(count)]
        self.ratios += [1.0] * count
        self._counts += [self.anchor] * count
        self._rebalance(force=True)

    # ---- checkpoints --------------------------------------------------------------

    def state_dict(self) -> dict:
        """JSON-able state (anchor, anchor rank, readings, ratios, latch, phase), saved in checkpoints."""
        return {"anchor": self.anchor, "anchor_rank": self.anchor_rank, "readings": [list(r) for r in self.readings],
                "ratios": list(self.ratios), "counts": list(self._counts), "latched": self.latched,
                "stable_run": self.stable_run, "phase": self.phase}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s values. A checkpoint of another world size keeps
        the anchor and the latch, and starts the speeds afresh (warm-up).

        The limits (``max_anchor``, ``overhead_target``, ...) stay as configured now: a
        resume may change them. An anchor above a lowered ``max_anchor`` is cut to it.
        """
        self.anchor = min(int(state["anchor"]), self.max_anchor)
        self.latched, self.stable_run = bool(state["latched"]), int(state["stable_run"])
        if len(state["readings"]) == self.world_size:
            self.readings = [[float(v) for v in r][-self.history:] for r in state["readings"]]
            self.ratios = [float(v) for v in state["ratios"]]
            self.anchor_rank = int(state["anchor_rank"])
            self._counts = [int(v) for v in state["counts"]]
            if self.anchor != int(state["anchor"]):
                self._rebalance(force=True)
        else:
            self.readings = [[] for _ in range(self.world_size)]
            self.ratios = [1.0] * self.world_size
            self.anchor_rank = 0
            self._counts = [self.anchor] * self.world_size
