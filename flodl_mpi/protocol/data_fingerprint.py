"""A run's data fingerprint: what a resume checks it trains on the same data as before.

Shapes and dtypes of every array, and a SHA-256 over each split's labels (all of
them) and over at most ``SAMPLED_ROWS`` rows of its features, evenly spaced from
the first to the last row (all rows when there are fewer). The time is bounded:
``SAMPLED_ROWS`` rows of x plus the labels, whatever the file's size (for 4,096
rows of 784 float32 features, 12.8 MB read). A change confined to rows between
the sampled ones is not seen; any change of a label, a shape or a dtype is.
"""

from __future__ import annotations

import hashlib

import numpy as np

__all__ = ["SAMPLED_ROWS", "differences", "fingerprint"]

#: Rows of x hashed per split, at most.
SAMPLED_ROWS = 4096


def _rows(n: int) -> np.ndarray:
    return np.unique(np.linspace(0, n - 1, min(n, SAMPLED_ROWS)).round().astype(np.int64)) if n else \
        np.zeros(0, np.int64)


def fingerprint(data) -> dict:
    """The fingerprint of a `flodl_mpi.training.data.Dataset` (train, test and validation splits), JSON-ready.

    Returns:
        ``{"<split> x": {"shape": [...], "dtype": str}, "<split> y": {...},
        "<split> sha256": hex}`` for ``split`` in train, test, and val when the data has a
        validation set (a val/ group, ``--val-fraction``'s split), plus ``"sampled_rows"``.
    """
    out: dict = {"sampled_rows": SAMPLED_ROWS}
    for name in ("train", "test", "val"):
        split = getattr(data, name, None)
        if split is None:  # no validation set: no val keys (a fingerprint from before them has none either)
            continue
        x, y = split.x, split.y
        h = hashlib.sha256()
        h.update(np.ascontiguousarray(np.asarray(y)).tobytes())
        h.update(np.ascontiguousarray(np.asarray(x[_rows(int(x.shape[0]))])).tobytes())
        out[f"{name} x"] = {"shape": [int(s) for s in x.shape], "dtype": str(x.dtype)}
        out[f"{name} y"] = {"shape": [int(s) for s in y.shape], "dtype": str(y.dtype)}
        out[f"{name} sha256"] = h.hexdigest()
    return out


def differences(saved: dict, now: dict) -> list[str]:
    """What differs between two fingerprints, one phrase each (empty: the same data)."""
    if saved.get("sampled_rows") != now.get("sampled_rows"):
        keys = [k for k in now if not k.endswith("sha256") and k != "sampled_rows"]  # shapes only comparable
    else:
        keys = [k for k in now if k != "sampled_rows"]
    out = []
    for k in keys:
        a, b = saved.get(k), now.get(k)
        if a == b or (a is None and k.startswith("val ")):  # a run recorded before the val keys: not comparable
            continue
        if k.endswith("sha256"):
            out.append(f"{k.split()[0]} data content (labels or sampled rows of x)")
        elif a is None:
            continue
        else:
            what = [f"shape {tuple(b['shape'])} (was {tuple(a['shape'])})" if a["shape"] != b["shape"] else "",
                    f"dtype {b['dtype']} (was {a['dtype']})" if a["dtype"] != b["dtype"] else ""]
            out.append(f"{k} " + ", ".join(w for w in what if w))
    return out
