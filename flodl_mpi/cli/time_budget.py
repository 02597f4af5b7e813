"""Where each rank's wall time went, from metrics.h5: named parts that add up to the wall time.

Invariant: the parts are the training thread's time, so they add up to the seconds
the rank was in the run (`rank_seconds`) exactly — two of them are defined as what
is left: ``outside the epochs`` (wall time less the epochs' ``per_rank_epoch_ms``) and
``rest of the loop`` (the epochs' time less every part measured inside them). Under a
blocking policy the training thread waits for the whole round, so the round is split
into the bridge's phases; under ``async`` the round runs beside compute and only the
part compute did not hide (``wait_ms``) is the training thread's. Pure arithmetic on a
`flodl_mpi.outputs.run_reader.Run`; no MPI, no torch, no matplotlib.
"""

from __future__ import annotations

import numpy as np

from flodl_mpi.outputs.run_reader import Run
from flodl_mpi.policy.registry import blocking as policy_blocking

__all__ = ["AVERAGING", "NAMES", "PARTS", "averaging_seconds", "blocking", "rank_seconds", "time_parts"]

#: (name, what it counts, from which columns): the legend and README's definitions, in stacking order.
PARTS = (
    ("compute", "forward, backward and optimizer step (epochs/per_rank_compute_ms)"),
    ("data wait", "waiting for the next batch (epochs/per_rank_data_ms)"),
    ("snapshot", "copying the rank's values into the staging before a round (rounds/snapshot_ms)"),
    ("control gather", "the round's control gather, its wait for the slowest rank included (rounds/control_ms)"),
    ("pack", "the pre-round check and packing for the wire (rounds/pack_ms)"),
    ("allreduce", "the reduction across ranks (rounds/allreduce_ms)"),
    ("unpack", "unpacking the consensus (rounds/unpack_ms)"),
    ("outer step", "the outer optimizer's step on the consensus (rounds/outer_ms)"),
    ("rest of the round", "the bridge's round less the phases above: divergence, version, record "
                          "(rounds/bridge_ms less them)"),
    ("hand-off", "the training thread's wait beyond the bridge's round (rounds/wait_ms - bridge_ms, >= 0)"),
    ("round wait (async)", "async only: the part of the round compute did not hide (rounds/wait_ms); "
                           "the round's phases ran beside compute"),
    ("adoption", "copying the consensus into the live values (rounds/adopt_ms)"),
    ("outside the epochs", "wall time outside the epochs' windows and rounds: evaluation, epoch exchange, "
                           "checkpoint save, start-up (wall time less epochs/per_rank_epoch_ms)"),
    ("rest of the loop", "the epochs' time (per_rank_epoch_ms) less every part above measured in them: "
                         "progress bar, batch records, parameter norms; in your own loop, your code between "
                         "step() calls"),
)
NAMES = tuple(name for name, _ in PARTS)
#: The parts that are averaging (the summary's "averaging % of wall time").
AVERAGING = ("snapshot", "control gather", "pack", "allreduce", "unpack", "outer step", "rest of the round",
             "hand-off", "round wait (async)", "adoption")
_PHASES = {"control gather": "control_ms", "pack": "pack_ms", "allreduce": "allreduce_ms",
           "unpack": "unpack_ms", "outer step": "outer_ms"}


def rank_seconds(run: Run) -> np.ndarray:
    """Seconds each rank was in the run, float64 ``(W,)`` (W the widest world size, or the stable
    ids ever given): the stretches (`Run.segments`) whose world had the rank, less the time after
    it left (`Run.membership`), plus the time since it joined; every rank: the elapsed time, for a
    run at one world size."""
    out = np.zeros(run.width)
    segments = run.segments()
    for _, w, start, end in segments:
        out[:w] += max(0.0, end - start)
    # After a membership change the columns are stable ids: an id that left stops counting when the
    # change was in place (its ``time_s``), one that joined starts then, until the stretch ends (a
    # resume launches the ranks again; docs/elastic-records.rst).
    for c in run.membership:
        end = next((seg[3] for seg in reversed(segments) if seg[0] <= c.round), 0.0)
        for ids, sign in ((c.left, -1.0), (c.joined, 1.0)):
            for i in ids:
                if i < len(out):
                    out[i] += sign * max(0.0, end - c.time_s)
    return np.maximum(out, 0.0)


def blocking(run: Run) -> bool:
    """The training thread waited for each round (every policy but ``async``: its registry entry's ``blocking``)."""
    return policy_blocking(run.attrs.get("policy", run.config.get("policy")))


def _total(run: Run, table: str, col: str) -> np.ndarray:
    """Per rank, the sum of a per-rank ``*_ms`` column over the rows whose world had the rank,
    in ms, float64 ``(W,)``; NaN (not measured) counts 0, an absent column 0."""
    c = run.per_rank(table, col)
    return np.zeros(run.width) if c is None or c.shape[1] != run.width else np.nansum(c, axis=0)


def time_parts(run: Run) -> np.ndarray | None:
    """Per rank, the seconds of each of `PARTS`, float64 ``(W, len(PARTS))``; rows add up
    to `rank_seconds` (the last two parts are defined as the rest; either can be
    negative only when the file's clocks disagree). None without ``per_rank_epoch_ms``.

    Blocking policies: the round's parts per round are its ``control_ms``,
    ``pack_ms``, ``allreduce_ms``, ``unpack_ms``, ``outer_ms``, the rest of
    ``bridge_ms`` (``max(bridge - named, 0)``) and the hand-off
    ``max(wait_ms - bridge_ms, 0)`` (`flodl_mpi.protocol.round_profile.RunProfile`'s split);
    ``round wait (async)`` is 0. Async: those are 0 and ``round wait (async)`` is
    ``wait_ms``. A part whose column the file lacks (an older file) is 0, its time in
    ``rest of the loop``.
    """
    if run.per_rank("epochs", "per_rank_epoch_ms") is None:
        return None
    W = run.width
    ms = {name: np.zeros(W) for name in NAMES}
    ms["compute"] = _total(run, "epochs", "per_rank_compute_ms")
    ms["data wait"] = _total(run, "epochs", "per_rank_data_ms")
    ms["snapshot"] = _total(run, "rounds", "snapshot_ms")
    ms["adoption"] = _total(run, "rounds", "adopt_ms")
    if blocking(run):
        named = {name: run.per_rank("rounds", col) for name, col in _PHASES.items()}
        for name, col in named.items():
            ms[name] = np.zeros(W) if col is None else np.nansum(col, axis=0)
        bridge, wait = run.per_rank("rounds", "bridge_ms"), run.per_rank("rounds", "wait_ms")
        if bridge is not None:
            inside = sum(np.nan_to_num(c) for c in named.values() if c is not None)
            ms["rest of the round"] = np.nansum(np.maximum(bridge - inside, 0.0), axis=0)
            if wait is not None:
                ms["hand-off"] = np.nansum(np.maximum(wait - bridge, 0.0), axis=0)
    else:
        ms["round wait (async)"] = _total(run, "rounds", "wait_ms")
    epochs = _total(run, "epochs", "per_rank_epoch_ms")
    wall = 1e3 * rank_seconds(run)
    measured = sum(ms[name] for name in NAMES[:-2])
    ms["outside the epochs"] = wall - epochs
    ms["rest of the loop"] = epochs - measured
    return np.stack([ms[name] for name in NAMES], axis=1) / 1e3


def averaging_seconds(parts: np.ndarray) -> np.ndarray:
    """Per rank, the seconds of the `AVERAGING` parts of a `time_parts` array, float64 ``(W,)``."""
    return parts[:, [NAMES.index(n) for n in AVERAGING]].sum(axis=1)
