"""What the trainer does after a peer died in a round or the epoch exchange (``--on-rank-failure shrink``; SPEC §9).

Invariant: every survivor takes the same steps in the same order from values every
survivor holds alike: revoke the bridge's communicator (a survivor still waiting in the
round fails at once), shrink the world (`flodl_mpi.runtime.elastic.shrink`: the failed
set is the shrunk group's complement, the same everywhere), check that every survivor
failed in the same call (else the run stops, one line, every rank alike), then the new
world's watchdog, policy (`Policy.without_ranks`: the re-plan), bridge, and the
``membership`` row. The trainer (`flodl_mpi.training.rollback.shrink`) then goes
back to the window's start and re-splits the epoch's batches.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from flodl_mpi.errors import CohortError, RankFailure
from flodl_mpi.outputs import run_dir_lock, stale_files
from flodl_mpi.outputs.metrics import MetricsWriter, writer_or_none
from flodl_mpi.outputs.saver import saver_for
from flodl_mpi.protocol.membership import Membership, MembershipChange
from flodl_mpi.runtime.elastic import revoke, shrink
from flodl_mpi.runtime.world import Watchdog, World, agree
from flodl_mpi.training.train_log import log, log_to_stdout, open_train_log

__all__ = ["BETWEEN_ROUNDS", "Recovered", "Recovery", "after_death_between_rounds", "resolve_on_rank_failure",
           "take_new_world"]


@dataclasses.dataclass
class Recovered:
    """The survivors' new world, as one survivor holds it (`Recovery.__call__`).

    Attributes:
        bridge: the started bridge over the shrunk world (its round count and clock go on).
        rank, world_size: this rank's place now.
        writer: rank 0's metrics writer (the one it had), a NoMetricsWriter elsewhere.
        failed: the old ranks that died, ascending; left: their stable ids.
        steps_lost: per left id, the optimizer steps its abandoned window held at most.
        detection_ms: this rank's failed call's start to the failed set agreed.
        agreed_at: ``time.monotonic()`` then (recovery is timed from here).
        members: the membership after the change.
    """

    bridge: object
    rank: int
    world_size: int
    writer: object
    failed: tuple[int, ...]
    left: tuple[int, ...]
    steps_lost: tuple[int, ...]
    detection_ms: float
    agreed_at: float
    members: Membership

    def finish(self, trainer, window, what: str | None = None) -> MembershipChange:
        """Record the change (rank 0: the ``membership`` row, train.log's line) once the trainer is ready.

        ``window``: the abandoned round's window; None: the death was between rounds
        (`after_death_between_rounds`), no window abandoned, ``what`` saying what is made again."""
        recovery_ms = 1e3 * (time.monotonic() - self.agreed_at)
        change = MembershipChange(
            round=self.bridge.version,
            time_s=self.bridge.elapsed,
            left=self.left,
            joined=(),
            steps_lost=self.steps_lost,
            world_size=self.world_size,
            detection_ms=self.detection_ms,
            recovery_ms=recovery_ms,
        )
        self.bridge.record_membership(change, self.members)
        if trainer.writer.writes:
            ranks = ", ".join(f"{r} (id {i})" for r, i in zip(self.failed, self.left))
            if window is not None:
                what = (f"the round was abandoned: its window's {sum(window.counts)} batch(es) are trained again "
                        f"({change.total_steps_lost} step(s) of the failed lost)")
            log.warning(
                f"round {change.round}: rank(s) {ranks} failed; {self.world_size} rank(s) go on "
                f"(stable ids {list(self.members.ids)}); detection {self.detection_ms:.0f} ms, recovery "
                f"{recovery_ms:.0f} ms; {what}"
            )
        return change


class Recovery:
    """Shrinks the world after a peer's death in a round; the trainer's ``elastic`` (one per rank).

    Args:
        world: this rank's world at the launch.
        watchdog: the rank's stall watchdog (rebound to each new world).
        writer: rank 0's metrics writer; a NoMetricsWriter elsewhere.
        make_bridge: ``(world, policy, writer) -> Bridge``, the run's bridge factory (not started).
        run_dir: the run directory (None: no files; rank 0's death then needs no take-over).
        keep_checkpoints: ``--keep-checkpoints``, for the writer that takes over.
    """

    def __init__(
        self,
        world: World,
        watchdog: Watchdog,
        writer,
        make_bridge: Callable,
        run_dir: Path | None = None,
        keep_checkpoints: int = 3,
    ) -> None:
        self.world, self.watchdog, self.writer, self.make_bridge = world, watchdog, writer, make_bridge
        self.run_dir, self.keep_checkpoints = run_dir, keep_checkpoints
        self.members = Membership.launch(world.size)
        watchdog.elastic = True

    def __call__(self, trainer, failure: RankFailure, window, stages: tuple[str, ...] | None = None) -> Recovered:
        """Agree the failed set with the other survivors and build the bridge of the shrunk world (collective).

        ``window``: the round's window (its steps are the dead ranks' lost ones); None: no window
        was cut off (a death in the epoch exchange). ``stages``: the bridge stages this caller
        goes on from (None: any; the round's); checked once every survivor's stage is known.

        Raises:
            CohortError: on every survivor alike: the survivors failed in different calls
                (one in a round, another past it), or in a stage not in ``stages``: the run
                stops; resume from the last checkpoint.
        """
        old = trainer.bridge
        revoke(old.comm)
        shrunk = shrink(self.world.comm)
        seen = shrunk.comm.allgather((failure.stage, failure.round))
        agreed_at = time.monotonic()
        ranks = ", ".join(map(str, shrunk.failed))
        if len(set(seen)) != 1:
            raise CohortError(
                f"rank(s) {ranks} died while the survivors were in different calls "
                f"({sorted(set(seen))}): the run stops; resume it from its last checkpoint"
            )
        if stages is not None and failure.stage not in stages:  # (the same stage on every survivor: checked above)
            raise CohortError(
                f"rank(s) {ranks} died in round {failure.round} at stage '{failure.stage}', where the survivors "
                "cannot go on (docs/elastic.rst, \"Limits\"): the run stops; resume it from its last checkpoint"
            )
        left = self.members.ids_of(shrunk.failed)
        self.members = self.members.without(shrunk.failed)
        comm = shrunk.comm
        self.world = dataclasses.replace(self.world, comm=comm, rank=comm.rank, size=comm.size)
        self.watchdog.rebind(comm)
        if 0 in shrunk.failed and self.run_dir is not None:
            agree(
                comm,
                "take-over",
                lambda: self._take_over(failure.round, shrunk.survivors[0]),
                self.watchdog,
                name_ranks=False,
            )
        policy = old.policy
        policy.without_ranks(shrunk.failed)
        bridge = self.make_bridge(self.world, policy, self.writer)
        bridge.version = old.version
        bridge.resume_clock(old.elapsed)
        if trainer.state_average is not None:
            bridge.attach_optimizer_state(trainer.state_average)
        bridge.start()
        return Recovered(
            bridge,
            comm.rank,
            comm.size,
            self.writer,
            shrunk.failed,
            left,
            tuple(0 if window is None else int(window.counts[r]) for r in shrunk.failed),
            1e3 * (agreed_at - failure.started),
            agreed_at,
            self.members,
        )

    def _take_over(self, round_: int, new_rank0: int) -> None:
        """The new rank 0 (the lowest survivor) takes over rank 0's files: the run dir's lock, the stale
        temporaries (a checkpoint half written), metrics.h5 from its flushed rows, train.log; others: nothing."""
        if self.world.rank != 0:
            return
        run_dir = self.run_dir
        run_dir_lock.claim(run_dir)  # the dead rank's lock went with its process
        removed = stale_files.remove_stale(run_dir)
        writer = MetricsWriter.take_over(
            run_dir,
            width=self.members.width,
            checkpoint_dir=run_dir / "checkpoints",
            keep_checkpoints=self.keep_checkpoints,
        )
        writer.start()
        self.writer = writer
        log_to_stdout(0, logging.INFO)
        open_train_log(run_dir, 0)
        self.watchdog.log_path = run_dir / "train.log"
        line = stale_files.removal_line(run_dir, removed)
        if line is not None:
            log.info(line)
        log.warning(
            f"round {round_}: rank 0 died; rank {new_rank0} (stable id {self.members.ids[0]}) takes over "
            f"as rank 0: metrics.h5 from its {writer.rows.get('rounds', 0)} flushed round row(s) on "
            "(the rows the dead writer still held are lost), the checkpoints and this log"
        )


def take_new_world(trainer, done: Recovered) -> None:
    """Point ``trainer`` at the survivors' world ``done``: its bridge, rank, world size, rank 0's writer and saver,
    the task's world size, the plan; bound parameters move into the new bridge's staging with their values."""
    trainer.bridge, trainer.rank, trainer.world_size = done.bridge, done.rank, done.world_size
    trainer.writer = writer_or_none(done.writer)
    trainer.saver = saver_for(trainer.rank, trainer.writer)
    trainer.task.world_size = trainer.world_size
    if trainer.replica.bound:
        with torch.no_grad():
            trainer.replica.bind(trainer.bridge)
    trainer.plan = trainer.bridge.policy.plan()
    trainer.rounds_started = trainer.bridge.version


#: The calls between rounds a death in which the survivors go on from, and train.log's words on what is
#: made again. The epoch exchange's first gather: no survivor can complete it without the dead rank's row,
#: so every survivor fails in it, before anything of the epoch is recorded. (Not a checkpoint's state
#: gather: its root fails while a sender's send stays pending on mpi4py's pkl5 context communicator, which
#: no revoke of the bridge's reaches; such a death stops the run, docs/elastic.rst "Limits".)
BETWEEN_ROUNDS = {
    "epoch gather": "it died in the epoch exchange: the epoch is evaluated and exchanged again over the survivors "
                    "(its epoch report and batch records are lost; no step lost)",
}


def after_death_between_rounds(trainer, failure: RankFailure) -> None:
    """Go on without the ranks that died in a call between rounds (:data:`BETWEEN_ROUNDS`; collective).

    Every survivor holds the consensus (the last round adopted, under a blocking policy)
    and its own optimizer state: nothing is rolled back and no step is lost. The survivors
    shrink (`Recovery`, only from those stages), take the new world (`take_new_world`) and
    record the change; the caller then makes its call again over the new world (the epoch
    exchange: after evaluating again on the new ranks' slices; the dead ranks' epoch
    reports and batch records are lost, the epoch's row sums the survivors').

    Args:
        trainer: the rank's trainer (``trainer.elastic`` a `Recovery`).
        failure: the call's failure on this rank.

    Raises:
        CohortError: on every survivor alike: the survivors failed in different calls or in
            another stage (`Recovery`).
    """
    done = trainer.elastic(trainer, failure, None, stages=tuple(BETWEEN_ROUNDS))
    take_new_world(trainer, done)
    done.finish(trainer, None, BETWEEN_ROUNDS[failure.stage])


def resolve_on_rank_failure(cfg, api: bool = False) -> tuple[str, str | None]:
    """``--on-rank-failure`` as this run takes it: ``("stop" | "shrink", train.log's note or None)``.

    The default (None) is ``shrink`` where it can work (`flodl_mpi.runtime.elastic.fault_tolerance`: Open MPI
    launched with ``mpiexec --with-ft ulfm``; and the run's options, below), else ``stop`` (train.log's note
    names why, once the MPI has fault tolerance). Decided from the config and the launcher's environment:
    the same on every rank.

    Raises:
        InputError: ``shrink`` asked where it cannot work: the MPI or its launcher has no
            fault tolerance, the Python API (``fit``, the ``Averager``), ``--policy async``,
            ``--outer`` other than avg (its momentum is not carried over), ``--replay-plan``
            (recorded for one world size), ``--node-reduce shm`` or ``--hierarchical on``
            (shared-memory passes and leader steps do not report a dead peer), a delta ``--wire``
            (its reference and error feedback across a rolled-back window). One line.
    """
    from flodl_mpi.errors import InputError
    from flodl_mpi.runtime.elastic import fault_tolerance

    why = fault_tolerance()
    if why is None:
        options = [
            ("the Python API (fit, the Averager)", api),
            ("--policy async", cfg.policy == "async"),
            (f"--outer {cfg.outer}", cfg.outer != "avg"),
            ("--replay-plan", cfg.replay_plan is not None),
            ("--node-reduce shm", cfg.node_reduce == "shm"),
            ("--hierarchical on", cfg.hierarchical == "on"),
            # the delta wire's reference and error feedback across a rolled-back window: not built or tested
            (f"--wire {cfg.wire_mode}", cfg.wire_mode.endswith("-delta")),
        ]
        unsupported = [name for name, present in options if present]
        if unsupported:
            why = f"shrinking is not built for {', '.join(unsupported)}: use --on-rank-failure stop"
    if cfg.on_rank_failure == "shrink" and why is not None:
        raise InputError(f"--on-rank-failure shrink: {why}")
    if cfg.on_rank_failure == "stop":
        return "stop", None
    if why is not None:
        return "stop", None if fault_tolerance() is not None else f"on a rank's death: stop ({why})"
    return "shrink", (
        "on a rank's death: shrink (Open MPI with --with-ft ulfm): the survivors go on, the round "
        "abandoned and the epoch's batches re-split; averaging over MPI (--node-reduce auto)"
    )
