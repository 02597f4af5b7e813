"""A run's time line for the report's plots: stops, resumes and world-size changes, and each
round's place on an epoch axis (so runs of different round counts compare on one axis).

Invariant: read-only arithmetic on a `flodl_mpi.outputs.run_reader.Run` (its tables, its
``world_size_history``, its ``config-resume-r*.json`` names and train.log's stop
lines); no MPI, no torch, no matplotlib.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np

from flodl_mpi.outputs.run_reader import Run
from flodl_mpi.protocol.membership import MembershipChange

__all__ = ["Event", "change_words", "epoch_ends", "events", "round_epochs", "rounds_to_epochs"]

_STOP = re.compile(r"stopped on request\b.*\b(?:at|after) round (\d+)")


class Event(NamedTuple):
    """One mark on a time line: after ``rounds`` rounds, a ``kind`` ("stop", "resume",
    "world", "membership") described by ``label``."""

    rounds: int
    kind: str
    label: str


def _ids(ids: tuple[int, ...]) -> str:
    return f"id{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids))}"


def change_words(c: MembershipChange) -> str:
    """One membership change in words: ``round 20: id 1 left (14 steps lost); 2 ranks; detection
    120 ms, recovery 40 ms`` (ids are stable ids: the launch rank, then a join counter)."""
    what = []
    if c.left:
        lost = c.total_steps_lost
        what.append(f"{_ids(c.left)} left ({lost} step{'' if lost == 1 else 's'} lost)")
    if c.joined:
        what.append(f"{_ids(c.joined)} joined")
    return (f"round {c.round}: {' and '.join(what)}; {c.world_size} rank{'' if c.world_size == 1 else 's'}; "
            f"detection {c.detection_ms:.0f} ms, recovery {c.recovery_ms:.0f} ms")


def events(run: Run) -> list[Event]:
    """Stops (train.log's "stopped on request ... at/after round N" lines), resumes (the
    rounds of `Run.resume_rounds`), world-size changes (``world_size_history``) and
    membership changes (`Run.membership`: a rank that died or joined, at the round it cut
    off), in round order; a resume that changed the world size is one ``world`` event."""
    out = []
    for line in run.log_lines:
        m = _STOP.search(line)
        if m:
            out.append(Event(int(m.group(1)), "stop", f"stop (round {m.group(1)})"))
    history = run.world_size_history
    changes = {first: (prev, w) for (_, prev), (first, w) in zip(history, history[1:])}
    for first, (prev, w) in changes.items():
        out.append(Event(first, "world", f"resume at {w} rank{'' if w == 1 else 's'} (was {prev}; round {first})"))
    for n in dict.fromkeys(run.resume_rounds):
        if n not in changes:
            out.append(Event(n, "resume", f"resume (round {n})"))
    for c in run.membership:
        out.append(Event(c.round, "membership", change_words(c)))
    return sorted(out, key=lambda e: (e.rounds, e.kind != "stop"))


def round_epochs(run: Run) -> np.ndarray | None:
    """Where each round ends on the epoch axis, float64 ``(R,)``: epoch ``e`` (1-based, as
    the epochs table) spans ``(e - 1, e]``, and a round inside it sits at ``e - 1`` plus the
    share of the epoch's batches done by then (Σ ``rounds/window`` over ranks so far /
    ``epochs/batches``). Rounds after the last epoch row use the last epoch's batch count
    (capped at the next epoch's end). None without the ``rounds`` or ``epochs`` columns.
    """
    window, ends = run.per_rank("rounds", "window"), run.column("epochs", "rounds")
    numbers, batches = run.column("epochs", "epoch"), run.column("epochs", "batches")
    if window is None or ends is None or numbers is None or batches is None:
        return None
    done = np.nansum(np.maximum(window, 0.0), axis=1)
    x = np.empty(len(done))
    start, prev_number = 0, 0
    for end, number, total in zip(ends.astype(int), numbers.astype(int), batches.astype(np.float64)):
        end = min(end, len(done))
        seg = np.cumsum(done[start:end])
        x[start:end] = (number - 1) + np.minimum(seg / total if total > 0 else 1.0, 1.0)
        if end > start:
            x[end - 1] = number  # the epoch's last round is its end
        start, prev_number = max(start, end), number
    if start < len(done):
        total = float(batches[-1])
        seg = np.cumsum(done[start:])
        x[start:] = prev_number + np.minimum(seg / total if total > 0 else 0.0, 1.0)
    return x


def rounds_to_epochs(run: Run, rounds: int, x: np.ndarray | None = None) -> float | None:
    """The epoch-axis place of "after ``rounds`` rounds" (0: the run's start); None without
    `round_epochs`."""
    x = round_epochs(run) if x is None else x
    if x is None:
        return None
    if rounds <= 0 or not len(x):
        return 0.0
    return float(x[min(rounds, len(x)) - 1])


def epoch_ends(run: Run) -> np.ndarray:
    """Indices of the rounds that closed an epoch (``epochs/rounds`` - 1), int64; empty without them."""
    ends = run.column("epochs", "rounds")
    n = len(run.column("rounds", "round")) if run.column("rounds", "round") is not None else 0
    if ends is None:
        return np.zeros(0, np.int64)
    idx = ends.astype(np.int64) - 1
    return np.unique(idx[(idx >= 0) & (idx < n)])
