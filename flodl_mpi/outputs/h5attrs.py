"""HDF5 attributes for flodl-mpi's files: plain values natively, the rest as JSON.

Invariant: ``read_attrs(write_attrs(...))`` gives back the same values — numpy
scalars as Python scalars, dicts and lists decoded — for checkpoints and
``metrics.h5`` alike.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import numpy as np

__all__ = ["write_attrs", "read_attrs"]


def write_attrs(attrs: MutableMapping, items: Mapping[str, Any], what: str) -> list[str]:
    """Store ``items`` as HDF5 attributes; return the keys that were JSON-encoded.

    Raises:
        TypeError: a value is none of str, int, float, bool, numeric ndarray,
            dict, list, tuple, None (numpy scalars count as int/float/bool).
    """
    json_keys = []
    for key, value in items.items():
        if isinstance(value, (str, bool, int, float, np.bool_, np.integer, np.floating)):
            attrs[key] = value
        elif isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
            attrs[key] = value
        elif value is None or isinstance(value, (dict, list, tuple)):
            try:
                attrs[key] = json.dumps(value)
            except TypeError as exc:
                raise TypeError(f"{what}[{key!r}] is not JSON-serializable: {exc}") from None
            json_keys.append(key)
        else:
            raise TypeError(
                f"{what}[{key!r}] has type {type(value).__name__}; expected str, int, float, "
                "bool, a numeric ndarray, or a JSON-serializable dict/list/None"
            )
    return json_keys


def read_attrs(attrs: Mapping, skip: Sequence[str] = ()) -> dict[str, Any]:
    """Inverse of `write_attrs` (its JSON key list stored as ``json_keys``): numpy scalars
    become Python scalars, JSON is decoded."""
    json_keys = set(json.loads(attrs["json_keys"])) if "json_keys" in attrs else set()
    out = {}
    for key, value in attrs.items():
        if key in skip or key == "json_keys":
            continue
        if isinstance(value, np.generic):
            value = value.item()
        if key in json_keys:
            value = json.loads(value)
        out[key] = value
    return out
