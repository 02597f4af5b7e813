"""Replay a run's recorded plan: the quotas and anchors another run's balancer chose (issue 26 item 11).

Invariant: a replayed window's plan is the recorded plan of the round that closes it,
read from ``metrics.h5`` (``rounds/quota``, ``rounds/anchor``) by round index, so the
same data, seed and options give the recorded run's windows exactly, whatever the
machine's speed now. The file is checked whole before the run trains: every recorded
window must be what its quotas give at this run's batches per epoch (``fit_quotas``),
so a plan for another data size or batch size is refused, not followed part way.
Pure: numpy and h5py, no MPI, no torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from flodl_mpi.policy.cadence import fit_quotas
from flodl_mpi.policy.registry import either, get, lookup, names

__all__ = ["RecordedPlan", "ReplayError", "read_recorded_plan"]


class ReplayError(ValueError):
    """``--replay-plan`` cannot be followed: one line naming the file, what differs and the remedy."""


@dataclass(frozen=True)
class RecordedPlan:
    """The plans a run's windows ran under, one per round, as ``metrics.h5`` recorded them.

    Attributes:
        path: the metrics file read.
        world_size: ranks of the recorded run.
        policy: its ``--policy``.
        quotas: int64 ``(rounds, world_size)``: each window's quota per rank (before an
            epoch's end scaled it: ``fit_quotas`` does that again).
        anchors: int64 ``(rounds,)``: each window's anchor.
        windows: int64 ``(rounds, world_size)``: the batches each rank ran.
        samples: training samples in one epoch of the recorded run (its first epoch row's
            ``per_rank_samples`` summed), or None when it recorded no epoch.
    """

    path: Path
    world_size: int
    policy: str
    quotas: np.ndarray
    anchors: np.ndarray
    windows: np.ndarray
    samples: int | None

    def __len__(self) -> int:
        return int(self.quotas.shape[0])

    def plan(self, round_index: int) -> tuple[tuple[int, ...], int]:
        """``(quotas, anchor)`` of the window that closes round ``round_index`` (0-based).

        Raises:
            ReplayError: the recorded run has no such round (``check`` refuses a run
                longer than the record first, so this means a bug, not bad input).
        """
        if not 0 <= round_index < len(self):
            raise ReplayError(f"--replay-plan {str(self.path)!r}: no plan recorded for round {round_index} "
                              f"(it holds {len(self)} rounds)")
        return tuple(int(q) for q in self.quotas[round_index]), int(self.anchors[round_index])

    def epochs_covered(self, n_batches: int) -> int:
        """Complete epochs the recorded windows cover at ``n_batches`` global batches an epoch.

        Raises:
            ReplayError: a recorded window is not what its quotas give at this epoch
                length (another data size, batch size or ``--drop-last``).
        """
        cursor, epochs = 0, 0
        for i, (quota, window) in enumerate(zip(self.quotas.tolist(), self.windows.tolist())):
            counts = fit_quotas(quota, n_batches - cursor)
            if counts != window or sum(counts) == 0:
                raise ReplayError(
                    f"--replay-plan {str(self.path)!r}: round {i} ran windows {window} of its quotas {quota}, not "
                    f"what they give at {n_batches} batches an epoch ({counts}): the plan was recorded for another "
                    "data size, --batch-size or --drop-last; replay it with the recorded run's data and batch size")
            cursor += sum(counts)
            if cursor == n_batches:
                cursor, epochs = 0, epochs + 1
        return epochs

    def refusal(self, world_size: int, policy: str, n_batches: int, samples: int, epochs: int) -> str | None:
        """Why this run cannot follow the plan (one line), or None when it can.

        Args:
            world_size, policy: this run's.
            n_batches: this run's global batches an epoch.
            samples: this run's training samples an epoch (drop-last's dropped ones not counted).
            epochs: this run's ``--epochs``.
        """
        where = f"--replay-plan {str(self.path)!r}"
        if world_size != self.world_size:
            return (f"{where} was recorded at {self.world_size} ranks, this run has {world_size}: a plan gives "
                    f"each rank its quota; launch {self.world_size} ranks to replay it")
        if policy != self.policy:
            return (f"{where} was recorded under --policy {self.policy}, this run is --policy {policy}; "
                    f"replay it with --policy {self.policy}")
        if self.samples is not None and samples != self.samples:
            return (f"{where} was recorded on {self.samples} training samples an epoch, this run has {samples}: "
                    "replay it on the recorded run's data")
        try:
            covered = self.epochs_covered(n_batches)
        except ReplayError as exc:
            return str(exc)
        if epochs > covered:
            return (f"{where} holds the plans of {covered} complete epoch(s) ({len(self)} rounds), this run asks "
                    f"for --epochs {epochs}; replay at most {covered} epoch(s)")
        return None


def _metrics_attrs(attrs) -> dict:
    """metrics.h5's root attributes, the JSON-encoded ones (listed in ``json_attrs``) decoded."""
    out = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in attrs.items()}
    for key in json.loads(out.get("json_attrs", "[]")):
        if key in out:
            out[key] = json.loads(out[key])
    return out


def read_recorded_plan(path: str | os.PathLike) -> RecordedPlan:
    """Read the per-round plans of a run's ``metrics.h5``.

    Raises:
        ReplayError: no such file, not a flodl-mpi metrics file, no rounds, a run whose
            world size changed (a resume at another size, or a membership change: a rank
            that died or joined; its per-rank columns mean other ranks over time), or a
            policy whose plan is fixed (``sync``, ``window``: nothing to replay).
    """
    p = Path(path)
    where = f"--replay-plan {str(p)!r}"
    if p.is_dir():
        p = p / "metrics.h5"
        where = f"--replay-plan {str(p)!r}"
    try:
        with h5py.File(p, "r", swmr=True) as f:
            attrs = _metrics_attrs(f.attrs)
            if "rounds" not in f or "world_size" not in attrs or "policy" not in attrs:
                raise ReplayError(f"{where}: not a flodl-mpi metrics.h5 (no rounds table or world size); give a "
                                  "run's RUN_DIR/metrics.h5")
            rounds = {name: f["rounds"][name][()] for name in ("quota", "anchor", "window")}
            samples = f["epochs/per_rank_samples"][()] if "epochs/per_rank_samples" in f else np.zeros((0, 1))
            # The membership ledger (SPEC §9), rows cut to the shortest column as every reader does.
            changes = f["membership"] if "membership" in f else {}
            n_changes = min((len(changes[c]) for c in changes), default=0)
            change_rounds = changes["round"][:n_changes] if n_changes else np.zeros(0, np.int64)
            change_sizes = changes["world_size"][:n_changes] if n_changes else np.zeros(0, np.int64)
    except FileNotFoundError:
        raise ReplayError(f"{where}: no such file; give a finished run's RUN_DIR/metrics.h5") from None
    except OSError as exc:
        raise ReplayError(f"{where}: cannot be read as HDF5 ({exc}); give a run's RUN_DIR/metrics.h5") from None
    if len(change_rounds):
        raise ReplayError(f"{where}: the recorded run's plan was ended by a membership change at round "
                          f"{int(change_rounds[0])} (a rank left or joined: {int(attrs['world_size'])} ranks, then "
                          f"{int(change_sizes[0])}); the rounds after it are another world's plan, so it cannot be "
                          "replayed")
    history = attrs.get("world_size_history") or []
    if len(history) > 1:
        raise ReplayError(f"{where}: the recorded run changed its world size ({history}); its plan cannot be replayed")
    spec = lookup(attrs["policy"])
    if spec is None or not spec.quotas:
        raise ReplayError(f"{where} was recorded under --policy {attrs['policy']}, whose plan is fixed: only a "
                          f"{either(n for n in names() if get(n).quotas)} run's plan is replayed")
    n = min(len(v) for v in rounds.values())
    if n == 0:
        raise ReplayError(f"{where}: the recorded run has no rounds; nothing to replay")
    return RecordedPlan(path=p, world_size=int(attrs["world_size"]), policy=str(attrs["policy"]),
                        quotas=np.asarray(rounds["quota"][:n], dtype=np.int64),
                        anchors=np.asarray(rounds["anchor"][:n], dtype=np.int64),
                        windows=np.asarray(rounds["window"][:n], dtype=np.int64),
                        samples=int(samples[0].sum()) if len(samples) else None)
