"""What a Python API run records as its config: the objects the user's code built, not the CLI's defaults.

Invariant: ``config.json`` and metrics.h5's ``config`` attribute of a run of
:func:`flodl_mpi.fit` or :class:`flodl_mpi.Averager` hold only values that are
true for the run: the model's and the optimizer's classes and hyperparameters as
built, the loss as named, and the list of ``flodl-mpi train`` options that do not
apply (left out, rather than filled with a default the run never used). Checkpoints
keep the full :class:`flodl_mpi.config.TrainConfig` (the resume check needs it).
Duck-typed on purpose: no torch import, so readers stay light.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["HYPERPARAMETERS", "OWN_LOOP_OPTIONS", "api_config", "describe_model", "describe_optimizer",
           "optimizer_name"]

#: Optimizer hyperparameters recorded per param group, when the group has them.
HYPERPARAMETERS = ("lr", "betas", "momentum", "dampening", "nesterov", "weight_decay", "eps", "alpha", "centered",
                   "amsgrad")

#: TrainConfig fields that an own loop (:class:`flodl_mpi.Averager`) sets; every other one does not apply.
OWN_LOOP_OPTIONS = ("data", "model", "policy", "window", "gamma", "checkpoint_every", "keep_checkpoints", "run_dir",
                    "resume", "stall_timeout", "chunk_elems", "on_non_finite", "node_reduce", "hierarchical",
                    "bf16_wire")


def _plain(value: Any) -> Any:
    """A JSON-able copy: tuples as lists, one-element tensors and numpy scalars as numbers."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if hasattr(value, "item"):
        try:
            return _plain(value.item())
        except (TypeError, ValueError, RuntimeError):
            pass
    return repr(value)


def _class_name(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}:{cls.__qualname__}"


def optimizer_name(optimizer: Any) -> str:
    """The config's ``optimizer`` for a built optimizer: ``"sgd"``, ``"adam"`` or ``"adamw"`` for
    those classes, else ``"module:Class"`` (``torch.optim.rmsprop:RMSprop``). A resume checks
    it against the class of the state the checkpoint holds (`flodl_mpi.training.train._check_optimizer`)."""
    from flodl_mpi.config import OPTIMIZERS

    cls = type(optimizer)
    return cls.__name__.lower() if cls.__name__.lower() in OPTIMIZERS else _class_name(optimizer)


def describe_model(model: Any) -> dict[str, Any]:
    """``{"class": "module:Class", "parameters": number of parameter values}`` of an ``nn.Module``."""
    return {"class": _class_name(model), "parameters": int(sum(p.numel() for p in model.parameters()))}


def describe_optimizer(optimizer: Any) -> dict[str, Any]:
    """``{"class": ..., "param_groups": [{"params": tensors, hyperparameter: value, ...}]}`` as built.

    The values are the groups' at the time of the call (before any schedule steps);
    only the names in `HYPERPARAMETERS` are kept.
    """
    groups = []
    for group in optimizer.param_groups:
        entry = {"params": len(group["params"])}
        entry.update({k: _plain(group[k]) for k in HYPERPARAMETERS if k in group})
        groups.append(entry)
    return {"class": _class_name(optimizer), "param_groups": groups}


def api_config(options: Mapping[str, Any], api: str, *, loss: str, model: Any = None, optimizer: Any = None,
               applies: Iterable[str] | None = None, not_applicable: Iterable[str] = ()) -> dict[str, Any]:
    """The record of an API run's config (``config.json``, metrics.h5's ``config``).

    Args:
        options: ``TrainConfig.to_dict()`` of the run.
        api: ``"fit"`` or ``"Averager"``.
        loss: the loss's name as the run knows it (``"cross-entropy"``, ``"mean squared error"``,
            ``"train_step module:name"``, ...).
        model: the built ``nn.Module``: recorded as ``model`` = `describe_model`, with the
            factory's name (``options["model"]``) kept as ``model_factory``.
        optimizer: the built optimizer: recorded as ``optimizer`` = `describe_optimizer`.
        applies: keep only these options (the others are listed in ``not_applicable``); None: all.
        not_applicable: options to leave out besides.

    Returns:
        dict: the options that apply, ``api``, ``loss``, ``model``, ``optimizer`` and
        ``not_applicable`` (sorted names of the options left out).
    """
    keep = set(options) if applies is None else set(applies)
    dropped = (set(options) - keep) | set(not_applicable)
    out: dict[str, Any] = {k: v for k, v in options.items() if k not in dropped}
    out["api"] = api
    out["loss"] = loss
    if model is not None:
        out["model"] = describe_model(model)
        if options.get("model") not in (None, out["model"]["class"]):
            out["model_factory"] = options["model"]
    if optimizer is not None:
        out["optimizer"] = describe_optimizer(optimizer)
    out["not_applicable"] = sorted(k for k in dropped if k not in out)
    return out
