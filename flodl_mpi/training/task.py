"""What one training step and one evaluation are: the trainer's injection point.

Invariant: the trainer (``worker.Trainer``) owns the loop, the windows, the rounds
and the epoch exchange; a task owns only what the user may change — the
optimizer it builds, the loss of a batch, how a step is taken (learning rate,
clipping), what is evaluated at the epoch's end. :class:`ClassificationTask` is
``flodl-mpi train``'s behaviour; the Python API (:mod:`flodl_mpi.api.fit`) builds a
:class:`UserTask` from the user's callables. No MPI here.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from flodl_mpi.config import TrainConfig
from flodl_mpi.training.data import Split
from flodl_mpi.training.lr_schedule import decay_factor, learning_rate_factor

__all__ = ["ClassificationTask", "UserTask", "evaluate", "learning_rate_factor", "make_optimizer"]


def make_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    """The inner optimizer named by ``cfg.optimizer`` (one of ``OPTIMIZERS``).

    Raises:
        ValueError: ``cfg.optimizer`` records another class (``module:Class``: a factory's, built by its task).
    """
    if cfg.optimizer not in ("sgd", "adam", "adamw"):
        raise ValueError(f"optimizer {cfg.optimizer!r} is built by the optimizer factory given to flodl_mpi.fit")
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                               weight_decay=cfg.weight_decay_value)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay_value)
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay_value)


@torch.no_grad()
def evaluate(model: nn.Module, split: Split, rank: int, world_size: int, device: torch.device,
             batch_size: int) -> tuple[float, int, int]:
    """Evaluate this rank's contiguous slice of ``split`` (eval mode).

    Returns:
        ``(loss_sum, correct, count)`` — summed cross-entropy over the slice,
        correct top-1 predictions and labels (samples; positions for per-position
        labels ``(N, T)``, so the test loss is per token); the epoch exchange sums
        them over ranks, so the cohort covers the whole split exactly once.
    """
    lo, hi = (split.n * rank) // world_size, (split.n * (rank + 1)) // world_size
    was_training = model.training
    model.eval()
    loss_sum, correct = 0.0, 0
    for start in range(lo, hi, batch_size):
        x = torch.from_numpy(split.x[start : min(start + batch_size, hi)]).to(device)
        y = torch.from_numpy(split.y[start : min(start + batch_size, hi)]).to(device)
        logits = model(x)
        loss_sum += float(nn.functional.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(dim=1) == y).sum())
    model.train(was_training)
    return loss_sum, correct, (hi - lo) * math.prod(split.y.shape[1:])


class ClassificationTask:
    """``flodl-mpi train``'s task: cross-entropy on class labels, test loss and accuracy, the config's optimizer.

    Args:
        cfg: the run's ``TrainConfig`` (``scale_lr``, ``warmup_steps``, ``lr_schedule``, ``clip_grad_norm``);
            None: none of them.
        world_size: ranks in the run (the linear scaling rule's factor).
        schedule: ``cohort_step -> factor`` on the initial learning rate (:func:`flodl_mpi.fit`'s
            ``lr_schedule``), or None: the config's named schedule, bound to the run's length by
            :meth:`set_total_steps` (`flodl_mpi.training.lr_schedule.decay_factor`).
    """

    #: The cohort asked for a checkpoint at this epoch's boundary (never, from the CLI).
    checkpoint_now = False

    def __init__(self, cfg=None, world_size: int = 1, schedule: Callable[[int], float] | None = None) -> None:
        self.world_size, self.schedule = world_size, schedule
        self.scale_lr = bool(getattr(cfg, "scale_lr", False))
        self.warmup_steps = int(getattr(cfg, "warmup_steps", 0))
        self.clip_grad_norm = getattr(cfg, "clip_grad_norm", None)
        self._cfg = cfg

    def set_total_steps(self, total_steps: int) -> None:
        """Bind the config's named schedule (``--lr-schedule``) to the run's ``total_steps`` cohort steps
        (``epochs × steps per epoch``); a schedule given as a callable, and ``constant``, need none.

        Raises:
            ValueError: ``cosine`` or ``linear`` with a warm-up as long as the run (no step to decay over).
        """
        name = getattr(self._cfg, "lr_schedule", "constant")
        if self.schedule is not None or name == "constant":
            return
        cfg, warmup = self._cfg, self.warmup_steps
        if name in ("cosine", "linear") and warmup >= total_steps:
            raise ValueError(f"--warmup-steps {warmup} covers the whole run ({total_steps} cohort steps: --epochs "
                             f"{cfg.epochs} x {total_steps // cfg.epochs} steps), leaving --lr-schedule {name} "
                             "nothing to decay over; lower --warmup-steps or raise --epochs")
        step_size, gamma = cfg.lr_step_size, cfg.lr_gamma_value
        self.schedule = lambda step: decay_factor(name, step, total_steps, warmup, step_size, gamma)

    def make_optimizer(self, cfg, model: nn.Module) -> torch.optim.Optimizer:
        return self._keep_initial_lr(make_optimizer(cfg, model))

    @staticmethod
    def _keep_initial_lr(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        for group in opt.param_groups:  # what the factor multiplies (as torch's LR schedulers keep it)
            group.setdefault("initial_lr", group["lr"])
        return opt

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], cohort_step: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer, cohort_step: int,
             scaler: torch.amp.GradScaler | None = None) -> bool:
        """The learning rate of this cohort step, clipping, then ``optimizer.step()``.

        With ``scaler`` (``--amp fp16``) the gradients are unscaled before clipping and the
        step is the scaler's, skipped when they hold Inf/NaN (torch.amp.GradScaler; its
        scale then backs off: a lower scale after ``update()`` is how a skip shows).

        Returns:
            Whether the optimizer stepped (False: the scaler skipped it).
        """
        if self.schedule is not None or self.warmup_steps > 0 or (self.scale_lr and self.world_size > 1):
            f = learning_rate_factor(cohort_step, self.world_size, self.scale_lr, self.warmup_steps, self.schedule)
            for group in optimizer.param_groups:  # (a checkpoint from before may lack initial_lr)
                group["lr"] = group.setdefault("initial_lr", group["lr"]) * f
        if scaler is None:
            if self.clip_grad_norm is not None:
                nn.utils.clip_grad_norm_(model.parameters(), self.clip_grad_norm)
            optimizer.step()
            return True
        if self.clip_grad_norm is not None:
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), self.clip_grad_norm)
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        return scaler.get_scale() >= before

    #: The worker calls `end_epoch` every epoch (True), or only on the epochs it tests (False).
    boundary_every_epoch = False

    def evaluate_val(self, trainer, split: Split) -> tuple[float, float, int]:
        """``(val loss sum, correct, count)`` of this rank's slice of the validation set (see `evaluate`)."""
        return evaluate(trainer.replica.model, split, trainer.rank, trainer.world_size, trainer.replica.device,
                        trainer.cfg.eval_batch_size)

    def end_epoch(self, trainer, epoch: int, report, test: bool = True) -> tuple[float, int, int]:
        """``(test loss sum, correct, count)`` of this rank's slice of the test set (see `evaluate`).

        ``test``: the worker's decision to test this epoch (always True here: called only then).
        """
        return evaluate(trainer.replica.model, trainer.data.test, trainer.rank, trainer.world_size,
                        trainer.replica.device, trainer.cfg.eval_batch_size)

    def after_epoch(self, trainer, summary) -> None:
        """Called on every rank after the epoch exchange, before the checkpoint decision."""

    def stopped_epoch_meta(self) -> dict:
        """Meta a mid-epoch checkpoint adds for the task's own epoch state (the CLI's: none)."""
        return {}

    def epoch_words(self) -> str:
        """Extra words for the epoch's log line (the test loss and accuracy are the worker's)."""
        return ""


class UserTask(ClassificationTask):
    """The Python API's task, from the user's callables (see :func:`flodl_mpi.fit`).

    Args:
        train_step: ``(model, batch) -> loss`` or ``-> (loss, {name: value})``;
            ``batch`` is ``(x, y)`` on the device. Extra values are recorded as scalars.
        optimizer_factory: ``parameters -> Optimizer``, or None for the config's.
        boundary: ``(trainer, epoch, report) -> (loss_sum, correct, count)`` and
            ``after_epoch(trainer, summary)``: the API's epoch boundary.
        record: ``(name, value)`` for the train step's extra scalars.
        cfg, world_size, schedule: as :class:`ClassificationTask`.
    """

    def __init__(self, train_step, optimizer_factory, boundary, record, cfg, world_size: int,
                 schedule=None) -> None:
        super().__init__(cfg, world_size, schedule)
        self.train_step, self.optimizer_factory, self.boundary, self.record = (train_step, optimizer_factory,
                                                                                 boundary, record)

    @property
    def checkpoint_now(self) -> bool:
        return self.boundary.checkpoint_now

    def make_optimizer(self, cfg, model: nn.Module) -> torch.optim.Optimizer:
        opt = super().make_optimizer(cfg, model) if self.optimizer_factory is None \
            else self.optimizer_factory(model.parameters())
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"optimizer factory returned {type(opt).__name__}, not a torch.optim.Optimizer")
        return self._keep_initial_lr(opt)

    def loss(self, model, batch, cohort_step):
        out = self.train_step(model, batch)
        if isinstance(out, tuple):
            out, extra = out
            for name, value in dict(extra).items():
                self.record(name, value)
        if not isinstance(out, torch.Tensor) or out.numel() != 1 or not out.requires_grad:
            got = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
            raise TypeError(f"train_step must return the batch's loss as a one-element tensor that requires grad "
                            f"(or (loss, {{name: value}})), got {got}")
        return out.reshape(())

    #: The API's boundary exchanges the scalars and intents at every epoch's end, tested or not.
    boundary_every_epoch = True

    def evaluate_val(self, trainer, split):
        """The validation set through ``eval_fn`` (its ``loss`` and ``accuracy``; see ``_Boundary``)."""
        return self.boundary.evaluate_val(trainer, split)

    def end_epoch(self, trainer, epoch, report, test=True):
        return self.boundary.end_epoch(trainer, epoch, report, test)

    def after_epoch(self, trainer, summary) -> None:
        self.boundary.after_epoch(trainer, summary)

    def stopped_epoch_meta(self) -> dict:
        """A mid-epoch checkpoint's meta of the API's epoch state: the scalar books (``_Boundary``)."""
        return self.boundary.stopped_epoch_meta(self.world_size)

    def epoch_words(self) -> str:
        """The user's evaluation metrics of the epoch (``loss`` and ``accuracy`` are in the line already)."""
        latest = self.boundary.latest
        metrics = latest.metrics if latest is not None else {}
        return "".join(f"  test_{k} {v:.4f}" for k, v in metrics.items() if k not in ("loss", "accuracy"))
