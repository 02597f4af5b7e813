"""The product's averaging configurations, one after another in one launch across the cluster's hosts.

    mpiexec ... python tests/multinode/matrix.py NAME [NAME ...]     (run by tests/multinode/test_multinode.py)

Each NAME (``CONFIGS``) is a :func:`flodl_mpi.fit` run of 2 epochs on a small fixed data set. Every call of
:meth:`flodl_mpi.transport.reduce.Reducer.reduce` is wrapped to keep its last round: this rank's tensors
before it (the staging), its mass, and the result. After each run, rank 0 prints one JSON line:

- ``path``: the reduce path each plane took (the same on every rank, checked);
- ``identical``: the final model's floating-point tensors are the same bits on every rank;
- ``rel_err``: per plane, ``‖result − ref‖ / ‖ref‖`` of the last round against a float64 numpy reference
  ``Σ W·m_r·x_r / Σ W·m_r`` of every rank's pre-round tensors ``x_r`` (bf16-rounded first on the bf16 wire),
  and ``bound``, the most it may be (one float32 rounding; across hosts also one rounding of each node's mean,
  float32 or bf16: issue 25 item 4); ``bits_equal``: the fraction of elements equal, bit for bit, to that
  reference rounded to float32, or across hosts to the leaders' own arithmetic done in numpy
  (``_leaders_round``: node means rounded, combined in float64);
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
    hosts = world.allgather(socket.gethostname())
    for key in sorted(_last):
        rec = _last[key]
        rows = world.allgather((rec["pre"], rec["mass"], rec["path"]))
        paths = {p for _, _, p in rows}
        W = rec["W"]
        scale = [W * m for _, m, _ in rows]
        pre = [(_bf16(x) if rec["bf16"] else x).astype(np.float64) for x, _, _ in rows]
        ref = sum(s * x for s, x in zip(scale, pre) if s) / sum(scale)
        post = rec["post"]
        norm = max(np.linalg.norm(ref), 1e-300)
        rel = float(np.linalg.norm(post - ref) / norm)
        # Across hosts the leaders exchange each node's mean rounded once (float32, or bf16 from that float32):
        # |err_i| <= u·Σ_r w_r·|x_r,i| + 2**-24·|ref_i| (w_r = W·m_r / Σ W·m; protocol/node_means.py), relative
        # to ‖ref‖ here; elsewhere one float32 rounding of the float64 quotient, 2**-24 per element.
        leaders = all(p.endswith("+leaders") for p in paths)
        u = (2.0**-8 + 2.0**-24 if rec["bf16"] else 2.0**-24) if leaders else 0.0
        a = sum(s / sum(scale) * np.abs(x) for s, x in zip(scale, pre) if s)
        bound = float((u * np.linalg.norm(a) + 2.0**-24 * np.linalg.norm(ref)) / norm)
        own = _leaders_round(pre, scale, hosts, rec["bf16"]) if leaders else ref
        bits = float(np.mean(post.view(np.uint32) == own.astype(np.float32).view(np.uint32)))
        report["planes"].append(
            {
                "path": sorted(paths),
                "n": int(post.size),
                "realized": bool(rec["realized"]),
                "rel_err": rel,
                "bound": bound,
                "bits_equal": bits,
            }
        )
    report["hosts"] = hosts
    return report


def _leaders_round(pre: list[np.ndarray], scale: list[float], hosts: list[str], bf16: bool) -> np.ndarray:
    """The hierarchical round's own arithmetic, in numpy (float64 unless said): per host (node order = the
    hosts' first ranks' order) the float64 sum of ``W·m_r·x_r`` in rank order over its float64 mass, rounded
    to float32 (then bf16), then ``Σ_k M_k·μ_k / Σ_k M_k`` in node order, the nodes of mass 0 skipped."""
    nodes = list(dict.fromkeys(hosts))
    means, masses = [], []
    for h in nodes:
        ranks = [r for r, host in enumerate(hosts) if host == h]
        mass = 0.0
        for r in ranks:
            mass += scale[r]
        parts = [scale[r] * pre[r] for r in ranks if scale[r]]
        mu = (sum(parts) / mass).astype(np.float32) if mass else np.zeros(pre[0].shape, np.float32)
        means.append((_bf16(mu) if bf16 else mu).astype(np.float64))
        masses.append(mass)
    total = 0.0
    for m in masses:
        total += m
    return sum(m * mu for m, mu in zip(masses, means) if m) / total


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
