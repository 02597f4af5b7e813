"""The trainer API: your model, optimizer, train step and data; flodl_mpi's loop, averaging and outputs.

Invariant: :func:`fit` builds the same objects ``flodl-mpi train`` does, through the
same setup (`flodl_mpi.training.setup.setup_rank` with a ``TrainerFront``) — a
``replica.Replica``, a ``bridge.Bridge``, rank 0's ``metrics.MetricsWriter`` and a
``worker.Trainer`` — and injects the user's callables through a
:class:`flodl_mpi.training.task.UserTask`; every decision at an epoch boundary (evaluate?
checkpoint?) is taken from gathered values, so every rank acts alike.

    python fit.py                   # a world of 1
    mpiexec -n 4 python fit.py      # four ranks, averaged
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import math
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from flodl_mpi.training import scalars as _scalars
from flodl_mpi.api.epoch_result import EpochResult
from flodl_mpi.config import TrainConfig, check_fit_arguments
from flodl_mpi.training.task import UserTask

__all__ = ["Run", "fit"]

log = logging.getLogger("flodl_mpi")


# ---------------------------------------------------------------- defaults: the CLI's task, and regression

def default_train_step(model: nn.Module, batch) -> torch.Tensor:
    """Cross-entropy for integer class labels, mean squared error for float targets."""
    x, y = batch
    out = model(x)
    if y.dtype in (torch.int64, torch.int32):
        return nn.functional.cross_entropy(out, y)
    return nn.functional.mse_loss(out.reshape(y.shape), y)


def default_eval(train_step: Callable) -> Callable:
    """The default evaluation: the train step's loss, and accuracy for class labels.

    Weighted by the labels in the batch: samples, or positions for per-position
    labels ``(N, T)`` (a sequence task: the loss and accuracy are per token).
    """

    def eval_fn(model: nn.Module, batch) -> dict[str, tuple[float, int]]:
        x, y = batch
        n = int(y.numel()) if y.dtype == torch.int64 else int(x.shape[0])
        loss = train_step(model, batch)
        loss = loss[0] if isinstance(loss, tuple) else loss
        out = {"loss": (float(loss) * n, n)}
        if y.dtype == torch.int64 and y.ndim in (1, 2):
            logits = model(x)
            if logits.ndim == y.ndim + 1:
                out["accuracy"] = (float((logits.argmax(dim=1) == y).sum()), n)
        return out

    return eval_fn


# ---------------------------------------------------------------- the epoch boundary of the API

class _Boundary:
    """Runs at each epoch's end on every rank: intents and scalars, evaluation, rows of metrics.h5."""

    def __init__(self, book: _scalars.ScalarBook, eval_fn: Callable, eval_every: int, epochs: int,
                 eval_batch_size: int) -> None:
        self.book, self.eval_fn, self.eval_every, self.epochs = book, eval_fn, eval_every, epochs
        self.eval_batch_size = eval_batch_size
        self.checkpoint_now = False
        self.latest: EpochResult | None = None
        self._pending: tuple | None = None
        self._val_sums: dict | None = None  # this epoch's validation sums, pooled at end_epoch

    def evaluate_val(self, trainer, split) -> tuple[float, float, int]:
        """This rank's slice of the validation set through ``eval_fn``: ``(loss sum, correct, count)``.

        ``correct`` is the ``accuracy`` sum (NaN when ``eval_fn`` gives none, as for a regression);
        the sums of every name are kept and pooled at `end_epoch` (``val_<name>`` metrics).
        """
        self._val_sums = self._evaluate(trainer, split)
        return _loss_correct(self._val_sums)

    def end_epoch(self, trainer, epoch: int, report, test: bool = True) -> tuple[float, int, int]:
        """The epoch's boundary on every rank: one exchange of scalars and intents, then the test set.

        ``test``: the worker's decision (gathered values: alike on every rank). Without a
        validation set the test set is evaluated on ``eval_every``'s epochs and the last; with
        one, on the worker's epochs (the last, one that may stop early, ``test_every_epoch``).
        A requested ``"eval"`` evaluates it either way.
        """
        # -- one allgather: every rank's scalars, batches and intents (decides the rest alike)
        b = _scalars.exchange(trainer.bridge.allgather, self.book, report.batches)
        if trainer.data.val is None:
            scheduled = epoch + 1 == self.epochs or (self.eval_every > 0 and (epoch + 1) % self.eval_every == 0)
        else:
            scheduled = test
        val_sums, self._val_sums = self._val_sums, None
        metrics, counts, sums = {}, {}, {}
        if scheduled or "eval" in b.intents or val_sums is not None:
            sums = self._evaluate(trainer, trainer.data.test) if scheduled or "eval" in b.intents else {}
            gathered = trainer.bridge.allgather((sums, val_sums or {}))  # the same on every rank
            totals = _scalars.pool_metrics([t for t, _ in gathered])
            if val_sums is not None:
                totals.update({f"val_{k}": v for k, v in _scalars.pool_metrics([v for _, v in gathered]).items()})
            metrics, counts = {k: v for k, (v, _) in totals.items()}, {k: c for k, (_, c) in totals.items()}
        self.checkpoint_now = "checkpoint" in b.intents
        self._pending = (b, metrics, counts)
        return _loss_correct(sums)

    @torch.no_grad()
    def _evaluate(self, trainer, split) -> dict[str, tuple[float, float]]:
        """This rank's contiguous slice of ``split``, in eval mode: ``{name: (sum, count)}``."""
        rank, W, device = trainer.rank, trainer.world_size, trainer.replica.device
        model = trainer.replica.model
        lo, hi = (split.n * rank) // W, (split.n * (rank + 1)) // W
        was_training = model.training
        model.eval()
        total: dict[str, list[float]] = {}
        # The default eval calls the train step: what it records is not training's (dropped).
        _scalars.activate(_scalars.ScalarBook())
        try:
            for start in range(lo, hi, self.eval_batch_size):
                end = min(start + self.eval_batch_size, hi)
                batch = (torch.from_numpy(split.x[start:end]).to(device),
                         torch.from_numpy(split.y[start:end]).to(device))
                for name, pair in _check_eval(self.eval_fn(model, batch)).items():
                    acc = total.setdefault(name, [0.0, 0.0])
                    acc[0] += pair[0]
                    acc[1] += pair[1]
        finally:
            model.train(was_training)
            _scalars.activate(self.book)
        return {k: (s, c) for k, (s, c) in total.items()}

    def after_epoch(self, trainer, summary) -> None:
        b, metrics, counts = self._pending
        epoch = summary.epoch + 1
        if trainer.writer.writes:  # rank 0 with a run dir: the scalars table
            rows = _scalars.scalar_rows(epoch, {**b.scalars, **{f"eval/{k}": v for k, v in metrics.items()}},
                                        {**b.counts, **{f"eval/{k}": int(c) for k, c in counts.items()}},
                                        b.per_rank, trainer.world_size)
            if rows is not None:
                trainer.writer.append("scalars", rows)
        self.latest = EpochResult(epoch, summary, dict(b.scalars), metrics, b.intents)

    def stopped_epoch_meta(self, world_size: int) -> dict:
        """What a checkpoint of an epoch a stop cut short keeps of it: every rank's scalar book.

        ``epoch_scalars``: per rank, ``{name: [sum, count]}`` of :func:`flodl_mpi.record_scalar`
        so far in the epoch; ``epoch_intents``: per rank, the intents it raised (as exchanged at
        the stop's boundary, so the same on every rank). The resume puts them back
        (:meth:`resume_scalars`), and the resumed epoch's ``scalars`` row covers all its batches.
        """
        b = self._pending[0] if self._pending is not None else None
        books = b.books if b is not None and len(b.books) == world_size else [{}] * world_size
        asked = b.asked_by if b is not None else {}
        return {"epoch_scalars": [{k: [float(s), int(c)] for k, (s, c) in book.items()} for book in books],
                "epoch_intents": [[i for i, ranks in asked.items() if r in ranks] for r in range(world_size)]}

    def resume_scalars(self, meta: Mapping, rank: int, world_size: int) -> bool:
        """Put back this rank's share of a stopped epoch's scalar books (``meta`` of a mid-epoch checkpoint).

        Another world size: rank r takes the books of old ranks ``r' ≡ r (mod W)`` summed,
        as the epoch's reports (`worker.Trainer.resume`). Returns False when the
        checkpoint holds none (written before they were kept): the epoch's scalars restart.
        """
        books = meta.get("epoch_scalars")
        if not isinstance(books, list):
            return False
        intents = meta.get("epoch_intents") or [[] for _ in books]
        for old in range(len(books)):
            if old % world_size == rank:
                self.book.restore({k: (s, c) for k, (s, c) in books[old].items()}, intents[old])
        return True


def _close_rows(data) -> None:
    """Close the features fit() read on demand (streamed files, a torch Dataset's loader workers): idempotent."""
    for split in (data.train, data.test, data.val):
        close = getattr(getattr(split, "x", None), "close", None)
        if close is not None:
            with contextlib.suppress(Exception):
                close()


def _loss_correct(sums: Mapping) -> tuple[float, float, int]:
    """``(loss sum, correct, count)`` of a rank's evaluation sums; ``correct`` NaN without ``accuracy``."""
    loss_sum, n = sums.get("loss", (0.0, 0))
    # No accuracy measured (a regression, a user metric set without it): NaN, not 0 correct.
    correct = round(sums["accuracy"][0]) if "accuracy" in sums and sums["accuracy"][1] == n else float("nan")
    return float(loss_sum), correct, int(n)


def _check_eval(out) -> dict[str, tuple[float, float]]:
    if not isinstance(out, Mapping):
        raise TypeError(f"eval_fn must return a dict {{name: (sum, count)}}, got {type(out).__name__}")
    checked = {}
    for name, pair in out.items():
        try:
            s, c = pair
            checked[str(name)] = (float(s), float(c))
        except (TypeError, ValueError):
            raise TypeError(f"eval_fn: {name!r} must be a (sum, count) pair of numbers, got {pair!r}") from None
    return checked


# ---------------------------------------------------------------- the handle

class Run:
    """A training run of :func:`fit`: iterate it for the epochs, or :meth:`wait` for all of them.

    Each epoch trains when the iteration asks for it; every rank gets the same
    :class:`flodl_mpi.EpochResult` (cohort-wide metrics: ``summary.avg_loss``,
    ``metrics`` of the evaluation, ``scalars`` of :func:`flodl_mpi.record_scalar`,
    ``intents``), so a decision taken on it (an early stop: ``break``) is the
    same on every rank. Leaving the iteration early, or reaching the end,
    finishes the run: last checkpoint (with a ``run_dir``), files closed.

    Collective contract: every rank iterates the same number of epochs (break on
    cohort-wide values only) and calls :meth:`close` / :meth:`wait` alike.

    Attributes:
        model: the rank's model; after the last epoch, the cohort's consensus.
        optimizer: this rank's optimizer.
        history: the :class:`EpochResult` of every epoch trained so far.
        run_dir: where ``metrics.h5`` and ``checkpoints/`` are written (None: no files).
        rank, world_size: this rank's place (a world of 1 under plain ``python``).
        done: every epoch was trained.
        stopped: a stop signal (SIGUSR1, SIGTERM, Ctrl-C) ended the run early.

    Stop signals: as ``flodl-mpi train``, a signal on any rank stops every rank
    after the same round; the checkpoint is saved (with a ``run_dir``), the run
    is closed, and the iteration (or :meth:`wait`) raises
    :class:`flodl_mpi.Stopped`, a ``SystemExit`` with code 4: uncaught, the
    script exits with status 4 (resume with ``resume=True``). An epoch the stop
    cut short is never yielded: the iteration raises at once, and the resumed
    run yields that epoch whole (its reports and ``record_scalar`` books are in
    the checkpoint).
    """

    def __init__(self, session, trainer, boundary: _Boundary, writer, run_dir: Path | None) -> None:
        self._session, self._trainer, self._boundary, self._writer = session, trainer, boundary, writer
        self.model = trainer.replica.model
        self.optimizer = trainer.optimizer
        self.run_dir = run_dir
        self.rank, self.world_size = trainer.rank, trainer.world_size
        self.history: list[EpochResult] = []
        self.done = False
        self.stopped = False
        self._epochs = trainer.iter_epochs()
        self._closed = False

    def __iter__(self) -> Iterator[EpochResult]:
        try:
            for _ in self._epochs:
                if not self._trainer._epoch_complete:
                    # A stop cut the epoch short (its cursor, the same on every rank): not an
                    # epoch's result; the checkpoint is saved and the iteration ends, Stopped below.
                    continue
                result = self._boundary.latest
                self.history.append(result)
                yield result
        except GeneratorExit:  # the caller left the loop (the same epoch on every rank)
            self.close()
            raise
        except BaseException as exc:
            self._fail(exc)
            from flodl_mpi.runtime.session import api_words

            if api_words(exc) is not exc:  # a cohort error naming the CLI's flags (--on-non-finite stop)
                raise api_words(exc) from exc.__cause__
            raise
        self.close()
        if not self._trainer.done:  # a stop round ended the epochs (gathered: every rank alike)
            self._stopped()

    def _stopped(self) -> None:
        import sys

        from flodl_mpi.errors import Stopped

        stop, version = self._trainer.stop, self._trainer.bridge.version
        self.stopped = True
        if self.rank == 0:
            where = (f"checkpoint saved in {self.run_dir / 'checkpoints'}; run the same script with resume=True "
                     "to go on" if self.run_dir is not None else "no run_dir: nothing was saved")
            print(f"flodl-mpi: stopped on request ({stop.signal_name or 'a stop signal'}) after round {version}; "
                  f"{where}; exit status 4", file=sys.stderr, flush=True)
        raise Stopped(stop.signal_name, version)

    def wait(self) -> list[EpochResult]:
        """Train the remaining epochs and finish; returns :attr:`history`. Collective."""
        for _ in self:
            pass
        return self.history

    def request_eval(self) -> None:
        """Evaluate at the next epoch boundary, on every rank (this rank may be the only one asking)."""
        self._boundary.book.request("eval")

    def request_checkpoint(self) -> None:
        """Save a checkpoint at the next epoch boundary, for the whole cohort (any rank may ask)."""
        self._boundary.book.request("checkpoint")

    @property
    def last_eval(self) -> tuple[int, dict[str, float]] | None:
        """``(epoch, {name: value})`` of the latest cohort evaluation (the same on every rank), or None yet."""
        for result in reversed(self.history):
            if result.metrics:
                return result.epoch, dict(result.metrics)
        return None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict (the consensus once the run is finished)."""
        return self.model.state_dict()

    def close(self) -> None:
        """Finish: the last epoch's checkpoint was saved by the loop; stop the bridge, close the files.

        Collective (every rank, once; idempotent). Leaving early saves no extra checkpoint.
        """
        if self._closed:
            return
        self._closed = True
        self.done = bool(getattr(self._trainer, "done", False)) and len(self.history) > 0 and \
            self.history[-1].epoch == self._trainer.cfg.epochs
        _scalars.activate(None)
        self._trainer.bridge.close()
        _close_rows(self._trainer.data)
        if self._writer.writes:  # rank 0 with a run dir: the final save, train.log's last line, the lock
            self._writer.close(timeout=None)
            from flodl_mpi.training.train import final_line

            t = self._trainer  # train.log's last line, as the CLI's
            log.info(final_line(t.cfg, self.done, t.history, t.start_epoch, self.run_dir,
                                self.last_eval[1] if self.last_eval else None,
                                f"to go on, call fit() again with resume=True, run_dir={str(self.run_dir)!r}"))
            from flodl_mpi.training.train_log import close_train_log

            close_train_log(getattr(self, "_train_log", None))
            from flodl_mpi.outputs import run_dir_lock

            run_dir_lock.release(self.run_dir)  # the run is over: the directory is free for the next one
        self._session.close()

    def _fail(self, exc: BaseException) -> None:
        from flodl_mpi.runtime.session import leave_on_error, leaves_together

        self._closed = True
        _scalars.activate(None)
        if leaves_together(self._session, exc):  # the one abort decision (flodl_mpi.runtime.world.decide)
            with contextlib.suppress(Exception):
                self._trainer.bridge.close()
            with contextlib.suppress(Exception):
                self._writer.close(timeout=10.0)
        leave_on_error(self._session, exc)

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None:
            self.close()
        elif not self._closed:
            self._fail(exc)
        return False


# ---------------------------------------------------------------- train()

def _call_factory(factory: Callable, offered: dict) -> nn.Module:
    """``factory`` called with those of ``offered``'s keywords its signature accepts."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return factory(**offered)
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return factory(**offered)
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return factory(**{k: v for k, v in offered.items() if k in names})


def _scalar_rows_before(path: Path, epochs_done: int) -> int:
    """Rows of the ``scalars`` table that a resume keeps: those of the epochs the checkpoint completed.

    Rows are appended epoch by epoch, so they are a prefix; the checkpoint's
    ``metrics_rows`` (written by ``worker.Trainer``) does not count this table.
    """
    from flodl_mpi.outputs.metrics import read_table

    try:
        epochs = read_table(path, "scalars")["epoch"]
    except (KeyError, OSError):  # no file, or one from before the table existed
        return 0
    return int((epochs <= epochs_done).sum())


def _warn(line: str, verbose: bool, header: bool) -> None:
    """Rank 0's warning of :func:`fit` before training: on stdout with the CLI's lines (``verbose``),
    else on stderr. ``header``: train.log's header (`flodl_mpi.training.train.log_header`) logs it too."""
    if not verbose:
        import sys

        print(f"flodl-mpi: {line}", file=sys.stderr, flush=True)
    elif not header:
        log.warning(line)


def _describe(obj) -> str | None:
    if obj is None:
        return None
    if isinstance(obj, (str, os.PathLike)):
        return str(obj)
    return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def _record(cfg: TrainConfig, a: dict, data, model: nn.Module, optimizer) -> dict:
    """config.json of a :func:`fit` run (`flodl_mpi.api.run_record`): the model, optimizer and loss as built.

    ``optimizer``: the run's optimizer as the trainer builds it (a throwaway, no
    state; None when the factory failed: the trainer reports that on every rank).
    """
    from flodl_mpi.api.run_record import api_config
    from flodl_mpi.policy.registry import get as policy_spec

    if a["train_step"] is not None:
        loss = f"train_step {_describe(a['train_step'])}"
    else:
        loss = "cross-entropy" if data.train.y.dtype.kind in "iu" else "mean squared error"
    off = set()
    if callable(a["optimizer"]):  # the factory's param groups hold the run's hyperparameters
        off |= {"lr", "momentum", "weight_decay"}
    elif cfg.optimizer != "sgd":
        off.add("momentum")
    if not isinstance(a["data"], (str, os.PathLike)):
        off |= {"train_x", "train_y", "test_x", "test_y"}
    off |= {"anchor", "max_anchor", "overhead_target", "divergence_guard", "easgd_alpha"} - policy_spec(cfg.policy).options
    if cfg.outer == "avg":
        off |= {"outer_lr", "outer_momentum", "outer_reset_inner"}
    return api_config(cfg.to_dict(), "fit", loss=loss, model=model, optimizer=optimizer, not_applicable=off)


def _probe_optimizer(cfg: TrainConfig, task: UserTask, model: nn.Module):
    """The run's optimizer as the trainer will build it, a throwaway over ``model``'s parameters (no state).

    None when the factory fails: the trainer builds it next on every rank, and fails there alike.
    """
    try:
        return task.make_optimizer(cfg, model)
    except Exception:  # noqa: BLE001 - reported by the trainer, on every rank
        return None


def _as_built(cfg: TrainConfig, opt) -> TrainConfig:
    """``cfg`` with the optimizer a factory built, ``opt`` (None: no factory, ``cfg`` unchanged).

    ``lr``, ``weight_decay`` and ``momentum`` (SGD's, RMSprop's) from
    ``param_groups[0]``, and ``optimizer`` from its class: ``sgd``, ``adam``,
    ``adamw`` for those, else ``module:Class`` (RMSprop: ``torch.optim.rmsprop:RMSprop``);
    so train.log, metrics.h5's attributes and the checkpoints' config tell the
    optimizer and rates the run used, a resume sets those same rates and
    checks that class. A value the config would refuse (a learning rate of 0,
    a tensor) keeps the config's.
    """
    if opt is None:
        return cfg
    from flodl_mpi.api.run_record import optimizer_name

    group = opt.param_groups[0]
    changes = {}
    for name in ("lr", "weight_decay", "momentum"):
        v = group.get(name)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) \
                and (v > 0 if name == "lr" else v >= 0):
            changes[name] = float(v)
    changes["optimizer"] = optimizer_name(opt)
    return dataclasses.replace(cfg, **changes)


def _source(data) -> str:
    """config.json's ``data`` of in-memory data: ``"in-memory arrays"``, or names the torch Datasets."""
    from flodl_mpi.training.torch_rows import is_map_dataset

    parts = data.values() if isinstance(data, Mapping) else data if isinstance(data, (tuple, list)) else ()
    kinds = sorted({type(p).__name__ for p in parts if is_map_dataset(p)})
    return f"torch Dataset ({', '.join(kinds)})" if kinds else "in-memory arrays"


def _check_loader(num_workers, pin_memory) -> None:
    if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 0:
        raise ValueError(f"num_workers={num_workers!r}: must be an integer >= 0 (DataLoader worker processes)")
    if not isinstance(pin_memory, bool):
        raise ValueError(f"pin_memory={pin_memory!r}: must be True or False")


def _split_of(part, name: str, num_workers: int, pin_memory: bool):
    """``(x, y)`` of one split: an array pair as given, or a map-style torch Dataset's rows and labels."""
    from flodl_mpi.training.torch_rows import DatasetRows, dataset_labels, is_map_dataset

    if not is_map_dataset(part):
        return part
    return DatasetRows(part, name, num_workers, pin_memory), dataset_labels(part, name, num_workers)


def _load(data, names, cfg, num_workers: int = 0, pin_memory: bool = False, ranks_per_host: int = 1):
    from flodl_mpi.training.data import DEFAULT_NAMES, DataError, dataset_from_arrays, load_dataset, with_val

    if isinstance(data, (str, os.PathLike)):
        return load_dataset(data, {**DEFAULT_NAMES, **(names or {})}, targets="any", loading=cfg.data_loading,
                            ranks_per_host=ranks_per_host)
    if isinstance(data, Mapping):
        if not {"train", "test"} <= set(data) <= {"train", "val", "test"}:
            raise DataError(f"data as a dict needs the keys 'train' and 'test' (and 'val', a validation split), "
                            f"got {sorted(data)}")
        parts = {k: _split_of(v, k, num_workers, pin_memory) for k, v in data.items()}
        out = dataset_from_arrays(parts["train"], parts["test"], _source(data))
        if "val" not in parts:
            return out
        if not isinstance(parts["val"], (tuple, list)) or len(parts["val"]) != 2:
            raise DataError(f"val must be an (x, y) pair of arrays or a torch Dataset, got {type(data['val']).__name__}")
        return with_val(out, *parts["val"], {"val_x": "val x", "val_y": "val y"})
    if isinstance(data, (tuple, list)) and len(data) == 2:
        return dataset_from_arrays(_split_of(data[0], "train", num_workers, pin_memory),
                                   _split_of(data[1], "test", num_workers, pin_memory), _source(data))
    raise TypeError("data must be an HDF5 file path, {'train': ..., 'test': ..., 'val': ...} or (train, test), each "
                    f"an (x, y) pair of arrays or a map-style torch Dataset; got {type(data).__name__}")


def fit(model: Callable[..., nn.Module] | nn.Module | None = None,
          optimizer: Callable[..., torch.optim.Optimizer] | str | None = None, *,
          train_step: Callable | None = None, eval_fn: Callable | None = None, data=None, task: str | None = None,
          names: Mapping[str, str] | None = None, batch_size: int = 32, epochs: int = 10, lr: float = 1e-3,
          policy: str = "sync", window: int = 1, gamma: float = 1.0, seed: int = 0, drop_last: bool = False,
          lr_schedule: Callable[[int], float] | str | None = None, scale_lr: bool = False, warmup_steps: int = 0,
          clip_grad_norm: float | None = None, eval_every: int = 1, eval_batch_size: int = 1024,
          run_dir: str | os.PathLike | None = None, resume: bool | str = False, checkpoint_every: int = 1,
          keep_checkpoints: int = 3, device: str = "auto", threads: int | None = None,
          stall_timeout: float = 600.0, on_non_finite: str = "quarantine", chunk_elems: int = 1 << 18,
          num_workers: int = 0, pin_memory: bool = False, verbose: bool = False, comm=None, **options) -> Run:
    """Train with flodl_mpi's loop and averaging on your model, optimizer, step and data; returns a :class:`Run`.

    The same script runs under ``python`` (a world of 1) and ``mpiexec -n N``.
    Each epoch's global batches (``batch_size`` samples each, **per rank**)
    are shared among the ranks; each round averages the replicas weighted by
    their steps (SPEC §1-2). The effective batch of a round is ``batch_size ×
    world size``: to train like one process at ``lr``, raise the learning rate
    (``scale_lr=True``: the linear scaling rule, with ``warmup_steps``).

    Args:
        model: a factory called with those of ``input_shape`` (one sample's
            shape), ``num_classes`` (largest label + 1; 0 for float targets) and
            ``target_shape`` (one target's shape) it accepts, or an ``nn.Module``;
            None: the built-in MLP (classification). Every rank must build the
            same structure (checked); rank 0's initial values are broadcast.
        optimizer: ``parameters -> torch.optim.Optimizer`` (e.g.
            ``lambda p: torch.optim.AdamW(p, lr=3e-4)``), or ``"sgd"``, ``"adam"``,
            ``"adamw"`` at ``lr`` (and ``weight_decay=``; unset: the optimizer's own
            default, torch.optim's: 0.01 for AdamW, 0 for the others); None: Adam at ``lr``.
        train_step: ``(model, (x, y)) -> loss``, a one-element tensor (backward
            and the optimizer step are done for you), or ``(loss, {name: value})``
            to record extra scalars; default: cross-entropy for integer labels,
            MSE for float targets. Call :func:`flodl_mpi.record_scalar` in it freely.
        eval_fn: ``(model, (x, y)) -> {name: (sum, count)}`` over a test batch (eval
            mode, no grad); the cohort's metric is ``Σ sum / Σ count``. Default: the
            train step's loss, and ``accuracy`` for class labels.
        data: an HDF5 file (datasets ``train/x``, ``train/y``, ``test/x``, ``test/y``,
            renamed by ``names``; a ``val`` group, ``val/x`` and ``val/y``, is the validation
            set; read whole or streamed by ``data_loading=``, as ``--data-loading``),
            ``{"train": ..., "test": ...}`` (and ``"val": ...``, a validation set) or
            ``(train, test)``, each an ``(x, y)`` pair of arrays or tensors or a map-style
            ``torch.utils.data.Dataset`` of ``(x, y)`` items (each rank reads only its
            batches' items; see ``num_workers``); ``x`` numeric ``(N, ...)``, ``y`` integer
            labels (1-D, or per position ``(N, T)``: logits ``(batch, C, T)``) or float targets
            of any shape ``(N, ...)``; None: the built-in digits.
        task: ``"classification"`` (float labels that are whole numbers become
            int64 class labels), ``"regression"`` (integer labels become float
            targets), or None: from the targets' dtype, integer labels classify and
            float targets regress; float targets that look like class labels (whole
            numbers >= 0, at most 256 distinct) are refused without a ``task``, as
            ``flodl-mpi train`` refuses float labels.
        batch_size: samples per batch per rank, >= 1. epochs: >= 1. lr: > 0.
        policy, window, gamma: as ``flodl-mpi train --policy/--window/--gamma`` (``policy``: any
            policy in `flodl_mpi.policy.registry`, one registered by your script too).
        lr_schedule: ``cohort_step -> factor`` on each group's initial learning
            rate; the cohort step counts the cohort's optimizer steps (global
            steps), so the schedule is the one a single process would follow. Or
            the name of one of ``flodl-mpi train --lr-schedule``'s: ``"constant"``,
            ``"cosine"``, ``"linear"`` (over the run's steps after the warm-up),
            ``"step"`` (with ``lr_step_size=``, ``lr_gamma=``).
        scale_lr, warmup_steps: the linear scaling rule (lr × world size) and the
            linear warm-up over ``warmup_steps`` cohort steps, from lr (``scale_lr``:
            Goyal et al. 2017) or from 0 to the peak; the schedule multiplies it.
        amp, accumulate: as ``--amp`` (``"off"``, ``"bf16"``, ``"fp16"``: autocast of the
            train step and ``eval_fn``; fp16 with a GradScaler) and ``--accumulate``
            (micro-batches of ``batch_size`` per optimizer step), given in ``**options``.
        clip_grad_norm: clip each rank's gradient L2 norm before each step (None: off).
        eval_every: epochs between evaluations (the last epoch is always
            evaluated; 0: only on request and at the end).
        run_dir: a new or empty directory for ``config.json`` (the model, optimizer
            and loss as built: `flodl_mpi.api.run_record`), ``train.log``, ``metrics.h5``,
            ``checkpoints/`` (rank 0 writes, as the CLI); None: no files.
        resume: True: continue the run in ``run_dir`` from its newest checkpoint; a
            ``run_dir`` that does not exist or holds no checkpoint is refused
            (``InputError``, nothing in it touched). ``"auto"``: continue it, or start
            it when it holds none (a requeued job), saying so in one line.
        checkpoint_every: as the CLI's option; so are ``keep_checkpoints``, ``device``,
            ``threads``, ``stall_timeout``, ``on_non_finite``, ``chunk_elems``, ``seed``,
            ``drop_last`` and ``eval_batch_size``.
        num_workers, pin_memory: for a ``torch.utils.data.Dataset`` in ``data``: the
            ``DataLoader``'s worker processes (persistent over the run; 0: read in this
            process) reading the batches of the current and the next window ahead, and its
            ``pin_memory``. The items' features are cast to float32 as arrays are: the run is
            the one the same arrays give, bit for bit. The labels are read once at the start
            (the dataset's ``targets`` when it agrees with the first and last items, else a
            pass over the items).
        val_fraction, keep_best, early_stop, test_every_epoch: as ``--val-fraction``,
            ``--keep-best``, ``--early-stop``, ``--test-every-epoch`` (given in ``**options``);
            ``val_fraction`` beside the data's own validation set is refused. The validation
            numbers are ``eval_fn``'s on it (``loss``: ``val_loss``, ``accuracy``:
            ``val_accuracy``, each name ``val_<name>`` in the epoch's ``metrics``); with a
            validation set the test set is evaluated at the end (and on an epoch that may stop
            early, ``test_every_epoch``, or a request), not every ``eval_every`` epochs.
        verbose: rank 0 prints the CLI's lines (one per epoch) on stdout.
        comm: an mpi4py intracommunicator; None: the world.
        **options: any other ``flodl-mpi train`` option by its config name
            (``anchor``, ``easgd_alpha``, ``outer``, ``outer_lr``,
            ``average_optimizer_state``, ``node_reduce``, ``wire``, ...:
            ``TrainConfig``'s fields); an unknown name raises ``ValueError``
            (bad input, exit 2 under ``mpiexec``).

    Returns:
        :class:`Run`; nothing is trained until it is iterated (or :meth:`Run.wait`).

    Raises:
        flodl_mpi.errors.InputError: bad input on any rank (every rank raises it;
            exit status 2 when uncaught): a bad option, data, a model that fails
            its first training step, a run dir in use.
    """
    from flodl_mpi.runtime.session import api_words, leave_on_error, open_session

    session = open_session(comm, stall_timeout if isinstance(stall_timeout, (int, float)) and stall_timeout > 0
                           else 600.0)
    try:
        return _setup(session, locals())
    except BaseException as exc:
        leave_on_error(session, exc)
        if api_words(exc) is not exc:  # the CLI's flags named as the keywords
            raise api_words(exc) from exc.__cause__
        raise


def _setup(session, a: dict) -> Run:
    from flodl_mpi.runtime.launcher import settle_threads, thread_request
    from flodl_mpi.runtime.signals import StopRequest
    from flodl_mpi.runtime.world import agree
    from flodl_mpi.training.data import for_task
    from flodl_mpi.training.models import state_kept
    from flodl_mpi.training.setup import TrainerFront, load_data, start_trainer
    from flodl_mpi.training.train import load_replay_plan, pick_device
    from flodl_mpi.training.train_log import log_to_stdout
    from flodl_mpi.training.validation import settle_validation

    world, watchdog = session.world, session.watchdog
    comm = world.comm
    if a["verbose"]:
        log_to_stdout(world.rank, 0)  # rank 0 prints the CLI's lines (header, one per epoch)

    # -- options: one validated config, the CLI's; the API's own options checked here
    def config() -> TrainConfig:
        opt = a["optimizer"]
        check_fit_arguments(train_step=a["train_step"], eval_fn=a["eval_fn"], lr_schedule=a["lr_schedule"],
                            eval_every=a["eval_every"], optimizer=opt, task=a["task"])
        extra = dict(a["options"])
        named_schedule = {"lr_schedule": a["lr_schedule"]} if isinstance(a["lr_schedule"], str) else {}
        passable = (set(TrainConfig.field_names()) - set(a)
                    - {"optimizer", "data", "model", "train_x", "train_y", "test_x", "test_y"})  # names= has those
        unknown = sorted(set(extra) - passable)
        if unknown:
            from flodl_mpi.api.keywords import unknown_keywords

            named = [p.name for p in inspect.signature(fit).parameters.values() if p.kind != p.VAR_KEYWORD]
            raise ValueError(unknown_keywords("fit()", unknown, set(named) | passable))
        _check_loader(a["num_workers"], a["pin_memory"])
        return TrainConfig(
            data=_describe(a["data"]) if a["data"] is not None and isinstance(a["data"], (str, os.PathLike))
            else (None if a["data"] is None else _source(a["data"])),
            model=_describe(a["model"]), epochs=a["epochs"], batch_size=a["batch_size"], drop_last=a["drop_last"],
            lr=a["lr"], optimizer=opt if isinstance(opt, str) else "adam", policy=a["policy"], window=a["window"],
            gamma=a["gamma"], seed=a["seed"], checkpoint_every=a["checkpoint_every"],
            keep_checkpoints=a["keep_checkpoints"], run_dir=None if a["run_dir"] is None else str(a["run_dir"]),
            resume=a["resume"], device=a["device"], stall_timeout=float(a["stall_timeout"]),
            chunk_elems=a["chunk_elems"], on_non_finite=a["on_non_finite"], eval_batch_size=a["eval_batch_size"],
            threads=a["threads"], scale_lr=a["scale_lr"], warmup_steps=a["warmup_steps"],
            clip_grad_norm=a["clip_grad_norm"], **named_schedule, **extra,
        )

    cfg = agree(comm, "config", config, watchdog)  # its flags become fit()'s keywords in fit (api_words)

    def nothing_to_resume() -> None:  # a plain resume=True with nothing to continue: before the data and model
        from flodl_mpi.training.resume_target import early_refusal

        refusal = early_refusal(cfg.run_dir, cfg.resume) if world.rank == 0 else None
        if refusal is not None:
            raise ValueError(refusal)

    agree(comm, "run dir", nothing_to_resume, watchdog, name_ranks=False)
    watchdog.stall_timeout = cfg.stall_timeout
    threads, threads_line = settle_threads(comm, world.host, agree(comm, "threads", lambda: thread_request(
        cfg.threads), watchdog))
    torch.set_num_threads(threads)
    device = agree(comm, "device", lambda: pick_device(cfg.device, world.local_rank, cfg.amp), watchdog)
    if a["data"] is None:
        data = for_task(load_data(cfg, world, watchdog), a["task"])  # integer labels: never raises
    else:
        data = agree(comm, "data", lambda: for_task(_load(a["data"], a["names"], cfg, a["num_workers"],
                                                          a["pin_memory"], world.local_size), a["task"]), watchdog)
    loaded = data  # val_fraction: held out once, from seed (the CLI's --val-fraction), or the data's own
    data = agree(comm, "data", lambda: settle_validation(loaded, cfg), watchdog)
    replay = load_replay_plan(cfg, world, watchdog, data)  # before anything is written

    # -- the task: the user's callables, the cohort's epoch boundary
    step_fn = a["train_step"] or default_train_step
    book = _scalars.ScalarBook()
    boundary = _Boundary(book, a["eval_fn"] or default_eval(step_fn), a["eval_every"], cfg.epochs,
                         cfg.eval_batch_size)
    opt = a["optimizer"]
    task = UserTask(step_fn, opt if callable(opt) else None, boundary, book.record, cfg, world.size,
                    schedule=a["lr_schedule"] if callable(a["lr_schedule"]) else None)

    # -- the model: same structure everywhere, one training step on the smallest batch (undone)
    torch.manual_seed(cfg.seed)

    def make_model() -> nn.Module:
        from flodl_mpi.training.accumulate import smallest_micro_batch

        m = a["model"]
        if m is None:
            from flodl_mpi.training.models import digits_mlp

            built = digits_mlp(data.input_shape, max(data.num_classes, 1))
        elif isinstance(m, nn.Module):
            built = m
        else:
            built = _call_factory(m, {"input_shape": data.input_shape, "num_classes": data.num_classes,
                                      "target_shape": tuple(data.train.y.shape[1:])})
        if not isinstance(built, nn.Module):
            raise ValueError(f"the model factory returned {type(built).__name__}, not a torch.nn.Module")
        built = built.to(device)
        from flodl_mpi.training.models import wide_tensor

        wide = wide_tensor(built)  # before a trial batch of the data fails on it less clearly
        if wide is not None:
            raise ValueError(wide)
        k = max(smallest_micro_batch(data.train.n, cfg.batch_size, cfg.accumulate, cfg.drop_last), 1)
        batch = (torch.from_numpy(data.train.x[:k]).to(device), torch.from_numpy(data.train.y[:k]).to(device))
        _scalars.activate(_scalars.ScalarBook())  # the check's scalars are dropped
        try:
            with state_kept(built, device):
                built.train()
                task.loss(built, batch, 0).backward()
            with torch.no_grad():
                built.eval()
                _check_eval(boundary.eval_fn(built, (batch[0][:2], batch[1][:2])))
                built.train()
        except Exception as exc:  # user code: one line, the cause chained
            raise ValueError(f"the train step or eval_fn fails on a batch of {k} sample(s): "
                             f"{type(exc).__name__}: {exc}") from exc
        finally:
            _scalars.activate(None)
        return built

    model = agree(comm, "model", make_model, watchdog)
    probe = _probe_optimizer(cfg, task, model)  # one throwaway: the config's and the record's optimizer
    # the factory's optimizer, lr, weight decay, momentum, not the CLI's defaults
    cfg = _as_built(cfg, probe if task.optimizer_factory is not None else None)

    # -- the one setup (flodl_mpi.training.setup.setup_rank): the CLI's run dir, train.log, resume,
    # metrics.h5, bridge and checkpoints (rank 0 writes)
    def prepared(run) -> bool:  # the run dir, train.log and the resume point are settled
        if run.data_note and world.rank == 0:  # after the resume's checks: a refused resume writes nothing to train.log
            log.info(run.data_note)
        if run.ckpt is not None and world.rank == 0:
            kept = _scalar_rows_before(run.run_dir / "metrics.h5", run.ckpt.epoch)
            run.keep_rows = {**run.keep_rows, "scalars": kept}
        if world.rank == 0:  # the data's warnings (labels training never targets): train.log, and the user's screen
            for line in data.warnings:
                _warn(line, a["verbose"], run.run_dir is not None)
        return True

    def reset_groups(trainer) -> None:  # resume set the config's lr and weight decay: the factory's are the run's
        fresh = task.make_optimizer(front.run.cfg, model)  # a new optimizer over the same params, no state
        for group, new in zip(trainer.optimizer.param_groups, fresh.param_groups):
            group.update({k: v for k, v in new.items() if k != "params"})

    front = TrainerFront(session.stop if session.stop is not None else StopRequest("resume=True"),
                         record=lambda: _record(front.run.cfg, a, data, model, probe), task=task, late_header=threads_line,
                         on_prepared=prepared, on_resume=reset_groups if callable(opt) else None,
                         remove_bad_new_run=False, replay=replay)
    run = start_trainer(cfg, world, watchdog, data, model, device, front)
    trainer, bridge, writer, run_dir, ckpt = front.trainer, run.bridge, run.writer, run.run_dir, run.ckpt
    resumed_mid_epoch = ckpt is not None and int(ckpt.meta.get("cursor", 0)) > 0
    # a stop cut the epoch short: its scalars go on from the checkpoint's books
    if resumed_mid_epoch and not boundary.resume_scalars(ckpt.meta, world.rank, world.size) and world.rank == 0:
        log.info(f"the checkpoint holds no record_scalar sums of epoch {int(ckpt.meta['epoch']) + 1} (written "
                 f"before flodl_mpi kept them): that epoch's scalars restart at batch {int(ckpt.meta['cursor'])}")
    _scalars.activate(book)
    bridge.start()
    handle = Run(session, trainer, boundary, writer, run_dir)
    handle._train_log = run.train_log
    return handle
