"""One setup of a rank's run, for the CLI, :func:`flodl_mpi.fit` and the ``Averager``.

Invariant: every front end reaches `setup_rank`, which takes the same steps in the
same order on every rank: the same model on every rank, the run dir and its lock,
the data check of a resume, ``train.log``, the resume point, the config record and
``metrics.h5``, the bridge (`make_bridge`, the one bridge factory), bind / snapshot
/ broadcast / adopt, the save check, the per-rank resume. Each step goes through
:func:`flodl_mpi.runtime.world.agree`, so bad input on any rank is one clear line and
the same exception on every rank, never a hang. What differs between the front ends
(the Trainer or the own loop, the config record, train.log's header) is a `FrontEnd`'s.

Call chains (each front end is a thin caller):

- ``flodl-mpi train``: `flodl_mpi.cli.main._main` -> `flodl_mpi.training.train.run_train`
  -> `flodl_mpi.training.train.start_trainer` -> `setup_rank`
- ``flodl_mpi.fit``: `flodl_mpi.api.fit.fit` -> ``_setup`` -> `flodl_mpi.training.train.start_trainer`
  -> `setup_rank`
- ``flodl_mpi.Averager``: ``Averager.__init__`` -> ``Averager._setup`` -> `setup_rank`
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import mpi4py
import numpy as np
import torch
from mpi4py import MPI

from flodl_mpi import __version__
from flodl_mpi.config import TrainConfig
from flodl_mpi.errors import InputError
from flodl_mpi.outputs.metrics import MetricsWriter, NoMetricsWriter, WriterError, disk_writer_error
from flodl_mpi.outputs.run_dir import make_run_dir
from flodl_mpi.policy.registry import make_policy
from flodl_mpi.protocol.outer import OuterOptimizer
from flodl_mpi.runtime.launcher import clean_text
from flodl_mpi.runtime.live_ranks import gather_ranks, write_launch
from flodl_mpi.runtime.world import Watchdog, World, agree
from flodl_mpi.training.data import DEFAULT_NAMES, Dataset, default_digits_path, ensure_digits, load_dataset
from flodl_mpi.training.models import check_same_model
from flodl_mpi.training.recovery import Recovery, resolve_on_rank_failure
from flodl_mpi.training.train import check_resume_data, resume_point, settle_outer
from flodl_mpi.training.train_log import close_train_log, log, open_train_log
from flodl_mpi.training.replica import Replica
from flodl_mpi.transport.bridge import Bridge
from flodl_mpi.transport.reduce import WireOptions

__all__ = ["FrontEnd", "RankRun", "load_data", "make_bridge", "run_attrs", "setup_rank"]


def load_data(cfg: TrainConfig, world: World, watchdog: Watchdog) -> Dataset:
    """The data ``cfg`` names (``--data``), or the built-in digits (fetched once per host); collective.

    Raises:
        InputError: on every rank alike, a file that does not read as the data ``cfg`` describes.
    """
    names = {k: getattr(cfg, k) for k in DEFAULT_NAMES}
    if cfg.data is not None:
        return agree(world.comm, "data", lambda: load_dataset(cfg.data, names, loading=cfg.data_loading,
                                                             ranks_per_host=world.local_size), watchdog)
    path = default_digits_path()
    # One writer per host (the cache may be node-local); the write is atomic.
    agree(world.comm, "data", lambda: ensure_digits(path) if world.local_rank == 0 else None, watchdog,
          name_ranks=False)
    return agree(world.comm, "data", lambda: load_dataset(path, names, loading=cfg.data_loading,
                                                         ranks_per_host=world.local_size), watchdog)


def run_attrs(cfg: TrainConfig, world: World, device: torch.device) -> dict:
    """metrics.h5's run attributes: config, world size, every rank's host and device, versions, policy.

    Collective (two allgathers): every rank calls it, the writer (rank 0) keeps the result.
    ``loss`` is the CLI's task (``"cross-entropy"``); the Python API records its own.
    """
    hosts = world.comm.allgather(world.host)
    devices = world.comm.allgather(str(device))
    return {
        "config": cfg.to_dict(),
        "world_size": world.size,
        "hosts": hosts,
        "devices": devices,
        "versions": {
            "flodl_mpi": __version__, "torch": torch.__version__, "numpy": np.__version__,
            "h5py": h5py.__version__, "mpi4py": mpi4py.__version__,
            "mpi": clean_text(MPI.Get_library_version().splitlines()[0]),
        },
        "policy": cfg.policy,
        "thread_level": world.thread_level,
        "loss": "cross-entropy",  # the CLI's task; the Python API records its own
    }


def make_bridge(cfg: TrainConfig, world: World, replica: Replica, writer, watchdog: Watchdog,
                pin_staging: bool | None = None, policy=None, elastic: bool = False) -> Bridge:
    """The bridge ``cfg`` describes, over a duplicate of the world's communicator (collective).

    The one bridge factory of the CLI, :func:`flodl_mpi.fit` and the ``Averager``: the
    policy (``make_policy``), the outer optimizer, how the frames travel (``WireOptions``:
    ``node_reduce``, ``hierarchical``, ``bf16_wire``), pinned staging. ``writer``: rank 0's
    metrics writer, or a ``NoMetricsWriter``. ``pin_staging``: None: pinned for a model on CUDA.
    ``policy``: the one to go on with (a shrink's re-planned policy); None: ``make_policy``'s.
    ``elastic``: ``--on-rank-failure shrink`` (a peer's death raises ``RankFailure``; the node
    reduce ``auto`` is then MPI's, whose calls report a dead peer).

    Raises:
        ValueError: identically on every rank, from the reducers' planning (for
            example ``--node-reduce shm`` without room in ``/dev/shm``).
    """
    return Bridge(
        world.comm.Dup(),
        [tuple(p.shape) for p in replica.params],
        [tuple(b.shape) for b in replica.float_buffers],
        gamma=cfg.gamma, chunk_elems=cfg.chunk_elems, writer=writer,
        policy=make_policy(cfg, world.size) if policy is None else policy,
        threaded=world.threaded_bridge, watchdog=watchdog, on_non_finite=cfg.on_non_finite,
        outer=OuterOptimizer(cfg.outer, sum(p.numel() for p in replica.params), cfg.outer_lr, cfg.outer_momentum),
        wire=WireOptions("mpi" if elastic and cfg.node_reduce == "auto" else cfg.node_reduce, cfg.hierarchical,
                         cfg.wire_mode == "bf16",
                         delta=cfg.wire_mode.removesuffix("-delta") if cfg.wire_mode.endswith("-delta") else "off"),
        pin_staging=replica.device.type == "cuda" if pin_staging is None else bool(pin_staging),
        elastic=elastic,
    )


@dataclass
class RankRun:
    """What `setup_rank` built for this rank; the front end's hooks read and fill it.

    Attributes:
        cfg: the run's config (``run_dir`` as claimed, once it is).
        replica: the model and its device (`flodl_mpi.training.replica.Replica`).
        data: the training and test sets, or None (an own loop).
        run_dir: the claimed run directory; None: no files.
        train_log: rank 0's ``train.log`` handler (None elsewhere, or without files).
        data_note: the resume's note on data it cannot check (rank 0 logs it).
        ckpt, keep_rows: `flodl_mpi.training.train.resume_point`'s (None, None: a new run).
        attrs: metrics.h5's run attributes (`run_attrs`; every rank holds them).
        writer: rank 0's metrics writer (a ``NoMetricsWriter`` elsewhere, or without files).
        bridge: the bridge (`make_bridge`), once built.
    """

    cfg: TrainConfig
    world: World
    watchdog: Watchdog
    replica: Replica
    data: Dataset | None = None
    run_dir: Path | None = None
    train_log: logging.Handler | None = None
    data_note: str | None = None
    ckpt: Any = None
    keep_rows: dict | None = None
    attrs: dict = field(default_factory=dict)
    writer: MetricsWriter | NoMetricsWriter = field(default_factory=NoMetricsWriter)
    bridge: Bridge | None = None


class FrontEnd:
    """A front end's own pieces in `setup_rank`; the defaults do nothing.

    Attributes:
        run_dir_always: claim a run dir even when ``cfg.run_dir`` is None (the CLI's ``runs/<UTC time>``).
        check_optimizer: a resume checks the saved optimizer state's class (False: no optimizer).
        broadcast: start every rank from rank 0's parameters and buffers.
        pin_staging: the bridge's pinned staging (None: for a model on CUDA).
        remove_bad_new_run: a new run whose input turned out bad during the setup leaves no run dir behind.
    """

    run_dir_always = False
    check_optimizer = True
    broadcast = True
    pin_staging: bool | None = None
    remove_bad_new_run = False

    def prepared(self, run: RankRun) -> bool:
        """After the resume point, before any output is written: False ends the setup (nothing to train)."""
        return True

    def record(self, run: RankRun) -> dict:
        """Rank 0 with a run dir: the config record (``config.json``); may update ``run.attrs``."""
        return run.cfg.to_dict()

    def opened(self, run: RankRun) -> None:
        """Rank 0 with a run dir: the metrics writer exists (not started yet)."""

    def attach(self, run: RankRun) -> None:
        """Every rank: the bridge holds the consensus; build what trains (a Trainer, an own loop's counters)."""

    def check_saveable(self, run: RankRun) -> None:
        """Every rank, with a run dir: what would fail at save time fails now (agreed as "checkpoint check")."""

    def resume(self, run: RankRun) -> None:
        """Every rank, resuming: this rank's state from ``run.ckpt`` (agreed as "resume")."""

    def resumed(self, run: RankRun) -> None:
        """Every rank, after the resume: its lines."""

    def ready(self, run: RankRun) -> None:
        """Every rank, the setup done, before the watchdog turns to "training"."""


def setup_rank(cfg: TrainConfig, world: World, watchdog: Watchdog, model: torch.nn.Module, device: torch.device,
               front: FrontEnd, data: Dataset | None = None) -> RankRun:
    """Set up this rank's run from a validated config and the front end's pieces (collective).

    Every rank calls it alike, with the model built (and checked on a batch) by the
    front end, on ``device``. Returns with the bridge built, not started, and the
    watchdog on "training"; ``run.bridge`` is None when ``front.prepared`` ended the
    setup early (nothing to train: no output written).

    Raises:
        InputError, CohortError: as `agree` (every rank alike): a model that differs
            across ranks, a run dir in use or not new, a refused resume, a save that
            would fail. The metrics writer and train.log are closed first.
    """
    comm = world.comm
    # --on-rank-failure: refused before anything is written (decided from the config and the launcher's
    # environment, the same on every rank); the CLI's trainer only (not the Python API's loops)
    cli = isinstance(front, TrainerFront) and front.task is None
    on_failure, failure_note = resolve_on_rank_failure(cfg, api=not cli)
    check_same_model(model, comm)
    run = RankRun(cfg, world, watchdog, Replica(model, device), data)
    try:
        # -- outputs: nothing is created on disk before the input is known to be good
        if cfg.run_dir is not None or front.run_dir_always:
            run.run_dir = make_run_dir(cfg, comm, watchdog)
            run.cfg = cfg = dataclasses.replace(cfg, run_dir=str(run.run_dir))  # as run
            if data is not None:
                run.data_note = check_resume_data(cfg, run.run_dir, data, world, watchdog)  # reads only
            run.train_log = open_train_log(run.run_dir, world.rank)
            if world.rank == 0:
                watchdog.log_path = run.run_dir / "train.log"  # a stall's verdict ends train.log too
                log.setLevel(min(log.level or logging.INFO, logging.INFO))
            # A refused resume writes nothing to train.log: its checks come before the run's first line.
            run.ckpt, run.keep_rows = resume_point(cfg, run.run_dir, world, watchdog, model,
                                                   data.train.n if data is not None else 0,
                                                   check_optimizer=front.check_optimizer)
        # the outer's lr and momentum as given, else the run's own, else today's defaults: recorded from here on
        cfg, outer_note = settle_outer(cfg, run.ckpt)
        run.cfg = cfg
        if outer_note is not None:
            log.info(outer_note)
        if not front.prepared(run):
            return run
        _open_outputs(run, front)
    except BaseException:
        close_train_log(run.train_log)
        raise
    try:
        shrink = on_failure == "shrink"
        run.bridge = make_bridge(cfg, world, run.replica, run.writer, watchdog, pin_staging=front.pin_staging,
                                 elastic=shrink)
        if run.bridge.policy.blocking:  # async trains on while a round runs: its staging must stay apart
            # Bound params live in the staging: no copies per round. The Parameter objects stay
            # the same, so an optimizer built before (or after) keeps working.
            run.replica.bind(run.bridge)
        run.replica.snapshot(run.bridge)
        if front.broadcast:
            run.bridge.broadcast(root=0)
        run.replica.adopt(run.bridge)
        front.attach(run)
        if shrink:
            def rebuild(new_world: World, policy, writer) -> Bridge:
                return make_bridge(cfg, new_world, run.replica, writer, watchdog, pin_staging=front.pin_staging,
                                   policy=policy, elastic=True)

            front.trainer.elastic = Recovery(world, watchdog, run.writer, rebuild, run.run_dir, cfg.keep_checkpoints)
        if failure_note is not None:
            log.info(failure_note)
        if run.run_dir is not None:  # anything that would fail at save time fails now, before any training
            agree(comm, "checkpoint check", lambda: front.check_saveable(run), watchdog, name_ranks=False)
        if run.ckpt is not None:
            agree(comm, "resume", lambda: front.resume(run), watchdog)
            front.resumed(run)
    except BaseException as exc:
        # Setup failed after the outputs were opened: close metrics.h5 (no "open for
        # write" flag left), and for a new run whose input turned out bad (a state the
        # checkpoint format cannot hold) remove what this run created, so nothing is
        # left on disk and the same command can simply be run again.
        if run.writer.writes:
            with contextlib.suppress(WriterError):
                run.writer.close(timeout=10.0)
            if front.remove_bad_new_run and isinstance(exc, InputError) and run.keep_rows is None \
                    and run.ckpt is None:
                shutil.rmtree(run.run_dir, ignore_errors=True)
        close_train_log(run.train_log)
        raise
    front.ready(run)
    watchdog.begin("training")
    return run


def _open_outputs(run: RankRun, front: FrontEnd) -> None:
    """The run's attributes (collective), then rank 0's config record and metrics.h5 (agreed)."""
    world, cfg, run_dir = run.world, run.cfg, run.run_dir
    run.attrs = run_attrs(cfg, world, run.replica.device)
    if run.data is not None:
        run.attrs["data_source"] = run.data.source
    name = config = None
    ranks = gather_ranks(world.comm) if run_dir is not None else None  # R/ranks.json: flodl-mpi inject-failure's
    if world.rank == 0 and run_dir is not None:
        config = front.record(run)
        # config.json is the run's first config; each resume adds its own beside it.
        resumed_at = run.ckpt.round if run.ckpt is not None else 0
        name = "config.json" if run.keep_rows is None else f"config-resume-r{resumed_at:06d}.json"
        run.writer = MetricsWriter(run_dir, world.size, run.attrs, run_dir / "checkpoints", cfg.keep_checkpoints,
                                   keep_rows=run.keep_rows)
        front.opened(run)

    def open_files() -> None:  # rank 0; a full disk here is the writer's one line too
        if not run.writer.writes:
            return
        try:
            (run_dir / name).write_text(json.dumps(config, indent=2) + "\n")
        except OSError as exc:
            raise disk_writer_error(run_dir, exc) or exc
        run.writer.start()
        try:
            write_launch(run_dir, ranks)
        except OSError as exc:
            raise disk_writer_error(run_dir, exc) or exc

    agree(world.comm, "metrics writer", open_files, run.watchdog, name_ranks=False)


class TrainerFront(FrontEnd):
    """The front end of the CLI and :func:`flodl_mpi.fit`: a `flodl_mpi.training.worker.Trainer` over the data.

    Args:
        stop: the run's stop request (signals).
        record: rank 0's config record (``flodl_mpi.api.run_record``), called once;
            None: ``cfg.to_dict()`` with the ``--model`` file's record (the CLI's).
        task, progress: the `Trainer`'s.
        late_header: None: the CLI's setup lines in train.log (header, warnings,
            what was resumed); a line (the API's threads line): only it and the
            header, once the trainer is ready.
        on_prepared: called with the `RankRun` after the resume point, before any
            output is written; False ends the setup (nothing to train).
        on_resume: called with the trainer after `Trainer.resume`.
        replay: the `load_replay_plan` of ``--replay-plan`` (None: the policy plans).
        run_dir_always: the CLI's: a run dir even without ``cfg.run_dir``.
        remove_bad_new_run: a new run whose input turned out bad during this
            setup (InputError) leaves no run dir behind.
    """

    def __init__(self, stop, *, record=None, task=None, progress=None, late_header: str | None = None,
                 on_prepared=None, on_resume=None, replay=None, run_dir_always: bool = False,
                 remove_bad_new_run: bool = True) -> None:
        self.stop, self._record, self.task = stop, record, task
        self.progress, self.late_header, self.on_prepared, self.on_resume = progress, late_header, on_prepared, on_resume
        self.replay, self.run_dir_always, self.remove_bad_new_run = replay, run_dir_always, remove_bad_new_run
        self.trainer = None
        #: The `RankRun` once the resume point is settled, and whether the outputs are being opened.
        self.run: RankRun | None = None
        self.writing = False

    def prepared(self, run: RankRun) -> bool:
        self.run = run
        self.writing = True if self.on_prepared is None else bool(self.on_prepared(run))
        return self.writing

    def record(self, run: RankRun) -> dict:
        from flodl_mpi.protocol.data_fingerprint import fingerprint as data_fingerprint
        from flodl_mpi.training.resume_inputs import model_file_record

        config = run.cfg.to_dict()
        if self._record is not None:  # what the user's factories built, not the CLI's defaults
            config = self._record()
            run.attrs.update(config=config, loss=config["loss"])
        config = {**config, "data_fingerprint": data_fingerprint(run.data)}  # what a resume checks
        model_file = model_file_record(run.cfg.model) if self._record is None else None  # the CLI's --model file
        if model_file is not None:
            config["model_file"] = model_file
        return config

    def attach(self, run: RankRun) -> None:
        from flodl_mpi.training.data import num_batches
        from flodl_mpi.training.train import log_header
        from flodl_mpi.training.worker import Trainer

        cfg, world, data = run.cfg, run.world, run.data
        # Per-rank randomness (dropout and the like) differs by rank, reproducibly.
        torch.manual_seed(int(np.random.SeedSequence([cfg.seed, world.rank]).generate_state(1)[0]))
        if self.late_header is None:
            log_header(cfg, world.size, run.replica, run.attrs["devices"], data, run.run_dir, bridge=run.bridge)
            n_batches = num_batches(data.train.n, cfg.step_samples, cfg.drop_last)
            if n_batches < world.size:
                log.warning(f"warning: an epoch has {n_batches} batch(es) of {cfg.step_samples} for {world.size} "
                            f"ranks, so rank(s) {n_batches}..{world.size - 1} never train; lower --batch-size")
            for line in run.writer.recovered:
                log.info(f"warning: {line}")
        self.trainer = trainer = Trainer(
            cfg, world.rank, world.size, data, run.replica, run.bridge, run.writer, log=log.info,
            stop=self.stop, progress=self.progress, log_detail=log.debug if self.late_header is None else None,
            task=self.task, replay=self.replay, warn=log.warning)
        if trainer.state_average is not None and self.late_header is None:
            averaged = trainer.state_average
            log.info(f"optimizer state averaged ({averaged.mode}): {len(averaged.plan.wire)} state tensors, "
                     f"{averaged.plan.wire_bytes} more bytes per round and rank")

    def check_saveable(self, run: RankRun) -> None:
        done = run.ckpt.epoch if run.ckpt is not None else 0
        self.trainer.check_saveable(run.run_dir / "checkpoints", done)

    def resume(self, run: RankRun) -> None:
        self.trainer.resume(run.ckpt)

    def resumed(self, run: RankRun) -> None:
        trainer = self.trainer
        if self.on_resume is not None:
            self.on_resume(trainer)
        if self.late_header is None:
            log.info(f"resuming from {run.ckpt.path.name}: {trainer.start_epoch} epoch(s) done, "
                     f"{trainer.start_cursor} batch(es) into the next, round {run.bridge.version}")
            if trainer.remapped:
                log.info(trainer.remapped)
            if trainer.wire_resumed:
                log.info(trainer.wire_resumed)

    def ready(self, run: RankRun) -> None:
        from flodl_mpi.training.train import log_header

        if self.late_header is not None and run.writer.writes:
            log.info(self.late_header)
            log_header(run.cfg, run.world.size, run.replica, run.attrs["devices"], run.data, run.run_dir, api=True,
                       bridge=run.bridge)  # train.log as the CLI's
        self.trainer.made_progress = run.watchdog.progress  # each batch trained is progress for the stall watchdog


def start_trainer(cfg: TrainConfig, world: World, watchdog: Watchdog, data: Dataset, model: torch.nn.Module,
                  device: torch.device, front: TrainerFront) -> RankRun:
    """`setup_rank` with a `TrainerFront`: the CLI's and :func:`flodl_mpi.fit`'s one way (collective).

    Returns the `RankRun`; ``front.trainer`` is the `Trainer` (None when ``front.on_prepared``
    ended the setup). The caller starts the bridge and the epochs. Raises as `setup_rank`.
    """
    return setup_rank(cfg, world, watchdog, model, device, front, data=data)
