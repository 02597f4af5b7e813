"""The words and checks of a rank's run: device, replay plan, train.log's header and last line, the resume.

`flodl_mpi.training.setup.setup_rank` (the one setup of the CLI, :func:`flodl_mpi.fit` and
the ``Averager``) calls the resume's checks here (`check_resume_data`, `resume_point`);
the CLI's run (`flodl_mpi.training.run.run_train`) and :func:`flodl_mpi.fit` word their
lines with `log_header`, `effective_batch_line` and `final_line`. Every collective step
goes through :func:`flodl_mpi.runtime.world.agree`, so bad input on any rank becomes one
clear line on rank 0 and a non-zero exit everywhere, never a hang.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch

from flodl_mpi import __version__
from flodl_mpi.config import RESUME_AUTO, TrainConfig, optimizer_class
from flodl_mpi.errors import InputError
from flodl_mpi.outputs import stale_files
from flodl_mpi.outputs.checkpoint import load_state_dict, newest_verified, read_rank_state
from flodl_mpi.outputs.checkpoint_contents import read_contents
from flodl_mpi.outputs.metrics import keep_before_restart
from flodl_mpi.policy.replay import RecordedPlan, read_recorded_plan
from flodl_mpi.protocol.data_fingerprint import differences as data_differences
from flodl_mpi.protocol.data_fingerprint import fingerprint as data_fingerprint
from flodl_mpi.protocol.outer import OuterOptimizer, short_window_warning, strong_momentum_warning
from flodl_mpi.policy.registry import describe as describe_policy
from flodl_mpi.policy.registry import get as policy_spec
from flodl_mpi.policy.registry import make_policy
from flodl_mpi.runtime.world import Watchdog, World, agree
from flodl_mpi.training.accumulate import smallest_micro_batch
from flodl_mpi.training.data import Dataset, num_batches
from flodl_mpi.training.model_record import resume_difference
from flodl_mpi.training.resume_inputs import data_path_difference, model_spec_difference
from flodl_mpi.training.resume_target import new_run_line
from flodl_mpi.training.train_log import log, say_once
from flodl_mpi.training.replica import Replica
from flodl_mpi.transport.bridge import Bridge

__all__ = ["RESUME_MUST_MATCH", "check_amp", "check_resume_data", "describe_averaging_path", "effective_batch_line",
           "final_line", "load_replay_plan", "log", "log_header", "pick_device", "resume_point",
           "smallest_training_batch", "step_options_line"]


def pick_device(choice: str, local_rank: int, amp: str = "off") -> torch.device:
    """Map ``--device`` and the local rank to a device: one GPU per local rank; ``--amp`` is checked on it.

    Raises:
        ValueError: ``cuda`` asked for but no CUDA device is visible; ``amp`` the device cannot run
            (`check_amp`).
    """
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
    else:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    check_amp(amp, device)
    return device


def check_amp(amp: str, device: torch.device) -> None:
    """Refuse ``--amp`` when this torch cannot autocast to its dtype on ``device`` (a CUDA device without
    bfloat16, a torch whose CPU autocast lacks float16): a trial matmul under ``torch.autocast``, and fp16's
    ``torch.amp.GradScaler`` built for the device, before anything is trained.

    Raises:
        ValueError: one line naming the mode, the device and what torch said.
    """
    if amp == "off":
        return
    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    why = None
    if device.type == "cuda" and amp == "bf16" and not torch.cuda.is_bf16_supported():
        why = f"{torch.cuda.get_device_name(device)} has no bfloat16 (torch.cuda.is_bf16_supported() is False)"
    else:
        try:
            with torch.autocast(device.type, dtype=dtype):
                out = torch.ones(2, 2, device=device) @ torch.ones(2, 2, device=device)
            if out.dtype != dtype:
                why = f"a matmul under torch.autocast gave {out.dtype}"
            if amp == "fp16":
                torch.amp.GradScaler(device.type)
        except (RuntimeError, ValueError) as exc:
            why = f"{type(exc).__name__}: {exc}".splitlines()[0]
    if why is not None:
        other = "bf16" if amp == "fp16" else "fp16"
        raise ValueError(f"--amp {amp}: torch {torch.__version__} cannot autocast to {dtype} on {device.type} "
                         f"({why}); use --amp {other} or --amp off")


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
    n_batches = num_batches(data.train.n, cfg.step_samples, cfg.drop_last)
    samples = n_batches * cfg.step_samples if cfg.drop_last else data.train.n
    why = plan.refusal(world.size, cfg.policy, n_batches, samples, cfg.epochs)
    if why is not None:
        raise InputError(why)
    return plan


def smallest_training_batch(cfg: TrainConfig, n_samples: int) -> tuple[int, str]:
    """The smallest batch the batch plan makes (samples; a micro-batch with ``--accumulate``), and what
    to change if the model fails on it.

    Raises:
        ValueError: ``--drop-last`` leaves no batch at all.
    """
    k = smallest_micro_batch(n_samples, cfg.batch_size, cfg.accumulate, cfg.drop_last)
    if k == 0:
        both = f" x --accumulate {cfg.accumulate}" if cfg.accumulate > 1 else ""
        raise ValueError(f"--drop-last with --batch-size {cfg.batch_size}{both} leaves no batch: the training set "
                         f"has {n_samples} samples; lower --batch-size")
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
    per = cfg.step_samples  # one optimizer step's samples on one rank
    batch = f"batch {cfg.batch_size}" if cfg.accumulate == 1 else \
        f"batch {cfg.batch_size} x {cfg.accumulate} accumulated = {per}"
    eff, ratio = per * world_size, world_size
    ranks = f"{world_size} rank{'s' if world_size != 1 else ''}"
    text = f"{batch} per rank, effective batch {per} x {ranks} = {eff} samples per step of the averaged model"
    batches = num_batches(n_samples, per, cfg.drop_last) if n_samples is not None else 0
    planned = min(n_samples, batches * per) if cfg.drop_last else n_samples
    if n_samples is not None and batches > 0 and eff > planned:
        ratio = batches / -(-batches // world_size)  # one process's steps per epoch / the cohort's rounds
        text = (f"{batch} per rank, effective batch {planned} samples per step of the averaged "
                f"model, at most: {per} x {ranks} = {eff} asked, capped by the training set of "
                f"{n_samples} samples ({batches} batch{'es' if batches != 1 else ''} per epoch)")
    if cfg.scale_lr and world_size > 1:
        ramp = f" after {cfg.warmup_steps} warm-up steps" if cfg.warmup_steps else ""
        return f"{text}; {scale}: lr {cfg.lr:g} x {world_size} = {cfg.lr * world_size:g}{ramp}"
    if world_size > 1 and ratio > 1:
        return (f"{text}; lr {cfg.lr:g} as given (one process at batch {per} would take {ratio:g}x "
                f"the steps per epoch: to match it, raise {raise_lr} toward {cfg.lr * ratio:g} or "
                f"{'set' if api else 'add'} {scale})")
    return text


def step_options_line(cfg: TrainConfig, total_steps: int, api: bool = False) -> str | None:
    """The header's line on the learning-rate schedule and the precision of a step (None: the defaults).

    ``total_steps``: the run's cohort steps (``epochs × steps per epoch``), what ``cosine`` and
    ``linear`` decay over. ``api``: worded in :func:`flodl_mpi.fit`'s keywords.
    """
    words = []
    if cfg.lr_schedule != "constant" or (cfg.warmup_steps and not cfg.scale_lr):
        start = "from --lr" if cfg.scale_lr else "from 0"
        warm = f"{cfg.warmup_steps} warm-up steps {start}, then " if cfg.warmup_steps else ""
        shape = {"constant": "constant", "cosine": "cosine to 0", "linear": "linear to 0",
                 "step": f"x {cfg.lr_gamma_value:g} every {cfg.lr_step_size} steps"}[cfg.lr_schedule]
        words.append(f"learning rate: {warm}{shape} over the run's {total_steps} cohort steps")
    if cfg.amp != "off":
        words.append(f"{'amp=' if api else '--amp '}{cfg.amp}: forward and evaluation under torch.autocast"
                     + (", loss scaled by a GradScaler" if cfg.amp == "fp16" else ""))
    return "; ".join(words) or None


#: Options a resumed run must share with the checkpoint's run: they decide the
#: model, the data order, the windows and the optimizer state's meaning. The world
#: size may change (see `Trainer.resume` for how per-rank state is remapped). The
#: optimizer is checked against the state the checkpoint holds (`_check_optimizer`).
RESUME_MUST_MATCH = ("model", "data", "train_x", "train_y", "test_x", "test_y", "batch_size", "accumulate",
                     "drop_last", "seed", "val_fraction", "policy", "window", "gamma", "optimizer", "outer",
                     "average_optimizer_state")


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
        say_once(run_dir, stale_files.removal_line(run_dir, stale_files.remove_stale(run_dir)))
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
            say_once(run_dir, f"warning: every checkpoint in {run_dir / 'checkpoints'} is damaged ({names}; "
                               f"kept as *.damaged): the run starts again from epoch 1{history}")
        elif kept is not None:
            say_once(run_dir, f"warning: no checkpoint in {run_dir / 'checkpoints'}: the run starts again from "
                               f"epoch 1{history}")
        else:
            say_once(run_dir, new_run_line(run_dir))

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


def settle_outer(cfg: TrainConfig, ckpt) -> tuple[TrainConfig, str | None]:
    """``cfg`` with the outer optimizer's lr and momentum as this run trains at them, and a line for a resume
    that keeps values other than today's defaults (None otherwise).

    Each is the option given, else the run's own (the resumed checkpoint's config; a config that
    left it unset, from before the values were recorded, trained at
    :data:`flodl_mpi.protocol.outer.OUTER_DEFAULTS_BEFORE`), else today's default
    (`flodl_mpi.protocol.outer.settled_outer`). The values are then in every checkpoint's
    config, so a later change of the defaults never changes a run that resumes. ``--outer avg``
    has neither: ``cfg`` is returned as it is.
    """
    from flodl_mpi.protocol.outer import OUTER_DEFAULTS, settled_outer

    if cfg.outer == "avg":
        return cfg, None
    saved = ckpt.saved_config() if ckpt is not None else None
    lr, momentum = settled_outer(cfg.outer, cfg.outer_lr, cfg.outer_momentum, saved)
    note = None
    if saved is not None and (cfg.outer_lr is None or cfg.outer_momentum is None) \
            and (lr, momentum) != OUTER_DEFAULTS[cfg.outer]:
        d_lr, d_mu = OUTER_DEFAULTS[cfg.outer]
        note = (f"--outer {cfg.outer}: lr {lr:g}, momentum {momentum:g}, the run's own (today's defaults: lr {d_lr:g}, "
                f"momentum {d_mu:g}; --outer-lr and --outer-momentum change them)")
    return dataclasses.replace(cfg, outer_lr=lr, outer_momentum=momentum), note


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


#: Words for `flodl_mpi.transport.reduce.Reducer.path`: how a round's frames travel.
_PATH_WORDS = {
    "allreduce": "one chunked MPI Allreduce over the world",
    "allgather-bf16": "bfloat16 frames gathered over the world (MPI Allgather), summed in float32",
    "allgather-bf16-delta": "bfloat16 deltas from the last consensus, with error feedback, gathered over the world "
                            "(MPI Allgather), summed in float64",
    "allgather-int8-delta": "int8 deltas from the last consensus (a scale per tensor), with error feedback, gathered "
                            "over the world (MPI Allgather), summed in float64",
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
            + (", --bf16-wire" if cfg.wire_mode == "bf16" else f", --wire {cfg.wire_mode}" if cfg.wire_mode != "fp32"
               else "") + ")")
    if cfg.hierarchical == "on" and nodes == 1:
        text += "; hierarchical: on, 1 node: the node reduce alone (no step across nodes)"
    return text


def log_header(cfg: TrainConfig, world_size: int, replica: Replica, devices: list, data: Dataset,
               run_dir: Path, api: bool = False, bridge: Bridge | None = None) -> None:
    """train.log's header (rank 0): ranks, policy, model size, data, run dir; then the effective batch,
    given the ``bridge`` the averaging path in effect (`describe_averaging_path`), and a warning
    when an outer step comes with rounds too frequent for it (`flodl_mpi.protocol.outer.short_window_warning`)
    or with a momentum measured to lose accuracy (`flodl_mpi.protocol.outer.strong_momentum_warning`).

    ``api``: the effective batch worded in :func:`flodl_mpi.fit`'s keywords (`effective_batch_line`).
    """
    ranks = f"{world_size} rank{'s' if world_size != 1 else ''}"
    log.info(f"flodl-mpi {__version__}: {ranks}, {_describe_policy(cfg)}, "
             f"gamma {cfg.gamma:g}, {sum(p.numel() for p in replica.params)} params on {devices}, "
             f"{data.train.n} train / {_held_out(cfg, data, api)}{data.test.n} test samples from {data.source}"
             f"{', ' + data.classes_note if data.classes_note else ''}; run dir {run_dir}")
    for line in data.warnings:  # labels that give outputs training never targets (issue 26 item 9)
        log.warning(line)
    if hasattr(data.train.x, "loader_words"):  # a torch Dataset (flodl_mpi.training.torch_rows)
        log.info(data.train.x.loader_words())
    elif hasattr(data.train.x, "prefetch"):  # streamed (flodl_mpi.training.stream): say so, auto's choice too
        log.info(f"data streamed (--data-loading {cfg.data_loading}): each rank reads only its batches' rows of the "
                 "features, a thread reading the next window's ahead; the labels are in memory")
    log.info(effective_batch_line(cfg, world_size, api, data.train.n))
    options = step_options_line(cfg, cfg.epochs * num_batches(data.train.n, cfg.step_samples, cfg.drop_last), api)
    if options:
        log.info(options)
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
    warning = (short_window_warning(cfg.outer, window, cadence, cfg.outer_lr, cfg.outer_momentum, api=api)
               or strong_momentum_warning(cfg.outer, window, cfg.outer_lr, cfg.outer_momentum, api=api))
    if warning:
        log.warning(warning)


def _held_out(cfg: TrainConfig, data: Dataset, api: bool) -> str:
    """The header's words on the validation split: ``287 validation (--val-fraction 0.2, seed 0) / ``; "" for none."""
    if data.val is None:
        return ""
    if cfg.val_fraction is None:  # a val/ group of the file, or fit()'s validation split
        return f"{data.val.n} validation (the data's own) / "
    option = f"val_fraction={cfg.val_fraction:g}" if api else f"--val-fraction {cfg.val_fraction:g}"
    return f"{data.val.n} validation ({option} of the training set, seed {cfg.seed}) / "


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
