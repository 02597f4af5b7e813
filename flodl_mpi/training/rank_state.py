"""A rank's own training state as plain arrays and JSON: optimizer, RNG, step count,
integer buffers.

Invariant: ``restore(capture(...))`` gives back the same optimizer state, the same
torch RNG stream, the same step count and the same integer buffers (e.g.
BatchNorm's ``num_batches_tracked``, which never travels in a round and so differs
by rank), without pickle, so a checkpoint holds each rank's state exactly (SPEC §6)
and a resumed run continues as if never interrupted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from flodl_mpi.outputs.checkpoint import escape_name, unescape_name

__all__ = ["capture", "integer_buffers", "restore", "restore_integer_buffers"]

_STATE = "optimizer/state"
_INT = "int_buffers"


def integer_buffers(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """The model's non-floating buffers by state-dict name, as numpy copies (dtype kept)."""
    return {name: b.detach().cpu().numpy().copy() for name, b in model.named_buffers()
            if not b.is_floating_point()}


@torch.no_grad()
def restore_integer_buffers(model: torch.nn.Module, arrays: Mapping[str, np.ndarray]) -> list[str]:
    """Copy the integer buffers that `capture` saved into ``model``.

    Returns:
        The names restored (empty for state saved before integer buffers were kept
        per rank: the model keeps what it has).

    Raises:
        ValueError: a saved name the model lacks, or a shape that differs.
    """
    live = dict(model.named_buffers())
    done = []
    for key, arr in arrays.items():
        if not key.startswith(_INT + "/"):
            continue
        name = unescape_name(key[len(_INT) + 1 :])
        if name not in live or tuple(live[name].shape) != np.shape(arr):
            raise ValueError(f"saved integer buffer {name!r} {np.shape(arr)} does not fit the model")
        live[name].copy_(torch.from_numpy(np.array(arr)))
        done.append(name)
    return done


def capture(optimizer: torch.optim.Optimizer, global_step: int,
            model: torch.nn.Module | None = None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """This rank's state: ``(arrays, attrs)`` for ``write_checkpoint(ranks=...)``.

    Returns:
        arrays: ``optimizer/state/<param index>/<key>`` for every tensor in the
            optimizer state (dtype kept), ``rng/torch`` (uint8, the CPU RNG) and,
            given ``model``, ``int_buffers/<escaped state-dict name>`` for each
            integer buffer (see `flodl_mpi.outputs.checkpoint.escape_name`).
        attrs: ``optimizer_param_groups`` (JSON), ``optimizer_scalars`` (non-tensor
            state values), ``optimizer_class`` and ``global_step``.
    """
    sd = optimizer.state_dict()
    arrays: dict[str, np.ndarray] = {"rng/torch": torch.get_rng_state().numpy().copy()}
    scalars: dict[str, dict[str, Any]] = {}
    for index, state in sd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                arrays[f"{_STATE}/{index}/{key}"] = value.detach().cpu().numpy().copy()
            else:
                scalars.setdefault(str(index), {})[key] = value
    for name, arr in (integer_buffers(model) if model is not None else {}).items():
        arrays[f"{_INT}/{escape_name(name)}"] = arr
    attrs = {
        "optimizer_class": type(optimizer).__name__,
        "optimizer_param_groups": sd["param_groups"],
        "optimizer_scalars": scalars,
        "global_step": int(global_step),
    }
    return arrays, attrs


def restore(optimizer: torch.optim.Optimizer, arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any],
            rng: bool = True) -> int:
    """Load what :func:`capture` saved into ``optimizer`` and (``rng``) torch's RNG.

    Integer buffers are restored separately, by `restore_integer_buffers`.

    Returns:
        The saved ``global_step``.

    Raises:
        ValueError: the state is for another optimizer class or parameter layout.
    """
    if attrs["optimizer_class"] != type(optimizer).__name__:
        raise ValueError(f"the checkpoint holds {attrs['optimizer_class']} state, the run uses "
                         f"{type(optimizer).__name__} (keep --optimizer as it was)")
    state: dict[int, dict[str, Any]] = {}
    for name, arr in arrays.items():
        if name.startswith(_STATE + "/"):
            index, key = name[len(_STATE) + 1 :].split("/", 1)
            # Optimizer.load_state_dict moves these to each parameter's device.
            state.setdefault(int(index), {})[key] = torch.from_numpy(np.array(arr))
    for index, values in attrs["optimizer_scalars"].items():
        state.setdefault(int(index), {}).update(values)
    groups = attrs["optimizer_param_groups"]
    for group in groups:  # JSON made tuples lists; torch's own defaults use tuples
        for key, value in group.items():
            if key != "params" and isinstance(value, list):
                group[key] = tuple(value)
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    if rng:
        torch.set_rng_state(torch.from_numpy(np.array(arrays["rng/torch"], dtype=np.uint8)))
    return int(attrs["global_step"])
