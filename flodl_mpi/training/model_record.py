"""The model a checkpoint was written for, and whether a model being resumed is that one.

Invariant: every checkpoint's meta holds ``model`` (`model_record`): the module tree
(qualified name, class) and every parameter's and buffer's (kind, name, shape,
dtype), in module order: what the ranks compare at start (`flodl_mpi.training.models.module_structure`,
`flodl_mpi.training.models.model_signature`). A resume compares it with the model it is about
to load into (`resume_difference`): a changed layer class, a renamed, added, removed or
reshaped tensor, or another dtype is one line naming the first difference, before
anything is loaded. A checkpoint written before the record (no ``model``) is compared
by its stored tensors' names and shapes (floating ones are stored float32: only
floating vs integer/bool is compared for them).

No MPI, no files: pure functions of the model and the checkpoint's meta and arrays.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from torch import nn

from flodl_mpi.training.models import module_structure

__all__ = ["model_record", "resume_difference"]


def _dtype(tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")  # torch.float32 -> "float32"


def model_record(model: nn.Module) -> dict[str, list]:
    """The checkpoint's ``model`` meta: JSON-able lists.

    Returns:
        ``{"modules": [[qualified name, class qualname], ...], "tensors": [[kind, name,
        shape, dtype], ...]}``: modules in ``named_modules()`` order (the model itself
        first, name ``""``); tensors the parameters then the buffers, in module order,
        kind ``"parameter"`` or ``"buffer"``, shape a list of ints, dtype the torch dtype
        without ``torch.`` (``"float32"``).
    """
    tensors = [["parameter", n, list(t.shape), _dtype(t)] for n, t in model.named_parameters()]
    tensors += [["buffer", n, list(t.shape), _dtype(t)] for n, t in model.named_buffers()]
    return {"modules": [[name, kind] for name, kind in module_structure(model)], "tensors": tensors}


def _shape(shape: Sequence[int]) -> str:
    return str(tuple(int(s) for s in shape))


def _module(entry: Sequence[str] | None) -> str:
    if entry is None:
        return "no further module"
    return f"the model itself as {entry[1]}" if entry[0] == "" else f"module {entry[0]!r} ({entry[1]})"


def _tensor(entry: Sequence[Any] | None) -> str:
    if entry is None:
        return "no further tensor"
    kind, name, shape, dtype = entry
    return f"{kind} {name!r} {_shape(shape)} {dtype}"


def _first(a: list, b: list) -> tuple:
    """The first pair of entries that differ, ``None`` padding the shorter list."""
    return next((x, y) for x, y in zip([*a, None], [*b, None]) if x != y)


def _recorded_difference(now: dict[str, list], saved: Mapping[str, Any]) -> str | None:
    modules = [list(e) for e in saved["modules"]]
    if now["modules"] != modules:
        x, y = _first(now["modules"], modules)
        if x is not None and y is not None and x[0] == y[0]:
            what = "the model itself" if x[0] == "" else f"module {x[0]!r}"
            return f"{what} is {x[1]}, the checkpoint's is {y[1]}"
        return f"the model has {_module(x)} where the checkpoint's has {_module(y)}"
    tensors = [[e[0], e[1], list(e[2]), e[3]] for e in saved["tensors"]]
    if now["tensors"] != tensors:
        x, y = _first(now["tensors"], tensors)
        if x is not None and y is not None and x[:2] == y[:2]:
            if x[2] != y[2]:
                return f"{x[0]} {x[1]!r} shape {_shape(x[2])}, the checkpoint's {_shape(y[2])}"
            return f"{x[0]} {x[1]!r} dtype {x[3]}, the checkpoint's {y[3]}"
        return f"the model has {_tensor(x)} where the checkpoint's has {_tensor(y)}"
    return None


def _kind(dtype) -> str:
    """``floating``, ``complex``, ``bool`` or ``integer``: what an older checkpoint's dtype can still tell."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return "floating"
    return {"c": "complex", "b": "bool"}.get(dtype.kind, "integer")


def _torch_kind(tensor) -> str:
    if tensor.dtype.is_floating_point:
        return "floating"
    if tensor.dtype.is_complex:
        return "complex"
    return "bool" if str(tensor.dtype) == "torch.bool" else "integer"


def _stored_difference(model: nn.Module, stored: Mapping[str, np.ndarray]) -> str | None:
    """Older checkpoints: the model's state dict against the stored arrays, by name, shape and kind."""
    state = model.state_dict()
    for name, tensor in state.items():
        if name not in stored:
            return f"the model has {name!r} {_shape(tensor.shape)}, which the checkpoint does not hold"
        have = stored[name]
        if tuple(tensor.shape) != tuple(have.shape):
            return f"{name!r} shape {_shape(tensor.shape)}, the checkpoint's {_shape(have.shape)}"
        if _torch_kind(tensor) != _kind(have.dtype):
            return f"{name!r} dtype {_dtype(tensor)}, the checkpoint's {have.dtype}"
    extra = [name for name in stored if name not in state]
    if extra:
        return f"the checkpoint holds {extra[0]!r} {_shape(stored[extra[0]].shape)}, which the model does not have"
    return None


def resume_difference(model: nn.Module, meta: Mapping[str, Any], stored: Mapping[str, np.ndarray]) -> str | None:
    """Whether ``model`` is the model a checkpoint was written for.

    Args:
        model: the model about to be resumed (its state not yet touched).
        meta: the checkpoint's meta; ``meta["model"]`` is its `model_record` (absent
            in checkpoints written before it).
        stored: the checkpoint's arrays by state-dict name (params and buffers).

    Returns:
        None when they match; else one phrase naming the first difference, e.g.
        ``module '2' is Tanh, the checkpoint's is ReLU`` or ``parameter '1.weight'
        shape (48, 64), the checkpoint's (32, 64)``. The module tree is compared
        first, then the tensors in order.
    """
    saved = meta.get("model")
    if isinstance(saved, Mapping) and "modules" in saved and "tensors" in saved:
        return _recorded_difference(model_record(model), saved)
    return _stored_difference(model, stored)
