"""The bridge: the one thread per rank that runs averaging rounds (SPEC §2).

Responsibilities: it is the only MPI caller while training runs, on its own
duplicated communicator; it owns the staging the training thread snapshots
into and adopts from (for float32 CPU models the parameters themselves live
there, see ``worker.Replica.bind``); it runs the control gather, the all-idle
skip, the params and buffers reduces, the divergence triple and the version,
the epoch exchange, and at checkpoints the gather of each rank's state; on
rank 0 it turns the gathered values into ``metrics.h5`` records. Escape hatch: any error inside
a round is handed to the training thread as data (never printed and lost), and
the watchdog is told to end the process if the rank does not abort by itself.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from mpi4py import MPI
from mpi4py.util import pkl5

from flodl_mpi.config import ON_NON_FINITE
from flodl_mpi.divergence import TrendGuard, triple_from_sums
from flodl_mpi.errors import CohortError, NonFiniteError, RoundError
from flodl_mpi.outer import OuterOptimizer
from flodl_mpi.realized_work import round_masses
from flodl_mpi.reduce import MAX_COUNT, ReduceStats, control_gather, sumcount_reduce
from flodl_mpi.reporting import BATCH_COLUMNS, EpochReport, EpochSummary, aggregate_epoch
from flodl_mpi.wire import DEFAULT_CHUNK_ELEMS, WireLayout, sum_squares_pieces

__all__ = ["RoundUpdate", "Bridge"]

# The ack of a rank's last round rides its next control gather (SPEC §2 step 9).
_ACK = ("divergence", "pre_norm", "post_norm", "pack_ms", "allreduce_ms", "unpack_ms", "outer_ms", "bytes")
_ROUND_HEAD = ("steps", "window", "stop", "non_finite")
# Bits of the non_finite column: what this rank found not finite before the round.
_LOSS, _TENSORS = 1, 2


@dataclass
class RoundUpdate:
    """What the training thread adopts after a round (SPEC §2 step 8).

    Attributes:
        version: rounds completed so far, skipped ones included.
        adopted: True when the staging holds a new consensus to copy into the
            model; False when the round was skipped (no rank moved) or realized
            no mass, and every rank keeps its own tensors.
        steps_at_snapshot: the ``n_r`` this rank sent; subtract it (do not zero).
        stop: some rank asked to stop; every rank stops after this round.
        divergence, post_norm, pre_norm: this rank's triple (SPEC §3).
        quarantined: ranks that sent mass 0 because their loss or tensors were
            not finite (the same tuple on every rank); they adopted the consensus.
        outer_stepped: the outer optimizer turned the consensus into the new
            global parameters this round (never for ``--outer avg``).
    """

    version: int
    adopted: bool
    steps_at_snapshot: int
    stop: bool
    divergence: float
    post_norm: float
    pre_norm: float
    quarantined: tuple[int, ...] = ()
    #: The outer optimizer stepped on this round's consensus (SPEC §7): some rank
    #: that contributed mass had trained since the last consensus.
    outer_stepped: bool = False


@dataclass
class _Failure:
    round: int
    stage: str
    error: BaseException


class _Close:
    pass


class Bridge:
    """Runs averaging rounds for one rank, in a background thread.

    Args:
        comm: a communicator for the bridge alone (``comm_world.Dup()``); the
            bridge frees it on :meth:`close`.
        param_shapes: shapes of ``named_parameters()`` in order.
        buffer_shapes: shapes of the *floating* buffers of ``named_buffers()``
            in order (integer buffers keep their local values and never travel).
        gamma: the params mass exponent (SPEC §1).
        chunk_elems: elements per Allreduce piece, in ``[1, 2**31 - 1]``.
        writer: rank 0's metrics writer (``append(table, rows)``), else None.
        anchor: the window length recorded in the round metrics.
        threaded: False runs each round inline on the caller's thread (MPI
            without THREAD_SERIALIZED support).
        watchdog: object with ``round_started()``, ``round_finished()`` and
            ``failed()``; None for none.
        fault: test hook ``fault(round, stage)`` called at each stage; may raise.
        on_non_finite: ``"quarantine"`` (default): a rank whose loss, parameters
            or floating buffers are not finite sends mass 0 for the round and
            adopts the finite ranks' consensus; the job stops only when no rank
            is finite. ``"stop"``: any non-finite rank stops the job.
        outer: an :class:`~flodl_mpi.outer.OuterOptimizer` over the params
            (``len == sum of param sizes``), stepped on the consensus of every
            round in which a contributing rank trained, before adoption; None
            (or kind ``avg``) adopts the consensus as it is (SPEC §7). The
            bridge thread owns it while rounds run; read or load its state
            between rounds only.

    Non-finite values: each rank checks its own tensors (the pre-round sum of
    squares, a pass before the control gather) and is told whether its loss
    was finite; the flag rides the control gather, so whom to quarantine, and
    whether to stop, is decided from the gathered matrix on every rank alike.
    A stop raises :class:`NonFiniteError` on every rank before any reduce
    (staging untouched); a consensus that overflows although every rank was
    finite raises it after the reduced piece showed it (same on every rank).

    Failure semantics: a failed round leaves the staging (so bound
    parameters) undefined; the
    training thread's :meth:`round` or :meth:`epoch_end` raises (a
    :class:`CohortError` as is, anything else as :class:`RoundError` naming the
    stage); the bridge thread ends. Nothing already written to disk is touched.

    Example::

        bridge = Bridge(comm.Dup(), shapes, buf_shapes, gamma=1.0)
        bridge.start()
        for window in windows:
            ...                      # train this rank's batches, n += 1 per step
            for dst, p in zip(bridge.param_tensors, model.parameters()):
                dst.copy_(p.detach())
            update = bridge.round(steps=n, window=k, stop=False)
            if update.adopted: ...   # copy bridge.param_tensors back into the model
            n -= update.steps_at_snapshot
        bridge.close()
    """

    def __init__(
        self,
        comm: MPI.Comm,
        param_shapes: Sequence[Sequence[int]],
        buffer_shapes: Sequence[Sequence[int]] = (),
        *,
        gamma: float = 1.0,
        chunk_elems: int = DEFAULT_CHUNK_ELEMS,
        writer=None,
        anchor: int = 1,
        threaded: bool = True,
        watchdog=None,
        fault: Callable[[int, str], None] | None = None,
        on_non_finite: str = "quarantine",
        outer: OuterOptimizer | None = None,
    ) -> None:
        if on_non_finite not in ON_NON_FINITE:
            raise ValueError(f"on_non_finite must be one of {', '.join(ON_NON_FINITE)}, got {on_non_finite!r}")
        if not math.isfinite(gamma):
            raise ValueError(f"gamma must be finite, got {gamma!r}")
        if not 1 <= int(chunk_elems) <= MAX_COUNT:
            raise ValueError(f"chunk_elems must be in [1, {MAX_COUNT}], got {chunk_elems!r}")
        self.comm = comm
        self.rank, self.world_size = comm.rank, comm.size
        self.gamma = float(gamma)
        self.anchor = int(anchor)
        self.on_non_finite = on_non_finite
        self.outer = outer
        # Plan once (STYLE 21): layouts, staging, frames and scratch persist.
        self._p = _Plane(WireLayout(param_shapes, chunk_elems))
        if outer is not None and outer.n != self._p.layout.n:
            raise ValueError(f"outer is over {outer.n} elements, the params over {self._p.layout.n}")
        self._b = _Plane(WireLayout(buffer_shapes, chunk_elems))
        #: torch views of the params staging, in ``param_shapes`` order.
        self.param_tensors = self._p.tensors
        #: torch views of the floating-buffer staging, in ``buffer_shapes`` order.
        self.buffer_tensors = self._b.tensors
        self._writer = writer if self.rank == 0 else None
        self._watchdog = watchdog
        self._fault = fault
        self._threaded = threaded
        self.version = 0
        self.guard = TrendGuard()
        self._stage = "idle"
        self._ack = np.full(len(_ACK), np.nan)
        self._pending: dict | None = None  # rank 0: the round record awaiting acks
        # Ranks whose divergence the guard reads in the acks of the last round:
        # those that contributed mass (not idle, not quarantined); same on every rank.
        self._contributed = np.zeros(self.world_size, dtype=bool)
        self._t0 = time.monotonic()
        self._failed: _Failure | None = None
        self._requests: queue.Queue = queue.Queue()
        self._replies: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._serve_forever, name="flodl-bridge", daemon=True)
        self._pkl5 = pkl5.Intracomm(comm)

    # ---- training-thread side -------------------------------------------------

    def start(self) -> None:
        """Start the bridge thread (a no-op when not threaded)."""
        if self._threaded:
            self._thread.start()

    def broadcast(self, root: int = 0) -> None:
        """Overwrite every rank's staging with ``root``'s (call before :meth:`start`).

        Collective, on the main thread during setup: replicas start from the
        same parameters and buffers, whatever each rank's initializer did.
        """
        if self._thread.is_alive():
            raise RuntimeError("broadcast() is for setup, before start()")
        for plane in (self._p, self._b):
            self.comm.Bcast([plane.staging, MPI.FLOAT], root=root)

    def round(self, steps: int, window: int, stop: bool = False, loss_finite: bool = True) -> RoundUpdate:
        """One averaging round; blocks until the consensus is in the staging.

        Collective: every rank calls it, the same number of times, idle ranks
        (``steps == 0``) too. Fill :attr:`param_tensors` and
        :attr:`buffer_tensors` first.

        Args:
            steps: optimizer steps since the consensus last adopted (``n_r``).
            window: batches this rank ran in the window (for the metrics).
            stop: this rank asks the cohort to stop after this round.
            loss_finite: every loss of this rank's window was finite; False
                quarantines the rank for this round (see ``on_non_finite``).

        Raises:
            NonFiniteError: raised identically on every rank: no rank was
                finite, or any rank was not and ``on_non_finite == "stop"``, or
                the consensus overflowed.
            CohortError: raised identically on every rank.
            RoundError: the round failed on this rank.
        """
        return self._call(("round", int(steps), int(window), bool(stop), bool(loss_finite)))

    def epoch_end(self, report: EpochReport, batch_rows: np.ndarray, epoch: int) -> EpochSummary:
        """Exchange the epoch's reports; every rank gets the same :class:`EpochSummary`.

        Collective, like :meth:`round`. ``batch_rows`` is float64
        ``(k, len(BATCH_COLUMNS))``: this rank's per-batch records, gathered to
        rank 0 for ``metrics.h5``.
        """
        rows = np.ascontiguousarray(batch_rows, dtype=np.float64).reshape(-1, len(BATCH_COLUMNS))
        return self._call(("epoch", report, rows, int(epoch)))

    @property
    def elapsed(self) -> float:
        """Seconds since the run started (``time_s`` of the metrics); kept across a resume."""
        return time.monotonic() - self._t0

    def resume_clock(self, elapsed: float) -> None:
        """Continue a resumed run's clock from ``elapsed`` seconds."""
        self._t0 = time.monotonic() - float(elapsed)

    def gather_to_root(self, obj):
        """Gather one object per rank to rank 0 (a list there, None elsewhere).

        Collective, like :meth:`round`; for checkpoints (each rank's optimizer
        and RNG state), not for every round: it pickles in memory between our
        own ranks (never from a file), arrays out of band.
        """
        return self._call(("gather", obj))

    def allgather(self, obj) -> list:
        """Gather one small object per rank to every rank (a list of W, the same everywhere).

        Collective, like :meth:`round`; once per epoch at most (the Python API's
        epoch boundary: recorded scalars, intents, evaluation sums), pickled in memory.
        """
        return self._call(("allgather", obj))

    def close(self) -> None:
        """Stop the bridge thread and free its communicator."""
        if self._threaded and self._thread.is_alive():
            self._requests.put(_Close())
            self._thread.join()
        if self._failed is None and self.comm != MPI.COMM_NULL:
            self.comm.Free()

    def _call(self, request):
        if self._failed is not None:
            raise RoundError(f"rank {self.rank}: the bridge already failed in round {self._failed.round}")
        if self._threaded:
            self._requests.put(request)
            reply = self._replies.get()
        else:
            reply = self._serve_one(request)
        if isinstance(reply, _Failure):
            self._failed = reply
            if isinstance(reply.error, CohortError):
                raise reply.error
            raise RoundError(
                f"rank {self.rank}: averaging round {reply.round} failed at stage "
                f"'{reply.stage}': {type(reply.error).__name__}: {reply.error}"
            ) from reply.error
        return reply

    # ---- bridge-thread side ---------------------------------------------------

    def _serve_forever(self) -> None:
        while True:
            request = self._requests.get()
            if isinstance(request, _Close):
                return
            reply = self._serve_one(request)
            self._replies.put(reply)
            if isinstance(reply, _Failure):
                return

    def _serve_one(self, request):
        try:
            if self._watchdog is not None:
                self._watchdog.round_started()
            if request[0] == "round":
                reply = self._round(*request[1:])
            elif request[0] == "epoch":
                reply = self._epoch(*request[1:])
            elif request[0] == "allgather":
                self._enter("allgather")
                reply = self._pkl5.allgather(request[1])
            else:
                self._enter("state gather")
                # pickle protocol 5, buffers out of band: no copy of the arrays, and
                # no 2 GiB limit on one rank's optimizer state (mpi4py.util.pkl5).
                reply = self._pkl5.gather(request[1], root=0)
            if self._watchdog is not None:
                self._watchdog.round_finished()
            return reply
        except BaseException as exc:  # crosses to the training thread as data
            if self._watchdog is not None:
                self._watchdog.failed()
            return _Failure(self.version, self._stage, exc)

    def _enter(self, stage: str) -> None:
        self._stage = stage
        if self._fault is not None:
            self._fault(self.version, stage)

    def _round(self, steps: int, window: int, stop: bool, loss_finite: bool) -> RoundUpdate:
        p, b = self._p, self._b
        # -- this rank's own check, before the gather: a float64-safe sum of squares
        # (one pass) is finite exactly when the tensors hold no NaN or infinity.
        # Why a pass of its own: with bound params the staging *is* the params and
        # each piece is unpacked right after its Allreduce, so a rank's non-finite
        # values must be known to every rank before the first pack, or the finite
        # ranks' pre-round values are gone. Deferring the unpack costs a pass too
        # (out of cache); this one is a plain read (measured: +4-5 ms at 16M params
        # on a loaded 2-core machine, nothing measurable at 1M), and no extra collective.
        self._enter("pre norm")
        t0 = time.perf_counter()
        pre_sq = p.sum_squares()
        flag = (0 if loss_finite else _LOSS) | (0 if math.isfinite(pre_sq + b.sum_squares()) else _TENSORS)
        pre_ms = 1e3 * (time.perf_counter() - t0)  # counted as pack time: it was fused there before
        self._enter("control gather")
        row = np.concatenate([[steps, window, float(stop), flag], self._ack])
        gathered = control_gather(self.comm, row)
        self._take_acks(gathered[:, len(_ROUND_HEAD) :])
        # -- decide, from the gathered matrix only: every rank takes the same branch
        all_steps, flags = gathered[:, 0], gathered[:, 3].astype(np.int64)
        if flags.all() or (flags.any() and self.on_non_finite == "stop"):
            raise NonFiniteError(_non_finite_message(self.version, flags, self.on_non_finite))
        masses = round_masses(all_steps, flags == 0, self.gamma)
        skipped = not masses.quarantined and float(all_steps.sum()) == 0.0
        if skipped:
            # No rank moved: every snapshot already equals the consensus.
            stats = ReduceStats()
        else:
            self._enter("params reduce")
            stats = sumcount_reduce(self.comm, p.layout, p.staging, p.frame, masses.wire[self.rank], p.scratch)
        stats.pre_sq = pre_sq
        stats.pack_ms += pre_ms
        self._enter("divergence")
        if not stats.post_finite:  # read from the reduced values: every rank is here
            raise NonFiniteError(
                f"non-finite consensus in round {self.version}: every rank's parameters were finite but their "
                "weighted sum overflowed float32 (values near 1e38; training diverged? lower --lr); the job "
                "stops and saves nothing from this round")
        if not stats.realized:  # skipped: pre is post
            triple = triple_from_sums(0.0, stats.pre_sq, stats.pre_sq)
        else:
            triple = triple_from_sums(stats.diff_sq, stats.post_sq, stats.pre_sq)
        if b.layout.n and stats.realized:
            self._enter("buffers reduce")
            bstats = sumcount_reduce(self.comm, b.layout, b.staging, b.frame, masses.buffers[self.rank], b.scratch)
            if not bstats.post_finite:
                raise NonFiniteError(
                    f"non-finite buffers consensus in round {self.version}: every rank's buffers were finite but "
                    "their sum overflowed float32; the job stops and saves nothing from this round")
            stats.bytes += bstats.bytes
            stats.pack_ms += bstats.pack_ms
            stats.allreduce_ms += bstats.allreduce_ms
            stats.unpack_ms += bstats.unpack_ms
        # -- outer step (SPEC §7): on the params consensus, identically on every rank
        # (the same consensus, the same outer state), before anyone adopts it. Only a
        # round in which a contributing rank trained steps: a round that realized no
        # mass, or only the synthetic mass that hands a quarantined rank the last
        # consensus back, would be a pure momentum step.
        outer_ms, outer_stepped = 0.0, False
        if self.outer is not None and self.outer.kind != "avg" and stats.realized:
            trained = float(np.dot(np.asarray(masses.wire) > 0, all_steps)) > 0
            if trained:
                self._enter("outer step")
                t0 = time.perf_counter()
                self.outer.step(p.staging)
                outer_ms, outer_stepped = 1e3 * (time.perf_counter() - t0), True
        self._stage = "update"
        round_index = self.version
        self.version += 1
        self._contributed = np.asarray(masses.wire) > 0
        divergence, post_norm, pre_norm = triple
        self._ack = np.array([divergence, pre_norm, post_norm, stats.pack_ms, stats.allreduce_ms,
                              stats.unpack_ms, outer_ms, stats.bytes])
        if self._writer is not None:
            quarantined = np.zeros(self.world_size, dtype=bool)
            quarantined[masses.quarantined] = True
            self._pending = {
                "round": round_index, "version": self.version,
                "time_s": self.elapsed, "skipped": skipped,
                "steps": all_steps.astype(np.int64), "mass": np.asarray(masses.mass),
                "quarantined": quarantined,
                "window": gathered[:, 1].astype(np.int64), "anchor": self.anchor,
            }
        return RoundUpdate(
            version=self.version,
            adopted=stats.realized,
            steps_at_snapshot=steps,
            stop=bool(gathered[:, 2].any()),
            divergence=divergence, post_norm=post_norm, pre_norm=pre_norm,
            quarantined=tuple(masses.quarantined),
            outer_stepped=outer_stepped,
        )

    def _take_acks(self, acks: np.ndarray) -> None:
        """Feed the guard the previous round's divergences; rank 0 writes its record."""
        if np.isnan(acks[:, 0]).all():  # no round before this gather
            return
        # The guard reads the ranks that contributed mass: an idle rank's or a
        # quarantined rank's divergence (NaN for the latter) says nothing of the
        # cohort's drift. A round where none did (skipped) reads as 0.
        contributed = acks[self._contributed, 0]
        verdict = self.guard.observe(float(np.max(contributed)) if contributed.size else 0.0)
        if self._pending is not None:
            a = {name: acks[:, i] for i, name in enumerate(_ACK)}
            rec = dict(self._pending)
            rec.update(
                divergence=a["divergence"], pre_norm=a["pre_norm"], post_norm=float(a["post_norm"][0]),
                pack_ms=a["pack_ms"], allreduce_ms=a["allreduce_ms"], unpack_ms=a["unpack_ms"],
                outer_ms=a["outer_ms"], bytes=int(a["bytes"][0]), guard=int(verdict),
            )
            self._writer.append("rounds", {k: np.asarray([v]) for k, v in rec.items()})
            self._pending = None
        self._ack = np.full(len(_ACK), np.nan)

    def _epoch(self, report: EpochReport, batch_rows: np.ndarray, epoch: int) -> EpochSummary:
        self._enter("epoch gather")
        # The row count travels on its own: after a resume mid-epoch the report also
        # covers batches whose records were written before the stop.
        row = np.concatenate([self._ack, [batch_rows.shape[0]], report.to_row()])
        gathered = control_gather(self.comm, row)
        self._take_acks(gathered[:, : len(_ACK)])
        summary = aggregate_epoch(gathered[:, len(_ACK) + 1 :], epoch=epoch, rounds=self.version)
        records = gathered[:, len(_ACK)].astype(np.int64)
        summary.batch_records = int(records.sum())
        self._enter("batch records gather")
        counts = [int(c) * len(BATCH_COLUMNS) for c in records]
        recv = None
        if self.rank == 0:
            recvbuf = np.empty(sum(counts), dtype=np.float64)
            recv = [recvbuf, counts, np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist(), MPI.DOUBLE]
        self.comm.Gatherv([batch_rows, MPI.DOUBLE], recv, root=0)
        if self._writer is not None:
            table = recv[0].reshape(-1, len(BATCH_COLUMNS))
            if len(table):
                cols = {name: table[:, i] for i, name in enumerate(BATCH_COLUMNS)}
                for name in ("rank", "epoch", "step"):
                    cols[name] = cols[name].astype(np.int64)
                cols["rank"] = cols["rank"].astype(np.int32)
                self._writer.append("batches", cols)
            self._writer.append("epochs", _epoch_row(summary, self.elapsed))
        return summary


class _Plane:
    """Staging, wire frame and scratch of one layout (params or float buffers)."""

    def __init__(self, layout: WireLayout) -> None:
        self.layout = layout
        self.staging = layout.new_staging()
        self.frame = layout.new_frame()
        self.scratch = layout.new_scratch()
        self.tensors = [torch.from_numpy(v) for v in layout.views(self.staging)]

    def sum_squares(self) -> float:
        return sum_squares_pieces(self.staging, self.layout)


def _non_finite_message(round_: int, flags: np.ndarray, on_non_finite: str) -> str:
    """One line naming every rank whose loss or tensors were not finite, and why the job stops."""
    parts = []
    for r, f in enumerate(flags.tolist()):
        what = [w for bit, w in ((_LOSS, "loss"), (_TENSORS, "parameters/buffers")) if f & bit]
        if what:
            parts.append(f"{r} ({' and '.join(what)})")
    why = ("no rank is finite" if flags.all() else "--on-non-finite stop")
    return (f"non-finite values in round {round_}: rank(s) {', '.join(parts)} had NaN or infinite values; {why}, "
            "so the job stops (training diverged? lower --lr) and saves nothing from this round; "
            "checkpoints saved before stay")


def _epoch_row(s: EpochSummary, time_s: float) -> dict[str, np.ndarray]:
    row = {
        # epoch counted from 1, as in the log and the checkpoint names
        "epoch": s.epoch + 1, "time_s": time_s, "rounds": s.rounds, "avg_loss": s.avg_loss,
        "epoch_ms": s.epoch_ms, "batches": s.batches, "per_rank_loss": s.per_rank_loss,
        "per_rank_batches": s.per_rank_batches, "per_rank_samples": s.per_rank_samples,
        "per_rank_throughput": s.per_rank_throughput, "per_rank_batch_share": s.per_rank_batch_share,
        "per_rank_epoch_ms": s.per_rank_epoch_ms, "per_rank_compute_ms": s.per_rank_compute_ms,
        "per_rank_data_ms": s.per_rank_data_ms, "test_loss": s.test_loss, "test_accuracy": s.test_accuracy,
    }
    return {k: np.asarray([v]) for k, v in row.items()}
