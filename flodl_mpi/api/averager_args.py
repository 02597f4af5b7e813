"""The Averager's arguments, checked: a misspelt keyword, the model and optimizer's kind, then the config.

Invariant: every bad argument is one ``ValueError`` whose line names it as the signature spells
it (the Averager turns it into `flodl_mpi.errors.InputError` on every rank alike); nothing here
starts MPI or touches the model.
"""

from __future__ import annotations

import torch
from torch import nn

from flodl_mpi.config import TrainConfig, own_loop_config

__all__ = ["check_arguments"]


def _model_name(model: nn.Module) -> str:
    cls = type(model)
    return f"{cls.__module__}:{cls.__qualname__}"


def _optimizer_name(optimizer) -> str:
    """The resume config's ``optimizer`` (a resume checks it against the saved state); none: the default."""
    from flodl_mpi.api.run_record import optimizer_name

    return TrainConfig.optimizer if optimizer is None else optimizer_name(optimizer)


def check_arguments(api, model, optimizer, options: dict, **settings) -> TrainConfig:
    """The config of an :class:`flodl_mpi.Averager` (`flodl_mpi.config.own_loop_config`) from its arguments.

    Args:
        api: the class whose signature names the keywords (``Averager``): a misspelt one's line
            names the closest (``windw (did you mean window?)``).
        model, optimizer: as given to it.
        options: the keywords its signature does not name (none is accepted).
        **settings: the rest of its arguments, by keyword, for `own_loop_config`.

    Raises:
        ValueError: a bad argument (a wrong kind too), one line naming it.
    """
    try:
        if options:  # a misspelt keyword: fit's line (did you mean ...?), not Python's TypeError
            import inspect

            from flodl_mpi.api.keywords import unknown_keywords

            named = [p.name for p in inspect.signature(api).parameters.values()
                     if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
            raise ValueError(unknown_keywords("Averager()", options, named))
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        params = list(model.named_parameters())
        if not params:
            raise ValueError("model has no parameters: nothing to average")
        bad = [n for n, p in params if not p.is_floating_point()]
        if bad:
            raise ValueError(f"model parameter {bad[0]!r} is not floating point; every parameter must be")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("optimizer must be a torch.optim.Optimizer or None, got "
                            f"{type(optimizer).__name__}")
        return own_loop_config(model=_model_name(model), optimizer=_optimizer_name(optimizer), **settings)
    except TypeError as exc:  # the wrong kind is bad input too (agree: ValueError is input)
        raise ValueError(str(exc)) from None
