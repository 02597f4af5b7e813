"""The bridge: the one thread per rank that runs averaging rounds (SPEC §2).

Responsibilities: it is the only MPI caller while training runs, on its own
duplicated communicator; it owns the staging the training thread snapshots
into and adopts from (for float32 CPU models the parameters themselves live
there, see ``replica.Replica.bind``); it runs the control gather, the all-idle
skip, the params and buffers reduces, the divergence triple and the version,
the epoch exchange, and at checkpoints the gather of each rank's state. It is
the transport only: what the gathered values mean for the next window is the
policy's (:mod:`flodl_mpi.policy.policies`, fed here from the gathered matrix on every rank
alike), and rank 0's ``metrics.h5`` rows are the recorder's
(:mod:`flodl_mpi.outputs.recorder`). Escape hatch: any error inside
a round is handed to the training thread as data (never printed and lost), and
the watchdog is told to end the process if the rank does not abort by itself.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from mpi4py import MPI
from mpi4py.util import pkl5

from flodl_mpi.config import ON_NON_FINITE
from flodl_mpi.protocol.control import ACK, NON_FINITE_LOSS, NON_FINITE_TENSORS, ROUND, ROUND_HEAD, Columns
from flodl_mpi.protocol.divergence import TrendGuard, Verdict, triple_from_sums
from flodl_mpi.errors import CohortError, NonFiniteError, RankFailure, RoundError
from flodl_mpi.outputs.metrics import WriterError
from flodl_mpi.protocol.optimizer_state import OptimizerStateAverager
from flodl_mpi.protocol.outer import OuterOptimizer
from flodl_mpi.policy.policies import FixedPolicy, Plan, Policy, RoundFacts
from flodl_mpi.protocol.realized_work import is_realized, round_masses
from flodl_mpi.outputs.recorder import recorder_for
from flodl_mpi.runtime import hooks
from flodl_mpi.runtime.elastic import is_rank_failure
from flodl_mpi.transport.reduce import MAX_COUNT, Reducer, ReduceStats, WireOptions, control_gather
from flodl_mpi.protocol.epoch_report import BATCH_COLUMNS, EPOCH_FIELDS, EpochReport, EpochSummary, aggregate_epoch
from flodl_mpi.protocol.round_profile import RunProfile, bus_bandwidth
from flodl_mpi.protocol.wire import DEFAULT_CHUNK_ELEMS, WireLayout, sum_squares_pieces

__all__ = ["RoundUpdate", "Bridge", "boundary_verdict"]

_LOSS, _TENSORS = NON_FINITE_LOSS, NON_FINITE_TENSORS
#: The epoch exchange's row: the last round's ack, the batch records' count, the report.
_EPOCH = ACK + Columns("records") + Columns(*EPOCH_FIELDS)
_ADOPT_MS = ACK.index("adopt_ms")


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
    #: The policy's plan after this round (the same on every rank): the next window's.
    plan: Plan | None = None
    #: The guard's verdict on the round before this one (None: there was none).
    verdict: Verdict | None = None
    #: Every rank sent ``joined`` 1 (its own loop is out of data, `flodl_mpi.Averager.join`): from
    #: the gathered matrix, the same on every rank; the join ends after this round.
    all_joined: bool = False


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
        writer: rank 0's metrics writer (``append(table, rows)``), else None or a ``NoMetricsWriter``;
            rank 0 then records rounds and epochs (:mod:`flodl_mpi.outputs.recorder`).
        anchor: the fixed window of the default policy (when ``policy`` is None).
        threaded: False runs each round inline on the caller's thread (MPI
            without THREAD_SERIALIZED support). A world of one always runs
            inline (:attr:`alone`).
        watchdog: object with ``round_started()``, ``round_finished()`` and
            ``failed()``; None for none.
        on_non_finite: ``"quarantine"`` (default): a rank whose loss, parameters
            or floating buffers are not finite sends mass 0 for the round and
            adopts the finite ranks' consensus; the job stops only when no rank
            is finite. ``"stop"``: any non-finite rank stops the job.
        outer: an :class:`~flodl_mpi.protocol.outer.OuterOptimizer` over the params
            (``len == sum of param sizes``), stepped on the consensus of every
            round in which a contributing rank trained, before adoption; None
            (or kind ``avg``) adopts the consensus as it is (SPEC §7). The
            bridge thread owns it while rounds run; read or load its state
            between rounds only.
        policy: the :class:`~flodl_mpi.policy.policies.Policy` the bridge feeds the gathered
            facts of every round (and owns while rounds run: read :attr:`policy`
            between rounds, or the plan each :class:`RoundUpdate` carries); None:
            a fixed window of ``anchor`` batches with the default guard.
        wire: how the frames travel (:class:`~flodl_mpi.transport.reduce.WireOptions`:
            node reduce, hierarchical, bf16); None for the defaults. The same
            on every rank.
        pin_staging: allocate the staging in pinned host memory when CUDA
            is available (a rank whose model is on a GPU: asynchronous copies).
        elastic: ``--on-rank-failure shrink`` (an MPI with ULFM): a call that fails
            because a peer died or the communicator was revoked raises
            :class:`~flodl_mpi.errors.RankFailure` (the survivors shrink), not
            ``RoundError``, and does not arm the watchdog's exit.

    Non-finite values: each rank checks its own tensors (the pre-round sum of
    squares, a pass before the control gather) and is told whether its loss
    was finite; the flag rides the control gather, so whom to quarantine, and
    whether to stop, is decided from the gathered matrix on every rank alike.
    A stop raises :class:`NonFiniteError` on every rank before any reduce
    (staging untouched); a consensus that overflows although every rank was
    finite raises it after the reduced piece showed it (same on every rank).
    One exception, for speed: with ``on_non_finite="stop"`` on the in-place
    path (:attr:`~flodl_mpi.transport.reduce.Reducer.checks_in_pass`) the params are not
    read before the gather; the pass sums every rank's values as it reads them
    and never writes a block whose consensus is not finite, and the gathered
    sums name the non-finite ranks: the same :class:`NonFiniteError` on every
    rank, raised after the pass (the params then hold the consensus in part:
    nothing of the round is saved, as for any stop).

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
        on_non_finite: str = "quarantine",
        outer: OuterOptimizer | None = None,
        policy: Policy | None = None,
        wire: WireOptions | None = None,
        pin_staging: bool = False,
        elastic: bool = False,
    ) -> None:
        if on_non_finite not in ON_NON_FINITE:
            raise ValueError(f"on_non_finite must be one of {', '.join(ON_NON_FINITE)}, got {on_non_finite!r}")
        if not math.isfinite(gamma):
            raise ValueError(f"gamma must be finite, got {gamma!r}")
        if not 1 <= int(chunk_elems) <= MAX_COUNT:
            raise ValueError(f"chunk_elems must be in [1, {MAX_COUNT}], got {chunk_elems!r}")
        self.comm = comm
        self.rank, self.world_size = comm.rank, comm.size
        #: ``--on-rank-failure shrink``: a call that fails because a peer died raises `RankFailure`.
        self.elastic = bool(elastic)
        self._call_started = 0.0  # time.monotonic() of the training thread's last request
        self.gamma = float(gamma)
        self.anchor = int(anchor)
        self.on_non_finite = on_non_finite
        self.outer = outer
        # Plan once (STYLE 21): layouts, staging, frames and scratch persist.
        self._p = _Plane(WireLayout(param_shapes, chunk_elems), comm, wire, pin_staging)
        if outer is not None and outer.n != self._p.layout.n:
            raise ValueError(f"outer is over {outer.n} elements, the params over {self._p.layout.n}")
        self._b = _Plane(WireLayout(buffer_shapes, chunk_elems), comm, wire, pin_staging)
        self._chunk_elems, self._pin_staging = int(chunk_elems), bool(pin_staging)
        # The optimizer state travels float32 whatever --bf16-wire or --wire says (its second
        # moment feeds a square root: flodl_mpi.protocol.optimizer_state).
        self._state_wire = replace(wire or WireOptions(), bf16=False, delta="off")
        self.optimizer_state: OptimizerStateAverager | None = None
        self._s = _Plane(WireLayout((), chunk_elems), comm, self._state_wire)
        #: torch views of the optimizer-state staging (:meth:`attach_optimizer_state`).
        self.state_tensors = self._s.tensors
        #: torch views of the params staging, in ``param_shapes`` order.
        self.param_tensors = self._p.tensors
        #: The params' reducer: how rounds travel (its ``path`` and ``nodes``, the same on every rank).
        self.reducer = self._p.reducer
        #: torch views of the floating-buffer staging, in ``buffer_shapes`` order.
        self.buffer_tensors = self._b.tensors
        self._recorder = recorder_for(self.rank, writer)
        self._watchdog = watchdog
        # A world of one has nothing to overlap: its rounds run inline, with no hand-off to a thread
        # (measured: the hand-off was 40 % of a round on the 2-core machine; issue 26 item 10).
        self._threaded = threaded and self.world_size > 1
        #: A world of one (``comm.size == 1``): the consensus of one rank is its own tensors, so a round moves
        #: nothing (no gather, no reduce, no pass but the pre-round check); what it decides and records is the same.
        self.alone = self.world_size == 1
        self.version = 0
        self.policy = policy if policy is not None else FixedPolicy(self.world_size, max(1, int(anchor)), TrendGuard())
        self._stage = "idle"
        self._ack = ACK.row()
        self._snapshot_ms = math.nan  # the training thread's snapshot time for the next submit()
        self._inflight = False  # a submitted round whose reply was not taken yet
        self._reply = None  # unthreaded: the reply of the round run at submit()
        # Ranks whose divergence the guard reads in the acks of the last round:
        # those that contributed mass (not idle, not quarantined); same on every rank.
        self._contributed = np.zeros(self.world_size, dtype=bool)
        self._t0 = time.monotonic()
        self._failed: _Failure | None = None
        self._requests: queue.Queue = queue.Queue()
        self._replies: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._serve_forever, name="flodl-bridge", daemon=True)
        self._torch_threads = torch.get_num_threads()  # the rank's budget, set by the caller's thread
        #: Every rank's averaging profile, summed from the acks (the end-of-run lines).
        self.profile = RunProfile(self.world_size)
        self._pkl5 = pkl5.Intracomm(comm)

    @property
    def guard(self) -> TrendGuard:
        """The policy's divergence guard (its state goes into checkpoints)."""
        return self.policy.guard

    # ---- training-thread side -------------------------------------------------

    def start(self) -> None:
        """Start the bridge thread (a no-op when not threaded)."""
        if self._threaded:
            self._thread.start()

    def attach_optimizer_state(self, averager: OptimizerStateAverager) -> None:
        """Average the optimizer state too (``--average-optimizer-state``), in a third frame.

        Call before :meth:`start`, on every rank alike (the layout comes from the
        optimizer's structure; planning the frame is collective). Each realized
        round then reduces the state the training thread put into
        :attr:`state_tensors` with the parameters' masses, after the buffers, and
        ``averager.finish`` runs on the consensus before anyone adopts it
        (flodl_mpi.protocol.optimizer_state).
        """
        if self._thread.is_alive():
            raise RuntimeError("attach_optimizer_state() is for setup, before start()")
        self.optimizer_state = averager
        self._s.reducer.free()
        self._s = _Plane(WireLayout(averager.wire_shapes, self._chunk_elems), self.comm, self._state_wire,
                         self._pin_staging)
        self.state_tensors = self._s.tensors

    def broadcast(self, root: int = 0) -> None:
        """Overwrite every rank's staging with ``root``'s (call before :meth:`start`).

        Collective, on the main thread during setup: replicas start from the
        same parameters and buffers, whatever each rank's initializer did.
        """
        if self._thread.is_alive():
            raise RuntimeError("broadcast() is for setup, before start()")
        for plane in (self._p, self._b):
            self.comm.Bcast([plane.staging, MPI.FLOAT], root=root)

    def round(self, steps: int, window: int, stop: bool = False, loss_finite: bool = True, *,
              batch_ms: float = math.nan, quota: int = 0, anchor: int = 0, calls: float = math.nan,
              joined: float = math.nan) -> RoundUpdate:
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
            batch_ms: this rank's mean ms per batch in the window (data wait and
                compute only; NaN for none): the balancer's speed reading.
            quota, anchor: the plan the window ran under (recorded).
            calls: the own loop's ``step()`` calls in its epoch so far (see :meth:`boundary`).
            joined: the own loop's join state: 1 out of data (an idle rank in a join), 0 still
                stepping, NaN outside the own loop; :attr:`RoundUpdate.all_joined` says whether every rank sent 1.

        Raises:
            NonFiniteError: raised identically on every rank: no rank was
                finite, or any rank was not and ``on_non_finite == "stop"``, or
                the consensus overflowed.
            CohortError: raised identically on every rank.
            RoundError: the round failed on this rank.
        """
        self.submit(steps, window, stop, loss_finite, batch_ms=batch_ms, quota=quota, anchor=anchor, calls=calls,
                    joined=joined)
        return self.wait()

    def boundary(self, ending: int, calls: int) -> None:
        """The own loop's check that every rank reached the same boundary (``end_epoch``/``close``).

        Collective, like :meth:`round`, and shaped like one: its control gather
        matches a peer's round, so a rank that ends its epoch while another still
        calls ``step()`` is seen by both in the same gathered matrix, and both
        raise the same error (:func:`boundary_verdict`). When every rank is at the
        same boundary after as many ``step()`` calls, the previous round's acks
        (they rode this gather) complete its ``rounds`` row; no round runs.

        Args:
            ending: 1 from ``end_epoch()``, 2 from ``close()``.
            calls: this rank's ``step()`` calls in the epoch.

        Raises:
            CohortError: raised identically on every rank: the ranks are not at the same point.
        """
        row = ROUND_HEAD.row(steps=0, window=0, stop=0, non_finite=0, ending=int(ending), calls=int(calls))
        self._call(("boundary", row))

    def submit(self, steps: int, window: int, stop: bool = False, loss_finite: bool = True, *,
               batch_ms: float = math.nan, quota: int = 0, anchor: int = 0, calls: float = math.nan,
               joined: float = math.nan) -> None:
        """Start a round (arguments as :meth:`round`) and return at once; :meth:`wait` takes its update.

        For the ``async`` policy: the training thread trains on while the bridge
        runs the round, so the staging must not alias the live parameters (do not
        :meth:`~flodl_mpi.training.replica.Replica.bind`). At most one round is in flight;
        unthreaded, the round runs here and :meth:`wait` returns its update.

        Raises:
            RuntimeError: a round is in flight already.
            RoundError: the bridge failed before.
        """
        if self._inflight:
            raise RuntimeError("submit(): a round is in flight already; wait() for it first")
        row = ROUND_HEAD.row(steps=int(steps), window=int(window), stop=float(bool(stop)),
                             non_finite=0 if loss_finite else _LOSS, batch_ms=batch_ms, quota=quota, anchor=anchor,
                             calls=calls, snapshot_ms=self._snapshot_ms, joined=joined)
        self._snapshot_ms = math.nan
        self._send(("round", row))

    def wait(self) -> RoundUpdate:
        """The update of the round in flight; blocks until it is done.

        Raises:
            RuntimeError: no round is in flight.
            NonFiniteError, CohortError, RoundError: as :meth:`round`.
        """
        if not self._inflight:
            raise RuntimeError("wait(): no round is in flight")
        t0 = time.perf_counter()
        update = self._receive()
        # The training thread's blocked time rides this round's ack (the bridge thread
        # reads the ack only at the next request, after this write).
        self._ack[ACK.index("wait_ms")] = 1e3 * (time.perf_counter() - t0)
        return update

    def record_membership(self, change, members) -> None:
        """Rank 0: append ``change``'s ``membership`` row; later rows are keyed by ``members``' stable ids
        (`flodl_mpi.outputs.recorder.Recorder.membership`). Call between rounds (no round in flight)."""
        self._recorder.membership(change, members)

    def add_training_ms(self, part: str, ms: float) -> None:
        """Count ``ms`` of the training thread's own averaging work in the round's record.

        ``part`` ``"snapshot"``: copying the rank's values into the staging, before
        the next :meth:`submit` (recorded with that round); ``"adopt"``: copying the
        consensus back, after :meth:`wait` (recorded with the round just taken).
        Calls add up. The training thread calls it between :meth:`wait` and the next
        :meth:`submit`, when the bridge thread holds no round (the ack is its to write,
        as ``wait_ms`` is). metrics.h5 ``rounds/snapshot_ms`` and ``rounds/adopt_ms``.

        Raises:
            ValueError: another ``part``.
        """
        if part == "snapshot":  # plain floats: this runs twice a round, also for a small model
            self._snapshot_ms = ms if math.isnan(self._snapshot_ms) else self._snapshot_ms + ms
        elif part == "adopt":
            i = _ADOPT_MS
            self._ack[i] = ms if math.isnan(self._ack[i]) else self._ack[i] + ms
        else:
            raise ValueError(f"part must be 'snapshot' or 'adopt', got {part!r}")

    @property
    def in_flight(self) -> bool:
        """A round was submitted and its update not taken yet."""
        return self._inflight

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

    @property
    def wire_kind(self) -> str | None:
        """The delta wire's quantisation (``"bf16"``, ``"int8"``: ``--wire <kind>-delta``), None on the other wires."""
        d = self._p.reducer.delta
        return None if d is None else d.kind

    def wire_state(self, cohort: bool = True, mine: bool = True) -> tuple[dict[str, np.ndarray], dict[str, Any],
                                                                           dict[str, np.ndarray]] | None:
        """The delta wire's state for a checkpoint (``--wire bf16-delta`` / ``int8-delta``), None on the other wires.

        Returns ``(cohort arrays, cohort attrs, rank arrays)``, copies: ``wire_reference_<plane>`` (float32,
        the reference every rank holds alike: saved once, in ``/cohort``; absent before the plane's first
        round), the attrs ``{"wire": {"kind": ..., "planes": [...]}}`` naming the planes with a reference,
        and this rank's ``wire/error/<plane>`` (float32, its error feedback: saved per rank). ``<plane>``:
        ``params`` or ``buffers``. ``cohort`` / ``mine`` False: that part's arrays are not copied (empty).
        Call it between rounds (a checkpoint's: none in flight).
        """
        if self.wire_kind is None:
            return None
        shared, own, held = {}, {}, []
        for name, plane in (("params", self._p), ("buffers", self._b)):
            d = plane.reducer.delta
            if d is None:
                continue
            if d.has_reference:
                held.append(name)
                if cohort:
                    shared[f"wire_reference_{name}"] = d.reference.copy()
            if mine:
                own[f"wire/error/{name}"] = d.error.copy()
        return shared, {"wire": {"kind": self.wire_kind, "planes": held}}, own

    def load_wire_state(self, cohort: dict[str, np.ndarray] | None, attrs: dict[str, Any] | None,
                        mine: dict[str, np.ndarray] | None) -> None:
        """Put back what :meth:`wire_state` gave (the same ``cohort`` on every rank; ``mine`` this rank's own, None:
        the error feedback starts at zero); no-op on the other wires.

        Planes whose reference was not saved start with the exact first round, as a fresh run's.

        Raises:
            ValueError: saved for another quantisation (``--wire`` differs), or arrays of another size.
        """
        saved = dict((attrs or {}).get("wire") or {})
        for name, plane in (("params", self._p), ("buffers", self._b)):
            d = plane.reducer.delta
            if d is None:
                continue
            if saved.get("kind", d.kind) != d.kind:
                raise ValueError(f"the delta-wire state is for --wire {saved['kind']}-delta, the run uses "
                                 f"--wire {d.kind}-delta")
            held = name in saved.get("planes", ())
            d.load_state(np.asarray(cohort[f"wire_reference_{name}"]) if held else None,
                         None if mine is None or not held else mine.get(f"wire/error/{name}"))

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
            for plane in (self._p, self._b, self._s):
                plane.reducer.free()
            self.comm.Free()

    def _call(self, request):
        if self._inflight:
            raise RuntimeError(f"{request[0]}: a round is in flight; wait() for it first")
        self._send(request)
        return self._receive()

    def _send(self, request) -> None:
        if self._failed is not None:
            raise RoundError(f"rank {self.rank}: the bridge already failed in round {self._failed.round}")
        if self._threaded:
            self._call_started = time.monotonic()
            self._requests.put(request)
        else:
            self._call_started = time.monotonic()
            self._reply = self._serve_one(request)
        self._inflight = True

    def _receive(self):
        reply = self._replies.get() if self._threaded else self._reply
        self._inflight, self._reply = False, None
        if isinstance(reply, _Failure):
            self._failed = reply
            # A cohort-wide error, or rank 0's metrics writer having failed (its recorder
            # appends on this thread too): the cause itself, not "the round failed".
            if isinstance(reply.error, (CohortError, WriterError)):
                raise reply.error
            if self.elastic and is_rank_failure(reply.error):
                raise RankFailure(f"rank {self.rank}: a peer failed in round {reply.round} at stage '{reply.stage}': "
                                  f"{reply.error}", reply.stage, reply.round, self._call_started) from reply.error
            raise RoundError(
                f"rank {self.rank}: averaging round {reply.round} failed at stage "
                f"'{reply.stage}': {type(reply.error).__name__}: {reply.error}"
            ) from reply.error
        return reply

    # ---- bridge-thread side ---------------------------------------------------

    def _serve_forever(self) -> None:
        # torch's thread count does not carry over to a new thread: without this the
        # bridge's dots run on every core's worth of BLAS/OpenMP threads, fighting the
        # other ranks (measured: 20-40 ms instead of 5 us for a 28k-element dot on
        # the loaded 2-core machine; issue 9, "small models pay a small fixed cost").
        torch.set_num_threads(self._torch_threads)
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
            elif request[0] == "boundary":
                self._enter("boundary check")
                # A peer may be in a round: the same collectives before the gather (the
                # shared-memory path's node barrier in prepare), then the same gather.
                for plane in (self._p, self._b) if not self.alone else ():
                    plane.reducer.prepare(plane.staging)
                gathered = self._gather(np.concatenate([request[1], self._ack]))
                self._check_boundary(gathered)
                # The previous round's acks rode this gather: its row is complete now (an own
                # loop's last round, at close() or a stop, has no other gather after it).
                self._take_acks(ROUND.read(gathered), batch_ms=np.full(self.world_size, np.nan),
                                window=np.zeros(self.world_size), closes_window=False)
                reply = None
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
                if self.elastic and is_rank_failure(exc):
                    self._watchdog.round_finished()  # the survivors shrink: not an error this rank exits on
                else:
                    self._watchdog.failed()
            return _Failure(self.version, self._stage, exc)

    def _gather(self, row: np.ndarray) -> np.ndarray:
        """The control gather (one float64 row per rank, the same ``(W, k)`` matrix on every rank): through the
        node's shared file on the in-place path (no MPI call; a waiting rank yields its core), else MPI's
        Allgather; in a world of one, the row itself. Every control gather of the bridge takes the same way
        (a peer's round meets a boundary)."""
        if self.alone:
            return np.asarray(row, dtype=np.float64).reshape(1, -1)
        shared = self._p.reducer.node_gather
        return control_gather(self.comm, row) if shared is None else shared.allgather(row)

    def _prepare(self, plane: _Plane) -> float:
        """The pre-round ``sum(staging ** 2)`` (float64) of ``plane``: its reducer's pass (collective over the node on
        the packing shared-memory path), or, in a world of one, the read alone (no peer to meet, no segment to fill)."""
        if self.alone:  # torch's dot: no numpy warning to silence
            return sum_squares_pieces(plane.staging, plane.layout)
        return plane.reducer.prepare(plane.staging)

    def _enter(self, stage: str) -> None:
        self._stage = stage
        hooks.call("bridge_stage", self, stage)  # extension point (flodl_mpi.runtime.hooks): none by default

    def _deferred_check(self, stats: ReduceStats, flags: np.ndarray) -> float:
        """This rank's pre-round ``sum(params ** 2)`` when the pass checked the params (``--on-non-finite stop``
        on the in-place path); raises :class:`NonFiniteError` on every rank alike when some rank's were not
        finite, naming them as the pre-round check would have.

        The pass summed every rank's pre-round values as it read the segments
        (``stats.pre_sums``, gathered: the same on every rank). A round that
        ran no pass (no rank moved, or no mass realized: decided from gathered
        values) checks its own segment and gathers the flags (one more small
        gather, in such rounds only).
        """
        p = self._p
        if stats.pre_sums is not None:
            pre_sums = stats.pre_sums
        else:
            self._enter("pre norm")
            own = p.reducer.prepare(p.staging)
            pre_sums = self._gather(np.array([own], dtype=np.float64))[:, 0]
        bad = ~np.isfinite(pre_sums)
        if bad.any():
            flags = flags | np.where(bad, _TENSORS, 0)
            raise NonFiniteError(_non_finite_message(self.version, flags, self.on_non_finite))
        return float(pre_sums[self.rank])

    def _round(self, head: np.ndarray) -> RoundUpdate:
        p, b = self._p, self._b
        # -- this rank's own check, before the gather: a float64-safe sum of squares
        # (one pass) is finite exactly when the tensors hold no NaN or infinity.
        # Why a pass of its own: with bound params the staging *is* the params and
        # each piece is unpacked right after its Allreduce, so a rank's non-finite
        # values must be known to every rank before the first pack, or the finite
        # ranks' pre-round values are gone. Deferring the unpack costs a pass too
        # (out of cache); this one is a plain read (measured: +4-5 ms at 16M params
        # on a loaded 2-core machine, nothing measurable at 1M), and no extra collective.
        # On the shared-memory path the same pass is the pack: it copies the staging
        # into the rank's segment (Reducer.prepare), and the masses scale it in the sum.
        self._enter("pre norm")
        t0 = t_start = time.perf_counter()
        # Under --on-non-finite stop the in-place pass checks the params itself (below): no
        # rank is quarantined, so no rank's values need to survive a non-finite peer, and
        # the pass never writes a block whose consensus is not finite. The read is saved.
        deferred = self.on_non_finite == "stop" and p.reducer.checks_in_pass and not self.alone
        pre_sq = 0.0 if deferred else self._prepare(p)
        if not math.isfinite(pre_sq + self._prepare(b)):
            head[ROUND_HEAD.index("non_finite")] = int(head[ROUND_HEAD.index("non_finite")]) | _TENSORS
        pre_ms = 1e3 * (time.perf_counter() - t0)  # counted as pack time: it was fused there before
        self._enter("control gather")
        t_gather = time.perf_counter()
        gathered = self._gather(np.concatenate([head, self._ack]))
        if not self.alone:  # one rank is always at the same point as itself
            self._check_boundary(gathered)
        cols = ROUND.read(gathered)
        t_gathered = time.perf_counter()  # the round's own time (the balancer's overhead) starts here
        control_ms = 1e3 * (t_gathered - t_gather)
        steps = int(head[ROUND_HEAD.index("steps")])
        # -- decide, from the gathered matrix only: every rank takes the same branch
        anchor = int(max(0.0 if math.isnan(a) else a for a in cols["anchor"].tolist()))  # NaN (none) as 0
        verdict = self._take_acks(cols, batch_ms=cols["batch_ms"], window=cols["window"], anchor=anchor)
        all_steps, flags = cols["steps"], cols["non_finite"].astype(np.int64)
        if flags.all() or (flags.any() and self.on_non_finite == "stop"):
            raise NonFiniteError(_non_finite_message(self.version, flags, self.on_non_finite))
        masses = round_masses(all_steps.tolist(), (flags == 0).tolist(), self.gamma)  # plain floats: a round's few ranks
        skipped = not masses.quarantined and float(all_steps.sum()) == 0.0
        link_ms = math.nan  # the params reduce's wall time (nothing moved: NaN)
        if skipped:
            # No rank moved: every snapshot already equals the consensus.
            stats = ReduceStats()
        elif self.alone:  # one rank's consensus is its own tensors, bit for bit: nothing moves
            self._enter("params reduce")
            mass = float(masses.wire[0])
            stats = ReduceStats(total_mass=mass, realized=is_realized(mass), post_sq=pre_sq)
        else:
            self._enter("params reduce")
            t_reduce = time.perf_counter()
            stats = p.reducer.reduce(p.staging, masses.wire[self.rank], masses.wire, pre_sums=deferred)
            link_ms = 1e3 * (time.perf_counter() - t_reduce)
        if deferred:
            pre_sq = self._deferred_check(stats, flags)
        stats.pre_sq = pre_sq
        stats.pack_ms += pre_ms
        self._enter("divergence")
        if not stats.post_finite:  # read from the reduced values: every rank is here
            raise NonFiniteError(
                f"non-finite consensus in round {self.version}: every rank's parameters were finite but their "
                "weighted sum overflowed float32 (values near 1e38; training diverged? lower the learning rate); "
                "the job stops and saves nothing from this round")
        if not stats.realized:  # skipped: pre is post
            triple = triple_from_sums(0.0, stats.pre_sq, stats.pre_sq)
        else:
            triple = triple_from_sums(stats.diff_sq, stats.post_sq, stats.pre_sq)
        if b.layout.n and stats.realized and not self.alone:
            self._enter("buffers reduce")
            bstats = b.reducer.reduce(b.staging, masses.buffers[self.rank], masses.buffers)
            if not bstats.post_finite:
                raise NonFiniteError(
                    f"non-finite buffers consensus in round {self.version}: every rank's buffers were finite but "
                    "their sum overflowed float32; the job stops and saves nothing from this round")
            stats.bytes += bstats.bytes
            stats.pack_ms += bstats.pack_ms
            stats.allreduce_ms += bstats.allreduce_ms
            stats.unpack_ms += bstats.unpack_ms
        if self._s.layout.n and stats.realized and not self.alone:
            # The optimizer state, with the params' masses (flodl_mpi.protocol.optimizer_state).
            self._enter("optimizer state reduce")
            s = self._s
            sstats = s.reducer.reduce(s.staging, masses.wire[self.rank])
            if not sstats.post_finite:
                raise NonFiniteError(
                    f"non-finite optimizer state consensus in round {self.version}: every rank's parameters were "
                    "finite but their optimizer state's sum was not; the job stops and saves nothing from this round")
            self.optimizer_state.finish(s.staging, s.layout.offsets, masses.wire, all_steps)
            for name in ("bytes", "pack_ms", "allreduce_ms", "unpack_ms"):
                setattr(stats, name, getattr(stats, name) + getattr(sstats, name))
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
                p.reducer.rebase(p.staging)  # the delta wire's next reference: where every rank starts from
                outer_ms, outer_stepped = 1e3 * (time.perf_counter() - t0), True
        self._stage = "update"
        round_index = self.version
        self.version += 1
        self._contributed = np.asarray(masses.wire) > 0
        divergence, post_norm, pre_norm = triple
        self._ack = ACK.row(divergence=divergence, pre_norm=pre_norm, post_norm=post_norm, pack_ms=stats.pack_ms,
                            allreduce_ms=stats.allreduce_ms, unpack_ms=stats.unpack_ms, outer_ms=outer_ms,
                            bytes=stats.bytes, control_ms=control_ms,
                            round_ms=1e3 * (time.perf_counter() - t_gathered),
                            bridge_ms=1e3 * (time.perf_counter() - t_start), wait_ms=0.0,
                            **self._link_acks(link_ms, stats.realized))
        quarantined = np.zeros(self.world_size, dtype=bool)
        quarantined[masses.quarantined] = True
        self._recorder.round(
            round=round_index, version=self.version, time_s=self.elapsed, skipped=skipped,
            steps=all_steps.astype(np.int64), mass=np.asarray(masses.mass), quarantined=quarantined,
            window=cols["window"].astype(np.int64), quota=cols["quota"].astype(np.int64),
            anchor=anchor, batch_ms=cols["batch_ms"].copy(), snapshot_ms=cols["snapshot_ms"].copy(),
        )
        return RoundUpdate(
            version=self.version,
            adopted=stats.realized,
            steps_at_snapshot=steps,
            stop=bool(cols["stop"].any()),
            divergence=divergence, post_norm=post_norm, pre_norm=pre_norm,
            quarantined=tuple(masses.quarantined),
            outer_stepped=outer_stepped,
            plan=self.policy.plan(),
            verdict=verdict,
            all_joined=bool((cols["joined"] == 1.0).all()),
        )

    def _link_acks(self, link_ms: float, realized: bool) -> dict[str, float]:
        """The round's params reduce against its link (issue 25 item 4): its payload and ranks
        (`Reducer.link`), its wall time here, and the bus bandwidth of those (NaN: nothing moved, or the
        reduce ended at its mass slot with nothing realized)."""
        if self.alone or math.isnan(link_ms):
            return {"link_bytes": 0.0, "link_ranks": float(self.world_size), "link_ms": link_ms, "busbw_gbs": math.nan}
        nbytes, ranks = self._p.reducer.link
        busbw = bus_bandwidth(nbytes, link_ms, ranks) if realized else math.nan
        return {"link_bytes": float(nbytes), "link_ranks": float(ranks), "link_ms": link_ms, "busbw_gbs": busbw}

    def _take_acks(self, cols: dict, batch_ms: np.ndarray, window: np.ndarray, anchor: int = 0,
                   closes_window: bool = True) -> Verdict | None:
        """Feed the policy the gathered facts (the previous round's acks and this window's
        speeds); rank 0's recorder completes the previous round's record. Returns the
        guard's verdict on the previous round (None: no round before this gather)."""
        acked = not all(math.isnan(v) for v in cols["divergence"].tolist())  # plain floats: every round
        max_div, round_ms, wait_ms = None, math.nan, math.nan
        if acked:
            # The guard reads the ranks that contributed mass: an idle rank's or a
            # quarantined rank's divergence (NaN for the latter) says nothing of the
            # cohort's drift. A round where none did (skipped) reads as 0.
            contributed = cols["divergence"][self._contributed]
            max_div = float(contributed.max()) if contributed.size else 0.0
            round_ms, wait_ms = _max_if_finite(cols["round_ms"]), _max_if_finite(cols["wait_ms"])
        self._enter("policy")
        verdict = self.policy.observe(RoundFacts(batch_ms=np.asarray(batch_ms, dtype=np.float64),
                                                 window=np.asarray(window).astype(np.int64),
                                                 round_ms=round_ms, max_divergence=max_div, anchor=anchor,
                                                 closes_window=closes_window, wait_ms=wait_ms))
        if acked:
            self.profile.add(cols)
            self._recorder.acks(cols, verdict)
        self._ack = ACK.row()
        return verdict

    @staticmethod
    def _check_boundary(gathered: np.ndarray) -> None:
        cols = ROUND.read(gathered)
        why = boundary_verdict(cols["ending"], cols["calls"])
        if why is not None:  # from the gathered matrix: every rank raises it
            raise CohortError(why)

    def _epoch(self, report: EpochReport, batch_rows: np.ndarray, epoch: int) -> EpochSummary:
        self._enter("epoch gather")
        # The row count travels on its own: after a resume mid-epoch the report also
        # covers batches whose records were written before the stop.
        row = np.concatenate([self._ack, [batch_rows.shape[0]], report.to_row()])
        gathered = self._gather(row)
        cols = _EPOCH.read(gathered)
        nothing = np.full(self.world_size, np.nan)
        self._take_acks(cols, batch_ms=nothing, window=np.zeros(self.world_size), closes_window=False)
        start = _EPOCH.index(EPOCH_FIELDS[0])
        summary = aggregate_epoch(gathered[:, start : start + len(EPOCH_FIELDS)], epoch=epoch, rounds=self.version,
                                  allocation=self.policy.plan().quotas)
        records = cols["records"].astype(np.int64)
        summary.batch_records = int(records.sum())
        self._enter("batch records gather")
        counts = [int(c) * len(BATCH_COLUMNS) for c in records]
        recv = None
        if self.rank == 0:
            recvbuf = np.empty(sum(counts), dtype=np.float64)
            recv = [recvbuf, counts, np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist(), MPI.DOUBLE]
        self.comm.Gatherv([batch_rows, MPI.DOUBLE], recv, root=0)
        self._recorder.epoch(summary, None if recv is None else recv[0].reshape(-1, len(BATCH_COLUMNS)),
                             self.elapsed)
        return summary


class _Plane:
    """Staging, wire frame and scratch of one layout (params or float buffers)."""

    def __init__(self, layout: WireLayout, comm: MPI.Comm, wire: WireOptions | None, pinned: bool = False) -> None:
        self.layout = layout
        # collective: every plane, same order on every rank. Pageable staging may live in the
        # node's shared memory (the in-place reduce: no pack); pinned staging stays apart.
        self.reducer = Reducer(comm, layout, wire, in_place=not (pinned and torch.cuda.is_available()))
        self.staging = self.reducer.staging if self.reducer.staging is not None else layout.new_staging(pinned)
        self.tensors = [torch.from_numpy(v) for v in layout.views(self.staging)]


def _max_if_finite(values: np.ndarray) -> float:
    """``nanmax(values)`` when some value is finite, else NaN (plain floats: a round's few ranks)."""
    listed = values.tolist()
    if not any(math.isfinite(v) for v in listed):
        return math.nan
    return float(max(v for v in listed if not math.isnan(v)))


def _non_finite_message(round_: int, flags: np.ndarray, on_non_finite: str) -> str:
    """One line naming every rank whose loss or tensors were not finite, and why the job stops."""
    parts = []
    for r, f in enumerate(flags.tolist()):
        what = [w for bit, w in ((_LOSS, "loss"), (_TENSORS, "parameters/buffers")) if f & bit]
        if what:
            parts.append(f"{r} ({' and '.join(what)})")
    why = ("no rank is finite" if flags.all() else "--on-non-finite stop")
    return (f"non-finite values in round {round_}: rank(s) {', '.join(parts)} had NaN or infinite values; {why}, "
            "so the job stops (training diverged? lower the learning rate) and saves nothing from this round; "
            "checkpoints saved before stay")


def boundary_verdict(ending: np.ndarray, calls: np.ndarray) -> str | None:
    """Whether the own loop's ranks are at the same point, from one gathered control matrix alone.

    Args:
        ending: float64 (W,): per rank NaN (it is in a round, from ``step()``), 1
            (``end_epoch()``) or 2 (``close()``).
        calls: float64 (W,): per rank its ``step()`` calls in the epoch (NaN outside the own loop).

    Returns:
        None when every rank is in a round, or every rank is at the same boundary
        after as many ``step()`` calls; else one line naming each rank, where it is
        and its ``step()`` count.
    """
    if np.isnan(ending).all():  # every rank in a round: the common case, at a small model's per-round cost
        return None
    at = np.nan_to_num(ending, nan=0.0)
    if not at.any():
        return None
    counts = np.nan_to_num(calls, nan=-1.0)
    if len(set(at.tolist())) == 1 and len(set(counts.tolist())) == 1:
        return None
    where = {0.0: "in step() call", 1.0: "in end_epoch() after", 2.0: "in close() after"}
    ranks = "; ".join(f"rank {r} {where.get(float(a), '?')} {int(c)}" + ("" if a == 0 else " step() call(s)")
                      for r, (a, c) in enumerate(zip(at, counts)))
    return (f"the ranks called step() a different number of times in this epoch ({ranks}); every rank must call "
            "step() equally often between end_epoch() calls (a rank without a batch calls step(realized=False), or "
            "the loop runs in `with avg.join():`)")
