"""The round across two real hosts over a capped link: ours against MPI's own Allreduce and the bandwidth bound.

Run as root (it makes the hosts: tests/multinode/cluster.py), under either venv's MPI::

    python benchmarks/multinode.py [--rates 1gbit 10gbit] [--params 1000000 16000000 64000000] [--repeats 3]

For each link rate a cluster of 2 hosts x 2 ranks is made (each host's ``eth0`` capped by ``tc ... tbf``) and
one launch times, for each P (float32 parameters, one tensor, different values per rank):

* ``hier``: :class:`flodl_mpi.transport.reduce.Reducer` with ``node_reduce shm, hierarchical on`` (the node
  sum in shared memory, then the node leaders' Allgather of the float32 node means and float64 masses,
  ``flodl_mpi/transport/leaders.py``; before issue 25 item 4, an Allreduce of the float64 node sums);
* ``hier bf16``: the same with ``--bf16-wire``;
* ``flat``: ``node_reduce mpi, hierarchical off`` (the chunked float64 Allreduce over all four ranks);
* ``flat bf16``: the bf16 Allgather over all four ranks;
* ``MPI f32``: ``Allreduce(IN_PLACE)`` of the P float32 values across the four ranks (MPI's own, a sum only).

Each timed run starts after a barrier; its time is the slowest rank's; the median of ``--repeats`` is printed
after one warm-up. ``bound`` is ``2 (W_nodes - 1) / W_nodes * 4P / rate``: the time the leaders' exchange of
the float32 model needs at the link rate (W_nodes = 2). ``link MB/host/round``: the bytes each host sent on its
link per round (its ``eth0`` tx counter, read by the host's first rank before and after the timed runs),
averaged over the two hosts. Timings on this shared 2-core machine are noisy; compare the rows of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ROWS = ("hier", "hier bf16", "flat", "flat bf16", "MPI f32")


def _tx_bytes() -> int:
    """This process's network namespace's ``eth0`` tx bytes (/proc/net/dev is per namespace)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == "eth0":
            return int(counters.split()[8])
    raise RuntimeError("no eth0 in this network namespace")


def worker(params: list[int], repeats: int) -> None:
    """One rank: every row at every P; rank 0 prints one JSON line per (P, row)."""
    import numpy as np
    from mpi4py import MPI

    from flodl_mpi.protocol.wire import WireLayout
    from flodl_mpi.transport.reduce import Reducer, WireOptions

    comm = MPI.COMM_WORLD
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    first_on_host = node.rank == 0
    node.Free()
    options = {
        "hier": WireOptions("shm", "on", False),
        "hier bf16": WireOptions("shm", "on", True),
        "flat": WireOptions("mpi", "off", False),
        "flat bf16": WireOptions("mpi", "off", True),
    }
    for P in params:
        rng = np.random.default_rng(comm.rank)
        mine = rng.standard_normal(P).astype(np.float32)
        for row in ROWS:
            red = None
            if row == "MPI f32":
                buf = mine.copy()

                def once():
                    buf[:] = mine
                    comm.Allreduce(MPI.IN_PLACE, [buf, MPI.FLOAT], op=MPI.SUM)
            else:
                red = Reducer(comm, WireLayout([(P,)]), options[row])
                staging = mine.copy()

                def once():
                    staging[:] = mine
                    red.reduce(staging, 1.0)

            once()  # warm-up
            times = []
            tx0 = _tx_bytes()
            for _ in range(repeats):
                comm.Barrier()
                t = time.perf_counter()
                once()
                times.append(comm.allreduce(time.perf_counter() - t, op=MPI.MAX))
            sent = _tx_bytes() - tx0 if first_on_host else 0
            per_host = comm.allreduce(sent, op=MPI.SUM) / 2 / repeats  # two hosts
            if red is not None:
                path = red.path
                red.free()
            else:
                path = "MPI_Allreduce"
            if comm.rank == 0:
                print(
                    "BENCH "
                    + json.dumps(
                        {"P": P, "row": row, "path": path, "ms": 1e3 * statistics.median(times), "link_bytes": per_host}
                    ),
                    flush=True,
                )


def _rate_bits(rate: str) -> float:
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}
    for u, f in units.items():
        if rate.endswith(u):
            return float(rate[: -len(u)]) * f
    raise SystemExit(f"multinode.py: rate {rate!r} is not NNgbit / NNmbit")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", nargs="+", default=["1gbit", "10gbit"])
    p.add_argument("--params", nargs="+", type=int, default=[1_000_000, 16_000_000, 64_000_000])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.params, args.repeats)
        return 0
    sys.path.insert(0, str(ROOT))
    from tests.conftest import MPIEXEC, launch_env, launcher_kind
    from tests.multinode.cluster import Cluster, host_names, unavailable

    why = unavailable()
    if why:
        print(f"multinode.py: {why}", file=sys.stderr)
        return 2
    env = launch_env({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    kind = launcher_kind()
    print(f"2 hosts x 2 ranks, {kind}; median of {args.repeats} after a warm-up; ms per round (slowest rank)")
    for rate in args.rates:
        bps = _rate_bits(rate) / 8
        with Cluster(host_names(2), rate=rate) as cluster:
            argv = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--worker",
                "--repeats",
                str(args.repeats),
                "--params",
                *map(str, args.params),
            ]
            r = cluster.launch(kind, MPIEXEC, 2, argv, env, timeout=1800)
        if r.returncode != 0:
            print(r.stdout[-3000:], r.stderr[-3000:], file=sys.stderr)
            return 1
        rows = [json.loads(line[6:]) for line in r.stdout.splitlines() if line.startswith("BENCH ")]
        print(f"\nlink {rate} per host")
        print(
            f"{'P':>10} {'row':<10} {'path':<16} {'ms':>9} {'x bound':>8} {'x MPI f32':>9} {'link MB/host/round':>19}"
        )
        for P in args.params:
            bound = 2 * (2 - 1) / 2 * 4 * P / bps * 1e3
            mpi = next(x["ms"] for x in rows if x["P"] == P and x["row"] == "MPI f32")
            for x in (x for x in rows if x["P"] == P):
                print(
                    f"{P:>10} {x['row']:<10} {x['path']:<16} {x['ms']:>9.1f} {x['ms'] / bound:>8.2f} "
                    f"{x['ms'] / mpi:>9.2f} {x['link_bytes'] / 1e6:>19.1f}"
                )
            print(
                f"{P:>10} {'bound':<10} {'':<16} {bound:>9.1f} {'':>8} {'':>9} {2 * (2 - 1) / 2 * 4 * P / 1e6:>19.1f}"
            )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
