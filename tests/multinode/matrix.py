"""The product's averaging configurations, one after another in one launch across the cluster's hosts.

    mpiexec ... python tests/multinode/matrix.py NAME [NAME ...]     (run by tests/multinode/test_multinode.py)

Each NAME (``CONFIGS``) is a :func:`flodl_mpi.fit` run of 2 epochs on a small fixed data set. Every call of
:meth:`flodl_mpi.transport.reduce.Reducer.reduce` is wrapped to keep its last round: this rank's tensors
before it (the staging), its mass, and the result. After each run, rank 0 prints one JSON line:

- ``path``: the reduce path each plane took (the same on every rank, checked);
- ``identical``: the final model's floating-point tensors are the same bits on every rank;
- ``rel_err``: per plane, ``‖result − ref‖ / ‖ref‖`` of the last round against a float64 numpy reference
  ``Σ W·m_r·x_r / Σ W·m_r`` of every rank's pre-round tensors ``x_r`` (bf16-rounded first on the bf16 wire),
  and ``bits_equal``: the fraction of elements equal to that reference rounded to float32 bit for bit;
- ``hosts``: each rank's host name.
"""

from __future__ import annotations

import hashlib
import json
import socket
import sys

import numpy as np
import torch
from mpi4py import MPI

import flodl_mpi
from flodl_mpi.transport import reduce as reduce_mod

#: name -> fit's keyword arguments.
CONFIGS = {
    "sync-auto": dict(policy="sync"),
    "sync-flat-mpi": dict(policy="sync", node_reduce="mpi", hierarchical="off"),
    "sync-hier-mpi": dict(policy="sync", node_reduce="mpi", hierarchical="on"),
    "sync-hier-shm": dict(policy="sync", node_reduce="shm", hierarchical="on"),
    "sync-bf16-hier": dict(policy="sync", node_reduce="shm", hierarchical="on", bf16_wire=True),
    "sync-bf16-flat": dict(policy="sync", node_reduce="mpi", hierarchical="off", bf16_wire=True),
    "window": dict(policy="window", window=3),
    "cadence": dict(policy="cadence", anchor=2),
    "async": dict(policy="async", anchor=2),
}

_last: dict[int, dict] = {}  # creation order of the reducer -> its last round
_order: dict[int, int] = {}


def _install() -> None:
    plain = reduce_mod.Reducer.reduce

    def reduce(self, staging, mass, masses=None, **kwargs):
        pre = np.array(staging, copy=True)
        stats = plain(self, staging, mass, masses, **kwargs)
        key = _order.setdefault(id(self), len(_order))
        _last[key] = dict(
            pre=pre,
            mass=float(mass),
            post=np.array(staging, copy=True),
            path=self.path,
            bf16=self.options.bf16,
            realized=stats.realized,
            W=self.comm.size,
        )
        return stats

    reduce_mod.Reducer.reduce = reduce


def _bf16(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.bfloat16).float().numpy()


def _data(seed: int = 7):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((384, 12)).astype(np.float32)
    y = (x[:, :4].argmax(1)).astype(np.int64)
    return {"train": (x[:320], y[:320]), "test": (x[320:], y[320:])}


def run(name: str, world: MPI.Comm) -> dict:
    _last.clear()
    _order.clear()
    result = flodl_mpi.fit(data=_data(), epochs=2, batch_size=8, lr=1e-2, seed=3, **CONFIGS[name])
    result.wait() if hasattr(result, "wait") else None
    floats = [v.detach().numpy() for v in result.model.state_dict().values() if v.is_floating_point()]
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in floats)).hexdigest()
    digests = world.allgather(digest)
    report = {"name": name, "identical": len(set(digests)) == 1, "planes": []}
    for key in sorted(_last):
        rec = _last[key]
        rows = world.allgather((rec["pre"], rec["mass"], rec["path"]))
        paths = {p for _, _, p in rows}
        W = rec["W"]
        scale = [W * m for _, m, _ in rows]
        pre = [(_bf16(x) if rec["bf16"] else x).astype(np.float64) for x, _, _ in rows]
        ref = sum(s * x for s, x in zip(scale, pre) if s) / sum(scale)
        post = rec["post"]
        rel = float(np.linalg.norm(post - ref) / max(np.linalg.norm(ref), 1e-300))
        bits = float(np.mean(post.view(np.uint32) == ref.astype(np.float32).view(np.uint32)))
        report["planes"].append(
            {
                "path": sorted(paths),
                "n": int(post.size),
                "realized": bool(rec["realized"]),
                "rel_err": rel,
                "bits_equal": bits,
            }
        )
    report["hosts"] = world.allgather(socket.gethostname())
    return report


def main(names: list[str]) -> int:
    _install()
    world = MPI.COMM_WORLD
    for name in names:
        report = run(name, world)
        if world.rank == 0:
            print("MATRIX " + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
