"""``flodl-mpi train``: set up a rank (config, device, data, model, outputs), then train.

Setup runs on the main thread before the bridge starts, so it may call MPI; each
step goes through :func:`flodl_mpi.runtime.world.agree`, so bad input on any rank becomes
one clear line on rank 0 and a non-zero exit everywhere, never a hang.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import math
import os
import shutil
import sys
import time
from pathlib import Path

import h5py
import mpi4py
import numpy as np
import torch
from mpi4py import MPI

from flodl_mpi import __version__
from flodl_mpi.outputs import run_dir_lock, stale_files
from flodl_mpi.transport.bridge import Bridge
from flodl_mpi.outputs.checkpoint import (
    Checkpoint,
    load_state_dict,
    newest_verified,
    read_rank_state,
)
from flodl_mpi.outputs.checkpoint_contents import read_contents
from flodl_mpi.cli.main import config_from_args
from flodl_mpi.config import RESUME_AUTO, TrainConfig, optimizer_class
from flodl_mpi.training.data import (
    DEFAULT_NAMES,
    Dataset,
    default_digits_path,
    ensure_digits,
    load_dataset,
    num_batches,
    smallest_batch,
)
from flodl_mpi.protocol.data_fingerprint import differences as data_differences
from flodl_mpi.protocol.data_fingerprint import fingerprint as data_fingerprint
from flodl_mpi.errors import CohortError, InputError
from flodl_mpi.runtime.launcher import clean_text, settle_threads, thread_request
from flodl_mpi.outputs.metrics import MetricsWriter, WriterError, disk_error, disk_writer_error, keep_before_restart
from flodl_mpi.training.model_record import resume_difference
from flodl_mpi.training.models import (
    ModelSpecError,
    build_model,
    check_model_output,
    check_training_step,
    model_difference,
    model_signature,
    module_structure,
    wide_tensor,
)
from flodl_mpi.protocol.outer import OuterOptimizer, short_window_warning
from flodl_mpi.policy.registry import describe as describe_policy
from flodl_mpi.policy.registry import get as policy_spec
from flodl_mpi.policy.registry import make_policy
from flodl_mpi.training.progress import EpochProgress, stdout_is_terminal, write_above_bars
from flodl_mpi.transport.reduce import WireOptions
from flodl_mpi.policy.replay import RecordedPlan, read_recorded_plan
from flodl_mpi.training.resume_inputs import data_path_difference, model_file_record, model_spec_difference
from flodl_mpi.training.resume_target import new_run_line, resume_refusal
from flodl_mpi.runtime.signals import StopRequest
from flodl_mpi.training.worker import Replica, Trainer
from flodl_mpi.runtime.world import Watchdog, World, agree

__all__ = ["run_train", "start_trainer", "pick_device", "effective_batch_line", "final_line", "log_header"]

log = logging.getLogger("flodl_mpi")


def pick_device(choice: str, local_rank: int) -> torch.device:
    """Map ``--device`` and the local rank to a device: one GPU per local rank.

    Raises:
        ValueError: ``cuda`` asked for but no CUDA device is visible.
    """
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def _load_data(cfg: TrainConfig, world: World, watchdog: Watchdog) -> Dataset:
    names = {k: getattr(cfg, k) for k in DEFAULT_NAMES}
    if cfg.data is not None:
        return agree(world.comm, "data", lambda: load_dataset(cfg.data, names), watchdog)
    path = default_digits_path()
    # One writer per host (the cache may be node-local); the write is atomic.
    agree(world.comm, "data", lambda: ensure_digits(path) if world.local_rank == 0 else None, watchdog,
          name_ranks=False)
    return agree(world.comm, "data", lambda: load_dataset(path, names), watchdog)


def load_replay_plan(cfg: TrainConfig, world: World, watchdog: Watchdog, data: Dataset) -> RecordedPlan | None:
    """``--replay-plan``: the recorded plan, checked against this run before anything is written (None: not asked).

    Collective. Rank 0 reads the file (`flodl_mpi.policy.replay.read_recorded_plan`), every rank
    gets it and checks the same values: the recorded world size, policy, samples an epoch,
    every window against this run's batches an epoch, and enough complete epochs.

    Raises:
        InputError: on every rank alike, one line naming the file and what differs.
    """
    if cfg.replay_plan is None:
        return None
    comm = world.comm
    plan = comm.bcast(agree(comm, "replay plan", lambda: read_recorded_plan(cfg.replay_plan) if world.rank == 0
                            else None, watchdog, name_ranks=False), root=0)
    n_batches = num_batches(data.train.n, cfg.batch_size, cfg.drop_last)
    samples = n_batches * cfg.batch_size if cfg.drop_last else data.train.n
    why = plan.refusal(world.size, cfg.policy, n_batches, samples, cfg.epochs)
    if why is not None:
        raise InputError(why)
    return plan


def _smallest_training_batch(cfg: TrainConfig, n_samples: int) -> tuple[int, str]:
    """The smallest batch the batch plan makes, and what to change if the model fails on it.

    Raises:
        ValueError: ``--drop-last`` leaves no batch at all.
    """
    k = smallest_batch(n_samples, cfg.batch_size, cfg.drop_last)
    if k == 0:
        raise ValueError(f"--drop-last with --batch-size {cfg.batch_size} leaves no batch: the training set has "
                         f"{n_samples} samples; lower --batch-size")
    if k == n_samples:  # the whole set is one batch: no batch size or --drop-last makes it larger
        return k, (f"the whole training set is {n_samples} sample{'s' if n_samples != 1 else ''}, one batch; "
                   "this model needs a larger training set")
    if k < cfg.batch_size:  # the short last batch of an epoch
        return k, (f"it is the last batch of each epoch of {n_samples} samples; add --drop-last or change "
                   "--batch-size")
    return k, "raise --batch-size"


def _describe_policy(cfg: TrainConfig) -> str:
    """The header's words for when ranks average, e.g. ``policy window (4 batches per rank per round)``:
    the policy's entry's (`flodl_mpi.policy.registry.describe`, the report's too), then the outer step."""
    text = describe_policy(cfg.policy, cfg.to_dict())
    if cfg.outer != "avg":
        outer = OuterOptimizer(cfg.outer, 0, cfg.outer_lr, cfg.outer_momentum)
        text += f", outer {cfg.outer} (lr {outer.lr:g}, momentum {outer.momentum:g})"
    return text


def effective_batch_line(cfg: TrainConfig, world_size: int, api: bool = False, n_samples: int | None = None) -> str:
    """The header's line on the effective batch and the learning rate (what a user must know at W > 1).

    Each round averages one window of every rank, so per epoch every replica takes
    about 1/W of the steps one process would, each on ``batch_size`` samples; at
    equal ``--lr`` the cohort moves like one process with a W times larger batch.
    ``api``: worded in :func:`flodl_mpi.fit`'s keywords (``scale_lr=True``, ``lr=``),
    not the CLI's flags; ``cfg.lr`` is then the rate the optimizer was built with.
    ``n_samples``: the training set's size; when ``batch_size`` x W exceeds what an
    epoch's batch plan holds, the line gives the batch that actually happens (capped
    by the data, issue 26 item 9) and the step ratio of the real plan.
    """
    scale, raise_lr = ("scale_lr=True", "lr") if api else ("--scale-lr", "--lr")
    eff, ratio = cfg.batch_size * world_size, world_size
    ranks = f"{world_size} rank{'s' if world_size != 1 else ''}"
    text = f"batch {cfg.batch_size} per rank, effective batch {cfg.batch_size} x {ranks} = {eff} samples per step " \
           "of the averaged model"
    batches = num_batches(n_samples, cfg.batch_size, cfg.drop_last) if n_samples is not None else 0
    planned = min(n_samples, batches * cfg.batch_size) if cfg.drop_last else n_samples
    if n_samples is not None and batches > 0 and eff > planned:
        ratio = batches / -(-batches // world_size)  # one process's steps per epoch / the cohort's rounds
        text = (f"batch {cfg.batch_size} per rank, effective batch {planned} samples per step of the averaged "
                f"model, at most: {cfg.batch_size} x {ranks} = {eff} asked, capped by the training set of "
                f"{n_samples} samples ({batches} batch{'es' if batches != 1 else ''} per epoch)")
    if cfg.scale_lr and world_size > 1:
        ramp = f" after {cfg.warmup_steps} warm-up steps" if cfg.warmup_steps else ""
        return f"{text}; {scale}: lr {cfg.lr:g} x {world_size} = {cfg.lr * world_size:g}{ramp}"
    if world_size > 1 and ratio > 1:
        return (f"{text}; lr {cfg.lr:g} as given (one process at batch {cfg.batch_size} would take {ratio:g}x "
                f"the steps per epoch: to match it, raise {raise_lr} toward {cfg.lr * ratio:g} or "
                f"{'set' if api else 'add'} {scale})")
    return text


def make_bridge(cfg: TrainConfig, world: World, replica: Replica, writer, watchdog: Watchdog) -> Bridge:
    """The bridge ``cfg`` describes, over a duplicate of the world's communicator (collective).

    One place for the CLI and the Python API (:func:`flodl_mpi.fit`): the policy
    (``make_policy``), the outer optimizer, how the frames travel (``WireOptions``),
    pinned staging for a model on CUDA. ``writer``: rank 0's metrics writer or None.

    Raises:
        ValueError: identically on every rank, from the reducers' planning (for
            example ``--node-reduce shm`` without room in ``/dev/shm``).
    """
    return Bridge(
        world.comm.Dup(),
        [tuple(p.shape) for p in replica.params],
        [tuple(b.shape) for b in replica.float_buffers],
        gamma=cfg.gamma, chunk_elems=cfg.chunk_elems, writer=writer, policy=make_policy(cfg, world.size),
        threaded=world.threaded_bridge, watchdog=watchdog, on_non_finite=cfg.on_non_finite,
        outer=OuterOptimizer(cfg.outer, sum(p.numel() for p in replica.params), cfg.outer_lr, cfg.outer_momentum),
        wire=WireOptions(cfg.node_reduce, cfg.hierarchical, cfg.bf16_wire),
        pin_staging=replica.device.type == "cuda",
    )


def _make_run_dir(cfg: TrainConfig, comm: MPI.Comm, watchdog: Watchdog) -> Path:
    """Rank 0 claims the run directory: a new or empty one, or with ``--resume`` a run's own.

    A plain ``--resume`` (``cfg.resume`` True) on a run dir that does not exist or holds
    no checkpoint is refused here, before anything is created, locked or written
    (`flodl_mpi.training.resume_target.resume_refusal`); ``--resume auto`` then starts the run.

    The default ``runs/<UTC time>`` is claimed with an exclusive ``mkdir`` (a
    suffix ``-1``, ``-2``, ... when several jobs start in the same second).
    Rank 0 then holds the directory's lock (`flodl_mpi.outputs.run_dir_lock`) for the
    rest of the run, taken before anything in it is cleaned up or written: a
    second run on the same directory is refused (``InputError``, exit status 2)
    and touches nothing of the first. Every rank learns the outcome from
    `agree`'s gathered result.
    """

    def create() -> str | None:
        if comm.rank != 0:
            return None
        if cfg.run_dir is not None:
            run_dir = Path(cfg.run_dir)
            if run_dir.exists() and not run_dir.is_dir():
                raise ValueError(f"--run-dir {cfg.run_dir!r}: exists and is not a directory")
            claimed = run_dir.is_dir() and (run_dir / run_dir_lock.LOCK_NAME).exists()
            if claimed:  # a run used it: another one still may; nothing is looked at before the lock is held
                run_dir_lock.claim(run_dir, cfg.run_dir)
            if not cfg.resume and run_dir.is_dir() and any(p.name != run_dir_lock.LOCK_NAME
                                                           for p in run_dir.iterdir()):
                if (run_dir / "config.json").is_file():
                    raise ValueError(f"--run-dir {cfg.run_dir!r} holds a flodl-mpi run: add --resume to continue "
                                     "it, or choose a new or empty directory (nothing in it was touched)")
                raise ValueError(f"--run-dir {cfg.run_dir!r} is not empty (it may hold another run); "
                                 "choose a new or empty directory so nothing saved is overwritten")
            refusal = resume_refusal(cfg.run_dir, cfg.resume)  # a plain --resume with nothing to continue
            if refusal is not None:  # decided before the run dir is created, locked or written
                raise ValueError(refusal)
            try:
                run_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:  # under a file, no permission, a read-only file system: one line
                raise ValueError(f"--run-dir {cfg.run_dir!r}: cannot create it: {exc.strerror or exc}"
                                 + (f" ({exc.filename})" if exc.filename and str(exc.filename) != cfg.run_dir
                                    else "")) from exc
            if not claimed:
                run_dir_lock.claim(run_dir, cfg.run_dir)
        else:
            base = time.strftime("runs/%Y%m%d-%H%M%S", time.gmtime())
            for k in itertools.count():
                run_dir = Path(base if k == 0 else f"{base}-{k}")
                try:
                    run_dir.mkdir(parents=True)
                    break
                except FileExistsError:
                    continue
            run_dir_lock.claim(run_dir)
        (run_dir / "checkpoints").mkdir(exist_ok=cfg.resume)
        return str(run_dir)

    return Path(comm.bcast(agree(comm, "run dir", create, watchdog, name_ranks=False), root=0))


def _say_once(run_dir: Path, line: str | None) -> None:
    """Rank 0, before train.log's handler exists: ``line`` as a warning (stdout) and at the end of
    ``run_dir/train.log`` (the handler added later appends after it)."""
    if line is None:
        return
    log.warning(line)
    path = (run_dir / "train.log").resolve()
    if any(isinstance(h, logging.FileHandler) and Path(h.baseFilename) == path for h in log.handlers):
        return  # logged there already
    with contextlib.suppress(OSError):
        with open(path, "a") as fh:
            fh.write(f"{time.strftime('%H:%M:%S')} {line}\n")


#: Options a resumed run must share with the checkpoint's run: they decide the
#: model, the data order, the windows and the optimizer state's meaning. The world
#: size may change (see `Trainer.resume` for how per-rank state is remapped). The
#: optimizer is checked against the state the checkpoint holds (`_check_optimizer`).
RESUME_MUST_MATCH = ("model", "data", "train_x", "train_y", "test_x", "test_y", "batch_size", "drop_last", "seed",
                     "policy", "window", "gamma", "optimizer", "outer", "average_optimizer_state")


def _find_resume(cfg: TrainConfig, run_dir: Path, world: World, watchdog: Watchdog, data_n: int,
                 check_optimizer: bool = True, model: torch.nn.Module | None = None):
    """The checkpoint to resume from and the metrics rows to keep (``--resume``).

    Rank 0 surveys the checkpoints once: every dataset of the newest one is read
    (checksums checked); a damaged one is passed over and the next newest tried.
    Each rank then reads the per-rank state it takes over: old rank ``rank mod
    W_old``'s (`Trainer.resume`). Only once every check passed are an earlier
    run's temporary files removed (`flodl_mpi.outputs.stale_files`), the damaged
    checkpoints set aside as ``*.damaged`` (a warning each) and, with none left,
    the restart said and ``metrics.h5``'s history kept: a refused resume reads only.

    Args:
        data_n: training samples (a checkpoint of an older batch plan is checked against it).
        check_optimizer: the run restores the saved optimizer state (False: an own loop
            without an optimizer), so its class must be the saved state's.
        model: the model about to be resumed, compared with the checkpoint's record of its
            model (`flodl_mpi.training.model_record.resume_difference`); None: not compared.

    Returns:
        ``(contents or None, keep_rows or None)``: the checkpoint's
        `flodl_mpi.outputs.checkpoint_contents.CheckpointContents` (read by its compatibility
        rules, ``ranks`` holding the state this rank takes over); no checkpoint in a run dir
        that holds a ``metrics.h5`` restarts the run and cuts every table to 0
        rows, the old file (when it holds rows) kept as
        ``metrics.h5.before-restart-<UTC time>`` (`flodl_mpi.outputs.metrics.keep_before_restart`)
        with one warning line naming the damaged checkpoints; an empty run dir starts a new run.
        Only ``--resume auto`` (``cfg.resume == "auto"``) starts a run; it says so in one line.

    Raises:
        InputError: a plain ``--resume`` (``cfg.resume`` True) finds no checkpoint that
            reads back (refused before any is set aside); the checkpoint is unreadable on some rank, was written by a
            run with other options in ``RESUME_MUST_MATCH`` (an option its config
            lacks counts as its default), by a flodl-mpi whose batch plan differs, or
            for another model (module tree, tensor names, shapes, dtypes). The optimizer is checked against the class of the state the checkpoint
            holds (`_check_optimizer`), not against its config's record.
    """
    comm = world.comm

    def survey() -> tuple[Path | None, list, bool] | None:  # rank 0 looks (reads only), every rank learns
        if comm.rank != 0:
            return None
        chosen, aside = newest_verified(run_dir / "checkpoints")
        if chosen is None and cfg.resume is True:  # the names said there was one (`resume_refusal`)
            names = ", ".join(p.name for p, _ in aside) or "none left"
            raise ValueError(f"--resume: every checkpoint in {run_dir / 'checkpoints'} is damaged ({names}; "
                             "flodl-mpi inspect FILE says why), so there is nothing to continue and nothing in "
                             f"{run_dir} was touched; use --resume {RESUME_AUTO} to start the run again from epoch 1 "
                             "(keeping them as *.damaged)")
        # (a restart killed after keeping the history still restarts: its metrics.h5 is gone)
        return chosen, aside, (run_dir / "metrics.h5").exists() or any(run_dir.glob("metrics.h5.before-restart-*"))

    def set_aside() -> None:  # rank 0, once every check passed: a refused resume changed nothing
        if comm.rank != 0:
            return
        # the lock is held: a temporary file here is an earlier run's unfinished write
        _say_once(run_dir, stale_files.removal_line(run_dir, stale_files.remove_stale(run_dir)))
        for path, why in aside:  # as `flodl_mpi.outputs.checkpoint.set_aside_damaged`, from the survey made
            path.rename(path.with_name(path.name + ".damaged"))
            log.info(f"warning: {path.name} is damaged ({why}); not resumed from, kept as {path.name}.damaged")
        if latest is not None:
            return
        # --resume auto with nothing to continue: one line says the run starts (stdout; train.log, also
        # before its handler exists), and the history is not rebuilt away silently
        metrics = run_dir / "metrics.h5"
        kept = keep_before_restart(metrics)
        history = "" if kept is None else f"; {metrics.name}'s history ({_rows_words(kept[1])}) kept as {kept[0].name}"
        if aside:
            names = ", ".join(p.name for p, _ in aside)
            _say_once(run_dir, f"warning: every checkpoint in {run_dir / 'checkpoints'} is damaged ({names}; "
                               f"kept as *.damaged): the run starts again from epoch 1{history}")
        elif kept is not None:
            _say_once(run_dir, f"warning: no checkpoint in {run_dir / 'checkpoints'}: the run starts again from "
                               f"epoch 1{history}")
        else:
            _say_once(run_dir, new_run_line(run_dir))

    latest, aside, has_metrics = comm.bcast(agree(comm, "resume", survey, watchdog, name_ranks=False), root=0)
    if latest is None:
        agree(comm, "resume", set_aside, watchdog, name_ranks=False)
        return None, ({"rounds": 0, "epochs": 0, "batches": 0} if has_metrics else None)
    # Every rank reads the file itself (run directories live on a shared
    # filesystem), and of the per-rank state only the one it takes over.
    ckpt = agree(comm, "resume", lambda: read_contents(latest, ranks=[]), watchdog)
    # What an older flodl-mpi wrote is read by the contents' compatibility rules
    # (flodl_mpi.outputs.checkpoint_contents): its batch plan, the options added since.
    old_plan = ckpt.batch_plan_refusal(data_n, cfg.batch_size)
    if old_plan is not None:
        raise InputError(f"--resume: {old_plan}")
    saved = ckpt.saved_config()
    differ = comm.bcast(agree(comm, "resume", lambda: _option_differences(cfg, saved, run_dir)
                              if comm.rank == 0 else None, watchdog, name_ranks=False), root=0)
    if differ:
        raise InputError(f"--resume: the run in {run_dir} was started with other options: {'; '.join(differ)}")
    if model is not None:  # every rank holds the same model and read the same file: every rank decides alike
        changed = resume_difference(model, ckpt.meta, {**ckpt.params, **ckpt.buffers})
        if changed is not None:
            raise InputError(f"--resume: the model differs from the one {latest.name} was written for: {changed}; "
                             "resume with the run's model, or start a new run (nothing in it was touched)")
    old_size = ckpt.world_size
    source = comm.rank % old_size

    def rank_state():  # every rank reads the state of the same class: every rank fails alike
        state = read_rank_state(latest, source)
        if check_optimizer:
            _check_optimizer(cfg, latest, saved.get("optimizer"), state[1].get("optimizer_class"), comm.rank)
        return state

    ckpt.ranks = {source: agree(comm, "resume", rank_state, watchdog)}
    if ckpt.reports_in_ranks and old_size != world.size:
        # Schema 1 kept the stopped epoch's report in each rank's own state; on another world
        # size every rank needs every old rank's (on the same, each takes its own with its state).
        reports = agree(comm, "resume", ckpt.stopped_reports, watchdog)
        ckpt.epoch_reports = [reports[r] for r in range(old_size)]
    agree(comm, "resume", set_aside, watchdog, name_ranks=False)
    return ckpt, ckpt.metrics_rows


def _newest_record(run_dir: Path) -> Path:
    """The run's newest config record: the last ``config-resume-r*.json``, else ``config.json`` (may be absent)."""
    return (sorted(run_dir.glob("config-resume-r*.json")) or [run_dir / "config.json"])[-1]


def _option_differences(cfg: TrainConfig, saved: dict, run_dir: Path) -> list[str]:
    """The options in ``RESUME_MUST_MATCH`` (but the optimizer) that differ from the checkpoint's ``saved`` config.

    ``--model`` and ``--data`` differ only when they name another file, not another
    spelling of the run's (`flodl_mpi.training.resume_inputs`), judged with the run's newest
    config record. Reads files: rank 0 decides, the caller shares the list.
    """
    try:
        record = json.loads(_newest_record(run_dir).read_text())
    except (OSError, ValueError):
        record = {}
    differ = []
    for k in RESUME_MUST_MATCH:
        if k == "optimizer" or saved.get(k) == getattr(cfg, k):
            continue
        if k == "model":
            why = model_spec_difference(saved.get(k), cfg.model, record.get("model_file"))
        elif k == "data":
            why = data_path_difference(saved.get(k), cfg.data, record.get("data_fingerprint") is not None)
        else:
            why = f"--{k.replace('_', '-')} {getattr(cfg, k)!r} (was {saved.get(k)!r})"
        if why is not None:
            differ.append(why)
    return differ


def _rows_words(rows: dict[str, int] | None) -> str:
    if rows is None:
        return "unreadable"
    return ", ".join(f"{n} {table if n != 1 else table[:-1]}" for table, n in rows.items())


def check_resume_data(cfg: TrainConfig, run_dir: Path, data: Dataset, world: World, watchdog: Watchdog) -> str | None:
    """Collective: with ``resume``, refuse data that differ from the run's (`flodl_mpi.protocol.data_fingerprint`).

    Rank 0 compares the fingerprint of ``data`` with the one the run's newest record
    (``config-resume-r*.json``, else ``config.json``) holds; every rank learns the outcome.
    Reads only: call it before anything in ``run_dir`` is written.

    Returns:
        A note for train.log when the run's record holds no fingerprint (written by an
        older flodl-mpi: the data cannot be checked), else None.

    Raises:
        InputError: the data differ (shapes, dtypes or content); the message names what.
    """
    def check() -> str | None:
        if world.rank != 0 or not cfg.resume:
            return None
        newest = _newest_record(run_dir)
        if not newest.is_file():
            return None  # nothing to resume: a new run
        saved = json.loads(newest.read_text()).get("data_fingerprint")
        if saved is None:
            return (f"note: {newest.name} holds no data fingerprint (written by an older flodl-mpi): "
                    "whether the data changed since cannot be checked")
        differ = data_differences(saved, data_fingerprint(data))
        if differ:
            raise ValueError(f"--resume: the data differ from the run's in {run_dir}: {'; '.join(differ)} "
                             f"({data.source}); resume with the run's data, or start a new run "
                             "(nothing in it was touched)")
        return None

    return world.comm.bcast(agree(world.comm, "data check", check, watchdog, name_ranks=False), root=0)


def resume_point(cfg: TrainConfig, run_dir: Path, world: World, watchdog: Watchdog, model: torch.nn.Module,
                 data_n: int, check_optimizer: bool = True):
    """Where a run in ``run_dir`` goes on: ``(contents or None, keep_rows or None)``, ``(None, None)`` without ``resume``.

    The CLI's, ``fit``'s and the ``Averager``'s one way: `_find_resume` (the checks, the
    rows to keep), then the checkpoint's consensus loaded into ``model`` on every rank.
    Collective. Raises as `_find_resume`.
    """
    if not cfg.resume:
        return None, None
    ckpt, keep_rows = _find_resume(cfg, run_dir, world, watchdog, data_n, check_optimizer, model)
    if ckpt is not None:  # the consensus, on every rank alike
        agree(world.comm, "resume", lambda: model.load_state_dict(load_state_dict(ckpt.path)), watchdog)
    return ckpt, keep_rows


def _check_optimizer(cfg: TrainConfig, path: Path, recorded: str | None, held: str | None, rank: int) -> None:
    """Refuse a resume whose optimizer is not the one whose state ``path`` holds.

    Decided from what the checkpoint holds, its rank state's optimizer class
    (``held``: ``"SGD"``, ``"RMSprop"``...; None: no optimizer state, nothing to
    check), not from its config's record: ``fit`` before the record named the
    factory's class recorded ``"adam"`` for every optimizer factory (SGD,
    RMSprop...), and such a run resumes.

    Raises:
        ValueError: the run builds another optimizer class (one line; bad input).
    """
    if held is None:
        return
    uses = optimizer_class(cfg.optimizer)
    if held != uses:
        raise ValueError(f"--resume: {path} holds the optimizer state of {held}, this run builds {uses} "
                         f"(--optimizer {cfg.optimizer!r}); resume with the optimizer the run was started with")
    if recorded is not None and optimizer_class(recorded) != held and rank == 0:
        log.info(f"note: {path.name}'s config records optimizer {recorded!r}, but its state is {held}'s "
                 f"(recorded so by an earlier flodl_mpi.fit); resumed with {held}")


def _note_failure(run_dir: Path, rank: int, exc: BaseException) -> None:
    """Append why the run failed to ``train.log``, so the run directory tells later.

    A cohort error is written once, by rank 0; a local error by the rank that had it.
    """
    if isinstance(exc, CohortError) and rank != 0:
        return
    who = "run" if isinstance(exc, CohortError) else f"rank {rank}"
    line = f"{time.strftime('%H:%M:%S')} {who} failed: {type(exc).__name__}: {exc}\n"
    with contextlib.suppress(OSError):  # the run dir itself may be the problem; stderr has it
        with open(run_dir / "train.log", "a") as fh:
            fh.write(line)


def _check_same_model(model: torch.nn.Module, comm: MPI.Comm) -> None:
    """Every rank built the same module tree and tensors (`model_difference`), all of dtypes the
    float32 consensus keeps (`flodl_mpi.training.models.wide_tensor`); collective (one allgather).
    The CLI's, ``fit``'s and the ``Averager``'s start check.

    Raises:
        InputError: on every rank alike, naming the first difference and the ranks, or the
            first float64 (complex) parameter or floating buffer.
    """
    why = model_difference(comm.allgather((module_structure(model), model_signature(model))))
    if why is None:  # the same model on every rank: every rank decides alike
        why = wide_tensor(model)
    if why is not None:
        raise InputError(why)


def verbosity(args) -> int:
    """``-v`` count minus ``-q``: -1 quiet (warnings only), 0 default, 1 details."""
    return int(getattr(args, "verbose", 0) or 0) - int(bool(getattr(args, "quiet", False)))


class _TrainLogHandler(logging.FileHandler):
    """train.log's handler: a disk that refuses its lines (full, a quota, the file size limit) silences it with
    one warning on stderr, instead of logging's traceback for every line; the run goes on (stdout has the lines,
    and a checkpoint that no longer fits ends the run with its own one line)."""

    def handleError(self, record: logging.LogRecord) -> None:
        disk = disk_error(sys.exc_info()[1])
        if disk is None:
            super().handleError(record)
            return
        self.setLevel(logging.CRITICAL + 1)
        print(f"flodl-mpi: warning: {self.baseFilename}: {disk.strerror}: its lines are no longer written "
              "(stdout has them)", file=sys.stderr, flush=True)


class _StdoutHandler(logging.StreamHandler):
    """Rank 0's lines on stdout. A reader that went away (``flodl-mpi train | head -1``) ends the
    printing, not the run: the handler falls silent, stdout goes to /dev/null (so the exit's flush
    raises nothing), and train.log keeps every line."""

    flodl_stdout = True

    def emit(self, record: logging.LogRecord) -> None:
        try:  # a line in mid-epoch (a quarantine, a warning) goes above rank 0's progress bar, not into it
            if write_above_bars(self.format(record), self.stream):
                return
        except Exception:  # noqa: BLE001 - logging's contract: a failed emit goes to handleError
            self.handleError(record)
            return
        super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        if not isinstance(sys.exc_info()[1], BrokenPipeError):
            super().handleError(record)
            return
        self.setLevel(logging.CRITICAL + 1)
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())
            os.close(devnull)


def _log_to_stdout(rank: int, level: int) -> None:
    """Rank 0 prints the log on stdout from the start of setup (before the run dir exists).

    The other ranks print nothing of it: a NullHandler keeps logging's last resort
    (bare warnings on stderr, for a logger with no handler) from printing their
    copy of rank 0's warnings.
    """
    log.setLevel(logging.DEBUG)
    log.propagate = False
    if rank != 0 and not any(type(h) is logging.NullHandler for h in log.handlers):
        log.addHandler(logging.NullHandler())
    if rank == 0 and not any(getattr(h, "flodl_stdout", False) for h in log.handlers):
        handler = _StdoutHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        log.addHandler(handler)
    for h in log.handlers:
        if getattr(h, "flodl_stdout", False) and h.level <= logging.CRITICAL:  # not one silenced by a closed pipe
            h.setLevel(logging.WARNING if level < 0 else logging.DEBUG if level > 0 else logging.INFO)


def _setup_logging(run_dir: Path, rank: int) -> logging.Handler | None:
    """``train.log`` in the run dir: the default lines whatever -v/-q say.

    Returns the handler added (rank 0), for `close_train_log` when the run ends
    inside a longer process (the Python API); None on other ranks, or when one
    writes to that file already.
    """
    path = (Path(run_dir) / "train.log").resolve()
    if rank != 0 or any(isinstance(h, logging.FileHandler) and Path(h.baseFilename) == path for h in log.handlers):
        return None
    handler = _TrainLogHandler(path)
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    log.addHandler(handler)
    return handler


def close_train_log(handler: logging.Handler | None) -> None:
    """Detach and close a run's ``train.log`` handler, so a later run's lines do not land in it."""
    if handler is not None:
        log.removeHandler(handler)
        handler.close()


def _run_attrs(cfg: TrainConfig, world: World, device: torch.device) -> dict:
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


def _progress_mode(args, rank: int) -> EpochProgress:
    """Rank 0's bar: ``--progress bar``/``lines``, or ``auto``: a bar when stdout ends on a terminal."""
    mode = getattr(args, "progress", None) or "auto"
    on = rank == 0 and verbosity(args) >= 0 and (mode == "bar" or (mode == "auto" and stdout_is_terminal()))
    return EpochProgress(enabled=on)


def run_train(args, world: World, watchdog: Watchdog, stop: StopRequest) -> bool:
    """Set up this rank and train; returns whether every epoch is done (False: stopped on request).

    Collective: every rank calls it with the same ``args``.

    Raises:
        InputError: bad input on any rank (every rank raises it).
        CohortError: an error every rank saw (e.g. non-finite parameters).
        Exception: anything local; the caller aborts the world.
    """
    comm = world.comm
    _log_to_stdout(world.rank, verbosity(args))
    # PyTorch's first optimizer imports its compiler stack (seconds on a busy node):
    # build a throwaway one now, under the "loading PyTorch" line, not silently later.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)])
    # -- config, device, data
    cfg = agree(comm, "config", lambda: config_from_args(args), watchdog)
    watchdog.stall_timeout = cfg.stall_timeout
    requested = agree(comm, "threads", lambda: thread_request(cfg.threads), watchdog)
    threads, threads_line = settle_threads(comm, world.host, requested)
    torch.set_num_threads(threads)
    device = agree(comm, "device", lambda: pick_device(cfg.device, world.local_rank), watchdog)
    data = _load_data(cfg, world, watchdog)
    replay = load_replay_plan(cfg, world, watchdog, data)

    # -- model: same structure everywhere, right output size, then the same initial values
    torch.manual_seed(cfg.seed)

    def make_model() -> torch.nn.Module:
        model = build_model(cfg.model, data.input_shape, data.num_classes).to(device)
        wide = wide_tensor(model)  # before a trial batch of float32 data fails on it less clearly
        if wide is not None:
            raise ModelSpecError(f"--model {cfg.model!r}: {wide}")
        check_model_output(model, torch.from_numpy(data.train.x[:2]).to(device), data.num_classes, cfg.model)
        k, remedy = _smallest_training_batch(cfg, data.train.n)
        check_training_step(model, torch.from_numpy(data.train.x[:k]).to(device),
                            torch.from_numpy(data.train.y[:k]).to(device), cfg.model, remedy)
        return model

    model = agree(comm, "model", make_model, watchdog)
    _check_same_model(model, comm)
    replica = Replica(model, device)

    # -- outputs: nothing is created on disk before the input is known to be good
    run_dir = _make_run_dir(cfg, comm, watchdog)
    cfg = dataclasses.replace(cfg, run_dir=str(run_dir))  # as run
    data_note = check_resume_data(cfg, run_dir, data, world, watchdog)
    _setup_logging(run_dir, world.rank)
    if world.rank == 0:  # a stall's verdict ends train.log too
        watchdog.log_path = run_dir / "train.log"
    # A refused resume writes nothing to train.log: its checks come before the run's first line.
    ckpt, keep_rows = resume_point(cfg, run_dir, world, watchdog, model, data.train.n)
    log.info(threads_line)
    if data_note:
        log.info(data_note)
    if ckpt is not None and int(ckpt.meta["epoch"]) >= cfg.epochs:
        # Every rank read the same checkpoint: every rank returns here alike, before any collective
        # of the outputs. Nothing more is written: no config record, no metrics.h5 rebuild, no save.
        log.info(f"{final_line(cfg, True, [], int(ckpt.meta['epoch']), run_dir)}; no checkpoint, metrics.h5 or config record written")
        return True
    try:
        return _train(cfg, world, watchdog, data, replica, run_dir, ckpt, keep_rows, stop,
                      _progress_mode(args, world.rank), replay=replay)
    except BaseException as exc:
        _note_failure(run_dir, world.rank, exc)
        raise


def start_trainer(cfg: TrainConfig, world: World, watchdog: Watchdog, data: Dataset, replica: Replica,
                  run_dir: Path | None, ckpt: Checkpoint | None, keep_rows: dict | None, stop: StopRequest, *,
                  record=None, task=None, progress: EpochProgress | None = None,
                  late_header: str | None = None, on_resume=None,
                  remove_bad_new_run: bool = True,
                  replay: RecordedPlan | None = None) -> tuple[Trainer, Bridge, MetricsWriter | None]:
    """Open a run's outputs and build its bridge and trainer: one way for the CLI and :func:`flodl_mpi.fit`.

    Collective: every rank calls it alike, after the run dir, the resume survey
    and the checkpoint's consensus are settled. Rank 0 writes ``config.json``
    (``config-resume-rNNNNNN.json`` on a resume) and opens ``metrics.h5``; then
    the bridge (`make_bridge`), the consensus broadcast from rank 0, the
    per-rank seed, the `Trainer`, the save check and the resume. Returns with
    the watchdog on "training"; the caller starts the bridge and the epochs.

    Args:
        run_dir: None: no files (the Python API without ``run_dir``).
        record: rank 0's config record (``flodl_mpi.api.run_record``), called once;
            None: ``cfg.to_dict()`` (the CLI's).
        task, progress: the `Trainer`'s.
        late_header: None: the CLI's setup lines in train.log (header, warnings,
            what was resumed); a line (the API's threads line): only it and the
            header, once the trainer is ready.
        on_resume: called with the trainer after `Trainer.resume`.
        remove_bad_new_run: a new run whose input turned out bad during this
            setup (InputError) leaves no run dir behind.
        replay: the `load_replay_plan` of ``--replay-plan`` (None: the policy plans).

    Raises:
        InputError, CohortError: as `agree` (every rank alike); the metrics
            writer is closed first.
    """
    comm = world.comm

    attrs = _run_attrs(cfg, world, replica.device)
    attrs["data_source"] = data.source
    writer = None
    if world.rank == 0 and run_dir is not None:
        config = cfg.to_dict()
        if record is not None:  # what the user's factories built, not the CLI's defaults
            config = record()
            attrs.update(config=config, loss=config["loss"])
        config = {**config, "data_fingerprint": data_fingerprint(data)}  # what a resume checks
        model_file = model_file_record(cfg.model) if record is None else None  # the CLI's --model file
        if model_file is not None:
            config["model_file"] = model_file
        # config.json is the run's first config; each resume adds its own beside it.
        resumed_at = int(ckpt.meta["round"]) if ckpt is not None else 0
        name = "config.json" if keep_rows is None else f"config-resume-r{resumed_at:06d}.json"
        writer = MetricsWriter(run_dir, world.size, attrs, run_dir / "checkpoints", cfg.keep_checkpoints,
                               keep_rows=keep_rows)

    def open_outputs() -> None:  # rank 0; a full disk here is the writer's one line too
        if writer is None:
            return
        try:
            (run_dir / name).write_text(json.dumps(config, indent=2) + "\n")
        except OSError as exc:
            raise disk_writer_error(run_dir, exc) or exc
        writer.start()

    agree(comm, "metrics writer", open_outputs, watchdog, name_ranks=False)
    try:
        bridge = make_bridge(cfg, world, replica, writer, watchdog)
        if bridge.policy.blocking:  # async trains on while a round runs: its staging must stay apart
            replica.bind(bridge)  # before the optimizer: it keeps the Parameter objects, not their storage
        replica.snapshot(bridge)
        bridge.broadcast(root=0)
        replica.adopt(bridge)
        # Per-rank randomness (dropout and the like) differs by rank, reproducibly.
        torch.manual_seed(int(np.random.SeedSequence([cfg.seed, world.rank]).generate_state(1)[0]))

        if late_header is None:
            log_header(cfg, world.size, replica, attrs["devices"], data, run_dir, bridge=bridge)
            n_batches = num_batches(data.train.n, cfg.batch_size, cfg.drop_last)
            if n_batches < world.size:
                log.warning(f"warning: an epoch has {n_batches} batch(es) of {cfg.batch_size} for {world.size} "
                            f"ranks, so rank(s) {n_batches}..{world.size - 1} never train; lower --batch-size")
            if writer is not None:
                for line in writer.recovered:
                    log.info(f"warning: {line}")
        trainer = Trainer(cfg, world.rank, world.size, data, replica, bridge, writer, log=log.info, stop=stop,
                          progress=progress, log_detail=log.debug if late_header is None else None, task=task,
                          replay=replay, warn=log.warning)
        if trainer.state_average is not None and late_header is None:
            averaged = trainer.state_average
            log.info(f"optimizer state averaged ({averaged.mode}): {len(averaged.plan.wire)} state tensors, "
                     f"{averaged.plan.wire_bytes} more bytes per round and rank")
        # Anything that would fail at save time fails now, before an epoch of work.
        if run_dir is not None:
            done = int(ckpt.meta["epoch"]) if ckpt is not None else 0
            agree(comm, "checkpoint check", lambda: trainer.check_saveable(run_dir / "checkpoints", done), watchdog,
                  name_ranks=False)
        if ckpt is not None:
            agree(comm, "resume", lambda: trainer.resume(ckpt), watchdog)
            if on_resume is not None:
                on_resume(trainer)
            if late_header is None:
                log.info(f"resuming from {ckpt.path.name}: {trainer.start_epoch} epoch(s) done, "
                         f"{trainer.start_cursor} batch(es) into the next, round {bridge.version}")
                if trainer.remapped:
                    log.info(trainer.remapped)
    except BaseException as exc:
        # Setup failed after the outputs were opened: close metrics.h5 (no "open for
        # write" flag left), and for a new run whose input turned out bad (a state the
        # checkpoint format cannot hold) remove what this run created, so nothing is
        # left on disk and the same command can simply be run again.
        if writer is not None:
            with contextlib.suppress(WriterError):
                writer.close(timeout=10.0)
            if remove_bad_new_run and isinstance(exc, InputError) and keep_rows is None and ckpt is None:
                shutil.rmtree(run_dir, ignore_errors=True)
        raise
    if late_header is not None and writer is not None:
        log.info(late_header)
        log_header(cfg, world.size, replica, attrs["devices"], data, run_dir, api=True,  # train.log as the CLI's
                   bridge=bridge)
    trainer.made_progress = watchdog.progress  # each batch trained is progress for the stall watchdog
    watchdog.begin("training")
    return trainer, bridge, writer


def _train(cfg: TrainConfig, world: World, watchdog: Watchdog, data: Dataset, replica: Replica,
           run_dir: Path, ckpt: Checkpoint | None, keep_rows: dict | None, stop: StopRequest,
           progress: EpochProgress | None = None, replay: RecordedPlan | None = None) -> bool:
    trainer, bridge, writer = start_trainer(cfg, world, watchdog, data, replica, run_dir, ckpt, keep_rows, stop,
                                            progress=progress, replay=replay)

    # -- train
    bridge.start()
    try:
        history = trainer.fit()
    except BaseException:
        # Close metrics.h5 cleanly (easier on its readers, and on a resume); the
        # error in flight is the one to report, not a writer error behind it.
        if writer is not None:
            with contextlib.suppress(WriterError):
                writer.close(timeout=10.0)
        raise
    bridge.close()
    for line in bridge.profile.lines():  # every rank's, from the acks (rank 0 logs them)
        log.info(line)
    if writer is not None:
        log.info(f"finishing: writing the last checkpoint and closing {run_dir / 'metrics.h5'}")
        # No time cap on the last save (a big model on a slow file system may take
        # minutes): the watchdog's stall timeout is the bound.
        t0 = time.monotonic()
        watchdog.round_started("the final save")
        writer.close(timeout=None)
        watchdog.round_finished()
        log.info(f"final save written in {time.monotonic() - t0:.1f} s "
                 f"(the last checkpoint took {writer.last_save_s:.1f} s)")
        log.info(final_line(cfg, trainer.done, history, trainer.start_epoch, run_dir, stop_hint=_stop_hint(stop, run_dir)))
    return trainer.done


def _stop_hint(stop: StopRequest, run_dir: Path) -> str | None:
    """train.log's words on the exit after a stop where the launcher's status may not be 4 (None: the default).

    Open MPI's mpiexec ends a job it passed a SIGTERM or Ctrl-C to with its own
    status (1), whatever the ranks return (`StopRequest.launcher_ends_job`).
    """
    if not (getattr(stop, "launcher_ends_job", False) and stop.signal_name in ("SIGTERM", "SIGINT")):
        return None
    return (f"this rank exits with status 4; Open MPI's launcher, which passes a {stop.signal_name} on and ends the "
            f"job itself, may return its own status (1): to go on, run the same command with --resume --run-dir "
            f"{run_dir}")


#: Words for `flodl_mpi.transport.reduce.Reducer.path`: how a round's frames travel.
_PATH_WORDS = {
    "allreduce": "one chunked MPI Allreduce over the world",
    "allgather-bf16": "bfloat16 frames gathered over the world (MPI Allgather), summed in float32",
    "shm": "the node's shared memory (/dev/shm), each rank summing a slice",
    "shm-in-place": "the node's shared memory (/dev/shm), in place",
    "shm+leaders": "node sums in shared memory, then the node leaders' MPI Allreduce across nodes",
    "node-mpi+leaders": "node sums over MPI, then the node leaders' MPI Allreduce across nodes",
}


def describe_averaging_path(cfg: TrainConfig, path: str, nodes: int) -> str:
    """train.log's line on the averaging path in effect (``--node-reduce``, ``--hierarchical``,
    ``--bf16-wire`` as resolved by the reducer: `flodl_mpi.transport.reduce.Reducer` ``path``, ``nodes``)."""
    text = (f"averaging path: {_PATH_WORDS.get(path, path)} ({nodes} node{'' if nodes == 1 else 's'}; "
            f"--node-reduce {cfg.node_reduce}, --hierarchical {cfg.hierarchical}"
            + (", --bf16-wire" if cfg.bf16_wire else "") + ")")
    if cfg.hierarchical == "on" and nodes == 1:
        text += "; hierarchical: on, 1 node: the node reduce alone (no step across nodes)"
    return text


def log_header(cfg: TrainConfig, world_size: int, replica: Replica, devices: list, data: Dataset,
               run_dir: Path, api: bool = False, bridge: Bridge | None = None) -> None:
    """train.log's header (rank 0): ranks, policy, model size, data, run dir; then the effective batch,
    given the ``bridge`` the averaging path in effect (`describe_averaging_path`), and a warning
    when an outer step comes with rounds too frequent for it (`flodl_mpi.protocol.outer.short_window_warning`).

    ``api``: the effective batch worded in :func:`flodl_mpi.fit`'s keywords (`effective_batch_line`).
    """
    ranks = f"{world_size} rank{'s' if world_size != 1 else ''}"
    log.info(f"flodl-mpi {__version__}: {ranks}, {_describe_policy(cfg)}, "
             f"gamma {cfg.gamma:g}, {sum(p.numel() for p in replica.params)} params on {devices}, "
             f"{data.train.n} train / {data.test.n} test samples from {data.source}"
             f"{', ' + data.classes_note if data.classes_note else ''}; run dir {run_dir}")
    for line in data.warnings:  # labels that give outputs training never targets (issue 26 item 9)
        log.warning(line)
    log.info(effective_batch_line(cfg, world_size, api, data.train.n))
    if bridge is not None and world_size > 1:
        log.info(describe_averaging_path(cfg, bridge.reducer.path, bridge.reducer.nodes))
    policy, options = f"policy={cfg.policy!r}" if api else f"--policy {cfg.policy}", policy_spec(cfg.policy).options
    window = make_policy(cfg, world_size).plan().anchor  # the first plan's (sync: 1; a fixed window: --window)
    if "window" in options:
        cadence = f"window={cfg.window}" if api else f"--window {cfg.window}"
    elif "anchor" in options:  # the cadence's first anchor: the slowest rank's window, which may grow
        cadence = f"{policy}, first anchor {window}"
    else:
        cadence = policy
    warning = short_window_warning(cfg.outer, window, cadence, cfg.outer_lr, cfg.outer_momentum, api=api)
    if warning:
        log.warning(warning)


def final_line(cfg: TrainConfig, done: bool, history: list, start_epoch: int, run_dir: Path,
               metrics: dict | None = None, stop_hint: str | None = None) -> str:
    """train.log's last line: ``done: ...`` with what the run measured, or why it is not done.

    Args:
        history: the :class:`~flodl_mpi.protocol.epoch_report.EpochSummary` of the epochs trained.
        metrics: the last evaluation's ``{name: value}`` (the Python API's); None: the summary's.
        stop_hint: how to go on after a stop (default: the CLI's ``--resume --run-dir DIR``).
    """
    if not done:  # `done` only when every epoch is: the exit status is 4, not 0
        hint = stop_hint or f"exit status 4: to go on, run the same command with --resume --run-dir {run_dir}"
        return f"stopped, not done ({cfg.epochs} epoch{'' if cfg.epochs == 1 else 's'} asked); {hint}"
    if not history:
        return (f"nothing to do: the run already did {start_epoch} epoch{'' if start_epoch == 1 else 's'} "
                f"(--epochs {cfg.epochs}); raise --epochs to train further")
    last = history[-1]
    if not math.isnan(last.test_accuracy):
        measured = f"test accuracy {last.test_accuracy:.4f}"
    elif metrics:
        measured = ", ".join(f"test {k} {v:.4f}" for k, v in metrics.items())
    elif not math.isnan(last.test_loss):
        measured = f"test loss {last.test_loss:.4f}"
    else:
        measured = "no test metric"
    return (f"done: {measured} after {last.rounds} round{'' if last.rounds == 1 else 's'}; metrics {run_dir / 'metrics.h5'}, "
            f"checkpoints {run_dir / 'checkpoints'}")
