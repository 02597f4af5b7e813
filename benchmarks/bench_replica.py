"""Per-round cost of the training thread's snapshot and adoption (``replica.Replica``).

Run in one process (no launcher needed)::

    python benchmarks/bench_replica.py [--params 100000] [--layers 12] [--rounds 2000]

The model is ``--layers`` Linear + BatchNorm1d blocks holding about ``--params``
parameters. Each timed round is ``Replica.snapshot`` then ``Replica.adopt``
(what :class:`flodl_mpi.training.worker.Trainer` calls around every round), with the
params copied (``copies``) or living in the bridge's staging (``bound``, the
CPU path). Since parameters and buffers are resolved by name at every call (a
tensor the model replaced is still averaged), this measures what that costs:
compare with the same script on a tree from before that change. Prints the
median and min microseconds per round over ``--repeats`` blocks of ``--rounds``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from mpi4py import MPI

from flodl_mpi.transport.bridge import Bridge
from flodl_mpi.training.replica import Replica


def make_model(params: int, layers: int) -> torch.nn.Module:
    """``layers`` blocks of Linear(d, d) + BatchNorm1d(d) with ``d`` chosen to total about ``params``."""
    d = max(2, int((params / layers) ** 0.5))
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(d, d), torch.nn.BatchNorm1d(d)]
    return torch.nn.Sequential(*blocks)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=100_000, help="about this many parameters in all")
    ap.add_argument("--layers", type=int, default=12, help="Linear + BatchNorm1d blocks")
    ap.add_argument("--rounds", type=int, default=2000, help="snapshot + adopt pairs per timed block")
    ap.add_argument("--repeats", type=int, default=7, help="timed blocks")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for mode in ("copies", "bound"):
        model = make_model(args.params, args.layers)
        replica = Replica(model, torch.device("cpu"))
        params, buffers = replica.params, replica.float_buffers
        bridge = Bridge(MPI.COMM_SELF.Dup(), [tuple(p.shape) for p in params], [tuple(b.shape) for b in buffers],
                        threaded=False)
        if mode == "bound":
            replica.bind(bridge)
        per_round = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            for _ in range(args.rounds):
                replica.snapshot(bridge)
                replica.adopt(bridge)
            per_round.append(1e6 * (time.perf_counter() - t0) / args.rounds)
        n = sum(p.numel() for p in params)
        print(f"{mode:>6}: {n:,} params in {len(params)} tensors, {len(buffers)} float buffers: snapshot + adopt "
              f"median {statistics.median(per_round):.1f} us, min {min(per_round):.1f} us per round")
        bridge.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
