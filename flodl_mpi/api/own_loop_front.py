"""The Averager as a front end of the one setup (`flodl_mpi.training.setup.FrontEnd`): your own loop.

Invariant: the own loop goes through the same setup as ``flodl-mpi train`` and ``fit``; what
differs is said here only: no data and no Trainer, the config record and train.log's header
name the own loop, and the save check and the per-rank resume are the averager's own
(`flodl_mpi.api.averager_checkpoint`).
"""

from __future__ import annotations

from flodl_mpi.api import averager_checkpoint
from flodl_mpi.training import scalars as _scalars

#: The loss of an own loop, as its records name it (metrics.h5 ``loss``).
OWN_LOOP_LOSS = "loss given to step()"

__all__ = ["OWN_LOOP_LOSS", "OwnLoop"]


class OwnLoop:
    """The ``Averager``'s pieces in the one setup (`flodl_mpi.training.setup.FrontEnd`): no data, no Trainer.

    The config record and train.log's header name the own loop; the consensus is adopted into
    the user's model (broadcast from rank 0 unless ``broadcast=False``); the save check and the
    per-rank resume are the averager's own.
    """

    run_dir_always = False
    remove_bad_new_run = False

    def __init__(self, avg, broadcast: bool, pin_staging: bool | None) -> None:
        self.avg, self.broadcast, self.pin_staging = avg, broadcast, pin_staging
        self.check_optimizer = avg.optimizer is not None

    def prepared(self, run) -> bool:
        avg = self.avg
        avg.run_dir, avg._train_log = run.run_dir, run.train_log
        return True

    def record(self, run) -> dict:
        from flodl_mpi.api.run_record import OWN_LOOP_OPTIONS, api_config

        avg = self.avg
        # What is true of an own loop: its model and optimizer as built, no planned epochs.
        config = api_config(run.cfg.to_dict(), "Averager", loss=OWN_LOOP_LOSS, model=avg.model,
                            optimizer=avg.optimizer, applies=OWN_LOOP_OPTIONS)
        run.attrs.update(config=config, loss=OWN_LOOP_LOSS, data_source="(your training loop)")
        return config

    def opened(self, run) -> None:
        self.avg._writer = run.writer

    def attach(self, run) -> None:
        avg = self.avg
        avg.cfg, avg.replica, avg.bridge = run.cfg, run.replica, run.bridge
        if avg._train_log is not None:
            avg._header(run.attrs["devices"])
        avg._new_epoch()
        avg._book = _scalars.ScalarBook()
        #: Where your loop goes on (see the class docstring): epochs done, and step() calls of the next one done.
        avg.start_epoch, avg.start_step = 0, 0
        avg._skip = 0  # batches() calls left to skip: start_step, once
        avg._carried_ms = 0.0

    def check_saveable(self, run) -> None:
        averager_checkpoint.check_saveable(self.avg)

    def resume(self, run) -> None:
        avg = self.avg
        avg._carried_ms = averager_checkpoint.resume(avg, run.ckpt)

    def resumed(self, run) -> None:
        avg = self.avg
        avg.start_epoch, avg.start_step, avg._skip = avg.epoch, avg._epoch_calls, avg._epoch_calls
        averager_checkpoint.say_resumed(avg, run.ckpt)

    def ready(self, run) -> None:
        pass
