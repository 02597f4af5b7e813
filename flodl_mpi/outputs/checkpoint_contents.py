"""What a run's checkpoint holds, as one object with named fields: the one owner of its contents.

Invariant: every checkpoint a run saves (the CLI's and ``fit``'s `flodl_mpi.training.worker.Trainer`,
the own loop's ``Averager``) is a `CheckpointContents` written by `CheckpointContents.write`
(the file format is `flodl_mpi.outputs.checkpoint`'s), and every resume reads one back with
`read_contents`, which applies the compatibility rules below: a checkpoint of any earlier
flodl-mpi reads into the same fields, its gaps filled as that version behaved.

Fields and the root attributes they are (the meta; types as `flodl_mpi.outputs.checkpoint` stores them):

================  ======================================================================
epoch             int: epochs complete (a stop mid-epoch: the epochs before it)
epoch_complete    bool: False for an epoch cut short (the file is named for that epoch)
cursor            int: global batches of the next epoch trained already (the CLI's and
                  ``fit``'s stop mid-epoch; 0 otherwise, and always 0 for an own loop)
round             int: averaging rounds done (the bridge's version)
global_step       int: rank 0's optimizer steps in the run
reason            ``"checkpoint"`` or ``"graceful_shutdown"`` (a stop)
world_size        int: ranks that wrote it (each has its ``/ranks/<r>``)
elapsed_s         float: the run's training seconds so far (the clock a resume goes on from)
config            dict: the resume config (`flodl_mpi.config.TrainConfig.to_dict`)
guard             dict: the divergence guard's state
policy            dict: the policy's state (``name``, the guard, a balancer's anchor and speeds)
test_accuracy,    the last complete epoch's test figures (NaN, NaN, 0: none measured)
test_loss,
test_count
time_unix         float: when it was saved
model             dict: `flodl_mpi.training.model_record.model_record`, what a resume compares
metrics_rows      dict: rows metrics.h5 held per table (``rounds``, ``epochs``, ``batches``;
                  an own loop's also ``scalars``)
batches_done      int: the CLI's: global batches of the epoch saved
epoch_reports     list: the CLI's and ``fit``'s stop mid-epoch: every rank's
                  `flodl_mpi.protocol.epoch_report.EpochReport` of the epoch so far
epoch_scalars,    list: ``fit``'s stop mid-epoch: every rank's ``record_scalar`` book
epoch_intents     (``{name: [sum, count]}``) and intents of the epoch so far
epoch_progress    dict: an own loop's epoch cut short: ``step`` (its step() calls) and
                  ``ranks`` (each rank's counts so far; ``api.averager_checkpoint.continue_epoch``)
api               str: ``"Averager"`` for an own loop's run
run_record        dict: a Python API run's record (config.json's), added by the metrics writer
extra             any other meta key, kept as read (written back as it was)
================  ======================================================================

Arrays: ``params``/``buffers``/``order`` (the consensus, `flodl_mpi.outputs.checkpoint`'s
``/params``, ``/buffers``), ``ranks`` (rank -> ``(arrays, attrs)``, each rank's own state,
`flodl_mpi.training.rank_state.capture`, with a delta wire's error feedback) and ``cohort`` (the outer
optimizer's state and a delta wire's reference, or None).

Schema versions and compatibility (what an earlier writer left out, and how reading fills it):

- Schema 1 (``schema_version`` 1): state-dict names not escaped (`flodl_mpi.outputs.checkpoint.read_checkpoint`
  reads both), and a stop mid-epoch kept each rank's report in its own ``/ranks/<r>`` attribute
  ``epoch_report``, no root ``epoch_reports``: `CheckpointContents.stopped_reports` reads it there.
- No ``policy`` (written before the policies kept state): the guard's state alone is restored
  (`CheckpointContents.policy_state`); the Averager wrote none before this version either.
- No ``model`` (before the model record): a resume compares the stored tensors' names and shapes
  (`flodl_mpi.training.model_record.resume_difference`).
- A config without ``drop_last``: written before a lone left-over sample was folded into the batch
  before it; such a run's epochs had a batch more when ``samples % batch_size == 1``
  (`CheckpointContents.batch_plan_refusal`). A config without an option added since: that run had
  its default; without ``average_optimizer_state``: ``"off"`` (`CheckpointContents.saved_config`).
- No ``epoch_complete``: complete. No ``cursor``: 0. ``metrics_rows`` without a table: 0 rows.
- An own loop's epoch cut short without ``epoch_progress`` (an older Averager): the epoch restarts.
- ``fit``'s stop mid-epoch without ``epoch_scalars``: that epoch's scalars restart.
- A delta ``--wire`` run's checkpoint without ``wire/error/<plane>`` in ``/ranks/<r>`` (written before
  the wire's state was kept): the wire starts afresh, its first round the exact one
  (`flodl_mpi.training.resume_state.restore_wire`).

No MPI, no torch: plain arrays and JSON values (reading needs only h5py).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from flodl_mpi.config import TrainConfig
from flodl_mpi.outputs.checkpoint import (
    SCHEMA_VERSION,
    Checkpoint,
    checkpoint_name,
    read_checkpoint,
    read_cohort_state,
    read_rank_state,
    stored_bytes,
    write_checkpoint,
)

__all__ = ["SCHEMA_VERSION", "RankState", "CheckpointContents", "read_contents", "META_KEYS"]

#: One rank's own state: arrays by name (dtype kept) and JSON-able attributes.
RankState = tuple[dict[str, np.ndarray], dict[str, Any]]

#: The named meta fields, in the order they are written (optional ones only when set).
META_KEYS = ("epoch", "epoch_complete", "cursor", "batches_done", "metrics_rows", "elapsed_s", "round",
             "global_step", "reason", "world_size", "test_accuracy", "test_loss", "test_count", "config", "guard",
             "policy", "api", "time_unix", "model", "epoch_reports", "epoch_scalars", "epoch_intents",
             "epoch_progress", "run_record")
#: Fields written only when not None.
_OPTIONAL = ("batches_done", "policy", "api", "model", "epoch_reports", "epoch_scalars", "epoch_intents",
             "epoch_progress", "run_record")


@dataclass
class CheckpointContents:
    """One checkpoint of a run: the consensus, every rank's own state, and the meta, by name.

    Build one with every field (a run's `Trainer` and ``Averager`` do) and `write` it, or
    hand it to `flodl_mpi.outputs.metrics.MetricsWriter.save`; `read_contents` gives one back
    (``path`` set, ``ranks`` only those asked for). See the module docstring for each field.
    """

    params: dict[str, np.ndarray]
    buffers: dict[str, np.ndarray]
    order: list[str]
    epoch: int
    round: int
    reason: str
    world_size: int
    config: dict[str, Any]
    guard: dict[str, Any]
    epoch_complete: bool = True
    cursor: int = 0
    global_step: int = 0
    elapsed_s: float = 0.0
    metrics_rows: dict[str, int] = field(default_factory=dict)
    test_accuracy: float = float("nan")
    test_loss: float = float("nan")
    test_count: int = 0
    time_unix: float = 0.0
    policy: dict[str, Any] | None = None
    model: dict[str, Any] | None = None
    batches_done: int | None = None
    epoch_reports: list[dict[str, Any]] | None = None
    epoch_scalars: list[dict[str, Any]] | None = None
    epoch_intents: list[list[str]] | None = None
    epoch_progress: dict[str, Any] | None = None
    api: str | None = None
    run_record: dict[str, Any] | None = None
    #: rank -> ``(arrays, attrs)``; written as ``/ranks/0 .. /ranks/<n-1>``.
    ranks: dict[int, RankState] = field(default_factory=dict)
    #: What every rank holds alike ``(arrays, attrs)``: the outer optimizer's state and a delta wire's
    #: reference (`flodl_mpi.transport.bridge.Bridge.wire_state`), or None.
    cohort: RankState | None = None
    #: Meta keys of no field here (kept as read, written back).
    extra: dict[str, Any] = field(default_factory=dict)
    #: The file it was read from (None: not read).
    path: Path | None = None
    #: The format version of the file read (`SCHEMA_VERSION` for one built here).
    schema_version: int = SCHEMA_VERSION

    # ------------------------------------------------------------ writing

    @property
    def name(self) -> str:
        """The file name: the epoch saved (the one cut short when not complete) and the round."""
        return checkpoint_name(max(0, self.epoch + (0 if self.epoch_complete else 1)), self.round)

    @property
    def meta(self) -> dict[str, Any]:
        """The root attributes as written: every field of `META_KEYS` (optional ones when set), then ``extra``."""
        meta: dict[str, Any] = {}
        for key in META_KEYS:
            value = getattr(self, key)
            if value is None and key in _OPTIONAL:
                continue
            meta[key] = value
        meta.update(self.extra)
        return meta

    def format_args(self) -> dict[str, Any]:
        """The keyword arguments of `flodl_mpi.outputs.checkpoint.write_checkpoint` (less the path)."""
        n = len(self.ranks)
        if sorted(self.ranks) != list(range(n)):
            raise ValueError(f"ranks must be 0..{n - 1} to write, got {sorted(self.ranks)}")
        return {"params": self.params, "buffers": self.buffers, "meta": self.meta, "order": self.order,
                "ranks": [self.ranks[r] for r in range(n)], "cohort": self.cohort}

    def write(self, path: str | os.PathLike) -> Path:
        """Write it at ``path`` (atomically; raises as `flodl_mpi.outputs.checkpoint.write_checkpoint`)."""
        return write_checkpoint(path, **self.format_args())

    def stored_bytes(self) -> int:
        """Bytes its arrays take in the file (`flodl_mpi.outputs.checkpoint.stored_bytes`)."""
        return stored_bytes(self.params, self.buffers, [self.ranks[r] for r in sorted(self.ranks)], self.cohort)

    # ------------------------------------------------------------ reading

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint) -> CheckpointContents:
        """The contents of a checkpoint `flodl_mpi.outputs.checkpoint.read_checkpoint` read.

        Fields absent from an older file get the values that version behaved by (module docstring).

        Raises:
            ValueError: a required meta key (``epoch``, ``round``, ``world_size``, ``config``) is missing.
        """
        meta = dict(ckpt.meta)
        missing = [k for k in ("epoch", "round", "world_size", "config") if k not in meta]
        if missing:
            raise ValueError(f"checkpoint {ckpt.path}: no {', '.join(missing)} in its meta (not a run's checkpoint)")
        known = {f.name for f in dataclasses.fields(cls)} & set(META_KEYS)
        fields = {k: meta.pop(k) for k in list(meta) if k in known}
        ints = {k: int(fields[k]) for k in ("epoch", "round", "world_size", "cursor", "global_step", "test_count",
                                            "batches_done") if k in fields}
        fields.update(ints)
        if "epoch_complete" in fields:
            fields["epoch_complete"] = bool(fields["epoch_complete"])
        fields.setdefault("guard", {})
        fields.setdefault("reason", "checkpoint")
        fields["metrics_rows"] = {k: int(v) for k, v in dict(fields.get("metrics_rows") or {}).items()}
        for k in ("elapsed_s", "test_accuracy", "test_loss", "time_unix"):
            if k in fields:
                fields[k] = float(fields[k])
        return cls(params=ckpt.params, buffers=ckpt.buffers, order=list(ckpt.order), ranks=dict(ckpt.ranks),
                   extra=meta, path=ckpt.path, schema_version=ckpt.schema_version, **fields)

    def cohort_state(self) -> RankState:
        """The outer optimizer's state: as held, else read from ``path`` (`read_cohort_state`)."""
        if self.cohort is None:
            if self.path is None:
                raise ValueError("no cohort state: the contents hold none and were not read from a file")
            self.cohort = read_cohort_state(self.path)
        return self.cohort

    def rank_state(self, rank: int) -> RankState:
        """Rank ``rank``'s own state: as held, else read from ``path`` (`read_rank_state`).

        Raises:
            CheckpointError: the file holds no state for ``rank`` or does not read back.
            ValueError: not held and not read from a file.
        """
        if rank not in self.ranks:
            if self.path is None:
                raise ValueError(f"no state of rank {rank}: the contents hold none and were not read from a file")
            self.ranks[rank] = read_rank_state(self.path, rank)
        return self.ranks[rank]

    # ------------------------------------------------------------ compatibility rules

    def saved_config(self) -> dict[str, Any]:
        """The run's options as it ran: an option its config lacks was added since and had its default
        (runs from before ``--average-optimizer-state`` kept each rank's own state: ``"off"``)."""
        return {**TrainConfig().to_dict(), "average_optimizer_state": "off", **self.config}

    def batch_plan_refusal(self, samples: int, batch_size: int) -> str | None:
        """Why a run of ``samples`` training samples cannot resume it exactly (None: it can).

        A config without ``drop_last`` was written before a lone left-over sample was folded into
        the batch before it: at ``samples % batch_size == 1`` that run's epochs had a batch more,
        so its data cursor means other batches.
        """
        if "drop_last" in self.config or samples <= 1 or samples % batch_size != 1:
            return None
        return (f"{self.path} was written by an older flodl-mpi whose batch plan differs at --batch-size "
                f"{batch_size} ({samples} samples leave one over); it cannot be resumed exactly: start a new "
                "run (its weights load with flodl_mpi.outputs.checkpoint.load_state_dict)")

    def policy_state(self, name: str) -> tuple[str, dict[str, Any]]:
        """What a resume with policy ``name`` restores: ``("policy", state)`` when the checkpoint holds that
        policy's state, else ``("guard", state)`` (written before the policies kept state, or by another policy)."""
        if isinstance(self.policy, Mapping) and self.policy.get("name") == name:
            return "policy", dict(self.policy)
        return "guard", dict(self.guard)

    @property
    def reports_in_ranks(self) -> bool:
        """A stop mid-epoch of schema 1: the epoch's reports are in each rank's attributes, not the root."""
        return bool(self.cursor) and self.epoch_reports is None

    def stopped_reports(self, old_ranks: Sequence[int] | None = None) -> dict[int, dict[str, Any]]:
        """The stopped epoch's report so far of each old rank in ``old_ranks`` (default: every one).

        From ``epoch_reports``, or (schema 1) from each rank's ``epoch_report`` attribute, read
        from the ranks held or from ``path``.
        """
        wanted = range(self.world_size) if old_ranks is None else old_ranks
        if self.epoch_reports is not None:
            return {r: dict(self.epoch_reports[r]) for r in wanted}
        if self.path is None and any(r not in self.ranks for r in wanted):
            raise ValueError("no epoch reports: the contents hold none and were not read from a file")
        # read from the file, not kept: only the attributes are wanted of another rank's state
        return {r: dict((self.ranks[r] if r in self.ranks else read_rank_state(self.path, r))[1]["epoch_report"])
                for r in wanted}


def read_contents(path: str | os.PathLike, ranks: Sequence[int] | None = (), verify: bool = False
                  ) -> CheckpointContents:
    """A checkpoint file's contents (`read_checkpoint`, then `CheckpointContents.from_checkpoint`).

    Args:
        ranks: whose per-rank state to read (default none; None: every rank's).
        verify: also read every other dataset, checksums checked.

    Raises:
        CheckpointError: as `read_checkpoint`.
        ValueError: not a run's checkpoint (no epoch, round, world_size or config).
    """
    return CheckpointContents.from_checkpoint(read_checkpoint(path, ranks, verify))
