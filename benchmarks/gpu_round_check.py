"""The GPU path of a round, checked and timed (issue 9); runs on CPU too, as its own test.

Run on a machine with a GPU, two ranks::

    mpiexec -n 2 python benchmarks/gpu_round_check.py --params 100000000        # rank 0 on cuda:0, rank 1 on CPU
    mpiexec -n 2 python benchmarks/gpu_round_check.py --params 100000 --cpu-only  # the same code path on CPU

Each rank builds the same list of tensors (different values per rank) on its
device (``--cpu-only``: every rank on CPU; otherwise rank 0 on ``cuda:0`` when
CUDA is available), wraps them in ``replica.Replica`` with a ``Bridge`` whose
staging is pinned when the rank is on the GPU, and runs rounds as training does
(``Replica.snapshot``: device to host, non-blocking into pinned staging, one
stream wait; ``Bridge.round``; ``Replica.adopt``: non-blocking upload). Checks:
the consensus on every rank equals the float64 mean of the inputs (rtol 1e-5)
and is bitwise the same on every rank, including the GPU rank after it is
copied back; then times ``--rounds`` rounds (median, slowest rank). Exit 0 when
the check passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

from flodl_mpi.transport.bridge import Bridge
from flodl_mpi.training.replica import Replica


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=100_000_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cpu-only", action="store_true", help="every rank on CPU (no GPU needed)")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    rank, world = comm.rank, comm.size
    say = print if rank == 0 else (lambda *a, **k: None)
    gpu = not args.cpu_only and rank == 0 and torch.cuda.is_available()
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    sizes = [args.params // 4, args.params // 4, args.params - 2 * (args.params // 4)]
    gen = torch.Generator().manual_seed(100 + rank)
    host = [torch.randn(n, generator=gen) for n in sizes]
    model = torch.nn.ParameterList([torch.nn.Parameter(t.to(device)) for t in host])
    replica = Replica(model, device)
    bridge = Bridge(comm.Dup(), [tuple(p.shape) for p in replica.params], pin_staging=device.type == "cuda")
    if device.type == "cpu":
        replica.bind(bridge)
    bridge.start()

    flat = np.concatenate([t.numpy() for t in host]).astype(np.float64)
    want = np.empty_like(flat)
    comm.Allreduce(flat, want, op=MPI.SUM)
    want /= world
    replica.snapshot(bridge)
    assert bridge.round(steps=1, window=1).adopted
    replica.adopt(bridge)
    got = np.concatenate([p.detach().cpu().numpy().ravel() for p in replica.params])
    ok = bool(np.allclose(got, want, rtol=1e-5, atol=1e-6))
    digests = comm.allgather(hashlib.sha256(got.tobytes()).hexdigest())
    same = len(set(digests)) == 1
    say(f"devices {comm.allgather(str(device))}; consensus vs float64 mean: {'ok' if ok else 'WRONG'}; "
        f"identical on every rank: {same}")
    times = []
    for _ in range(args.rounds):
        comm.Barrier()
        t0 = time.perf_counter()
        replica.snapshot(bridge)
        bridge.round(steps=1, window=1)
        replica.adopt(bridge)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(1e3 * comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    say(f"P = {args.params:,}: round with snapshot and adoption, median {statistics.median(times):.1f} ms, "
        f"min {min(times):.1f} ms over {args.rounds} (slowest rank)")
    bridge.close()
    return 0 if comm.allreduce(ok and same, op=MPI.LAND) else 1


if __name__ == "__main__":
    sys.exit(main())
