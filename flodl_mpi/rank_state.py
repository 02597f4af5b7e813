"""A rank's own training state as plain arrays and JSON: optimizer, RNG, step count.

Invariant: ``restore(capture(...))`` gives back the same optimizer state, the same
torch RNG stream and the same step count, without pickle, so a checkpoint holds
each rank's state exactly (SPEC §6) and a resumed run continues as if never
interrupted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["capture", "restore"]

_STATE = "optimizer/state"


def capture(optimizer: torch.optim.Optimizer, global_step: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """This rank's state: ``(arrays, attrs)`` for ``write_checkpoint(ranks=...)``.

    Returns:
        arrays: ``optimizer/state/<param index>/<key>`` for every tensor in the
            optimizer state (dtype kept), and ``rng/torch`` (uint8, the CPU RNG).
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
    attrs = {
        "optimizer_class": type(optimizer).__name__,
        "optimizer_param_groups": sd["param_groups"],
        "optimizer_scalars": scalars,
        "global_step": int(global_step),
    }
    return arrays, attrs


def restore(optimizer: torch.optim.Optimizer, arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> int:
    """Load what :func:`capture` saved into ``optimizer`` and torch's RNG.

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
    torch.set_rng_state(torch.from_numpy(np.array(arrays["rng/torch"], dtype=np.uint8)))
    return int(attrs["global_step"])
