"""``flodl-mpi train``'s run of a rank: the config, device, data and model, then the one setup, then the epochs.

Invariant: the CLI calls this module (`run_train`), never the reverse: the config is
built by the caller's ``make_config`` (`flodl_mpi.cli.main.config_from_args`), agreed on
every rank; the rest of the setup is `flodl_mpi.training.setup.setup_rank`'s, the same
as :func:`flodl_mpi.fit`'s and the ``Averager``'s.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import torch

from flodl_mpi.config import TrainConfig
from flodl_mpi.runtime.launcher import settle_threads, thread_request
from flodl_mpi.runtime.signals import StopRequest
from flodl_mpi.runtime.world import Watchdog, World, agree
from flodl_mpi.outputs.metrics import WriterError
from flodl_mpi.training.models import ModelSpecError, build_model, check_model_output, check_training_step, wide_tensor
from flodl_mpi.training.progress import EpochProgress, stdout_is_terminal
from flodl_mpi.training.setup import RankRun, TrainerFront, load_data, start_trainer
from flodl_mpi.training.train import final_line, load_replay_plan, pick_device, smallest_training_batch
from flodl_mpi.training.train_log import close_train_logs, log, log_to_stdout, note_failure, verbosity
from flodl_mpi.training.best_model import BestWatch
from flodl_mpi.training.validation import settle_validation

__all__ = ["progress_mode", "run_train", "stop_hint"]


def _stopped_early(cfg, ckpt) -> str | None:
    """The nothing-to-do line of a resumed run whose checkpoint stopped early under this run's
    ``--early-stop`` (`flodl_mpi.training.best_model.BestWatch`), else None."""
    if ckpt is None or cfg.early_stop is None:
        return None
    watch = BestWatch(cfg.best_metric, cfg.early_stop)
    if not watch.restore(ckpt.extra) or not watch.early_stopped:
        return None
    return (f"nothing to do: the run stopped early after epoch {ckpt.epoch} (no better {watch.metric} since epoch "
            f"{watch.best_epoch}, --early-stop {cfg.early_stop}); raise --early-stop to train further")


def progress_mode(args, rank: int) -> EpochProgress:
    """Rank 0's bar: ``--progress bar``/``lines``, or ``auto``: a bar when stdout ends on a terminal."""
    mode = getattr(args, "progress", None) or "auto"
    on = rank == 0 and verbosity(args) >= 0 and (mode == "bar" or (mode == "auto" and stdout_is_terminal()))
    return EpochProgress(enabled=on)


def run_train(args, world: World, watchdog: Watchdog, stop: StopRequest,
              make_config: Callable[[object], TrainConfig]) -> bool:
    """Set up this rank and train; returns whether every epoch is done (False: stopped on request).

    Collective: every rank calls it with the same ``args``. ``make_config``: ``args`` ->
    the validated config (`flodl_mpi.cli.main.config_from_args`), agreed on every rank.

    Raises:
        InputError: bad input on any rank (every rank raises it).
        CohortError: an error every rank saw (e.g. non-finite parameters).
        Exception: anything local; the caller aborts the world.
    """
    comm = world.comm
    log_to_stdout(world.rank, verbosity(args))
    # PyTorch's first optimizer imports its compiler stack (seconds on a busy node):
    # build a throwaway one now, under the "loading PyTorch" line, not silently later.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)])
    # -- config, device, data
    cfg = agree(comm, "config", lambda: make_config(args), watchdog)
    watchdog.stall_timeout = cfg.stall_timeout
    requested = agree(comm, "threads", lambda: thread_request(cfg.threads), watchdog)
    threads, threads_line = settle_threads(comm, world.host, requested)
    torch.set_num_threads(threads)
    device = agree(comm, "device", lambda: pick_device(cfg.device, world.local_rank, cfg.amp), watchdog)
    data = load_data(cfg, world, watchdog)
    loaded = data  # --val-fraction: held out once, from --seed, before anything is planned on the training set
    data = agree(comm, "data", lambda: settle_validation(loaded, cfg), watchdog)
    replay = load_replay_plan(cfg, world, watchdog, data)

    # -- model: right output size, one training step; the same structure everywhere (the setup checks)
    torch.manual_seed(cfg.seed)

    def make_model() -> torch.nn.Module:
        model = build_model(cfg.model, data.input_shape, data.num_classes).to(device)
        wide = wide_tensor(model)  # before a trial batch of float32 data fails on it less clearly
        if wide is not None:
            raise ModelSpecError(f"--model {cfg.model!r}: {wide}")
        check_model_output(model, torch.from_numpy(data.train.x[:2]).to(device), data.num_classes, cfg.model,
                           data.train.y.shape[1:])
        k, remedy = smallest_training_batch(cfg, data.train.n)
        check_training_step(model, torch.from_numpy(data.train.x[:k]).to(device),
                            torch.from_numpy(data.train.y[:k]).to(device), cfg.model, remedy)
        return model

    model = agree(comm, "model", make_model, watchdog)

    def prepared(run: RankRun) -> bool:  # the run dir, train.log and the resume point are settled
        log.info(threads_line)
        if run.data_note:
            log.info(run.data_note)
        if run.ckpt is not None and run.ckpt.epoch >= run.cfg.epochs:
            # Every rank read the same checkpoint: every rank returns here alike, before any collective
            # of the outputs. Nothing more is written: no config record, no metrics.h5 rebuild, no save.
            log.info(f"{final_line(run.cfg, True, [], run.ckpt.epoch, run.run_dir)}; no checkpoint, "
                     "metrics.h5 or config record written")
            return False
        early = _stopped_early(run.cfg, run.ckpt)
        if early is not None:  # as above: every rank read the same meta and returns alike
            log.info(f"{early}; no checkpoint, metrics.h5 or config record written")
            return False
        return True

    front = TrainerFront(stop, progress=progress_mode(args, world.rank), replay=replay,
                         on_prepared=prepared, run_dir_always=True, remove_bad_new_run=True)
    try:
        run = start_trainer(cfg, world, watchdog, data, model, device, front)
        if front.trainer is None:  # nothing to train
            return True
        return _train(run, front, stop)
    except BaseException as exc:
        if front.run is not None and front.writing:  # past the resume's checks: train.log says why
            note_failure(front.run.run_dir, world.rank, exc)
        raise
    finally:  # the run is over: a later run in this process (tests' run_sequence) writes its own train.log only
        if front.run is not None and front.run.run_dir is not None:
            close_train_logs(front.run.run_dir)


def _train(run: RankRun, front: TrainerFront, stop: StopRequest) -> bool:
    trainer, bridge, writer, cfg, run_dir, watchdog = front.trainer, run.bridge, run.writer, run.cfg, run.run_dir, \
        run.watchdog
    # -- train
    bridge.start()
    try:
        history = trainer.fit()
    except BaseException:
        # Close metrics.h5 cleanly (easier on its readers, and on a resume); the
        # error in flight is the one to report, not a writer error behind it.
        with contextlib.suppress(WriterError):
            writer.close(timeout=10.0)
        raise
    # After a shrink (--on-rank-failure) the trainer holds the new world's bridge and rank 0's writer.
    bridge, writer = trainer.bridge, trainer.writer
    bridge.close()
    for line in bridge.profile.lines():  # every rank's, from the acks (rank 0 logs them)
        log.info(line)
    if writer.writes:  # rank 0's final save and last lines
        log.info(f"finishing: writing the last checkpoint and closing {run_dir / 'metrics.h5'}")
        # No time cap on the last save (a big model on a slow file system may take
        # minutes): the watchdog's stall timeout is the bound.
        t0 = time.monotonic()
        watchdog.round_started("the final save")
        writer.close(timeout=None)
        watchdog.round_finished()
        log.info(f"final save written in {time.monotonic() - t0:.1f} s "
                 f"(the last checkpoint took {writer.last_save_s:.1f} s)")
        log.info(final_line(cfg, trainer.done, history, trainer.start_epoch, run_dir, stop_hint=stop_hint(stop, run_dir)))
    return trainer.done


def stop_hint(stop: StopRequest, run_dir: Path) -> str | None:
    """train.log's words on the exit after a stop where the launcher's status may not be 4 (None: the default).

    Open MPI's mpiexec ends a job it passed a SIGTERM or Ctrl-C to with its own
    status (1), whatever the ranks return (`StopRequest.launcher_ends_job`).
    """
    if not (getattr(stop, "launcher_ends_job", False) and stop.signal_name in ("SIGTERM", "SIGINT")):
        return None
    return (f"this rank exits with status 4; Open MPI's launcher, which passes a {stop.signal_name} on and ends the "
            f"job itself, may return its own status (1): to go on, run the same command with --resume --run-dir "
            f"{run_dir}")


