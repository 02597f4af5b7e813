"""One averaging of P float32 parameters: flodl_mpi's round against the raw floor and the peers.

Run under the venv's own launcher, two ranks or more::

    mpiexec -n 2 python benchmarks/bench_round.py [--params 16000000] [--repeats 10] [--chunk-elems N ...]

Each rank holds a realistic parameter set (about 50 torch tensors of varied
sizes summing to ``--params`` elements, different random values per rank) and
every method averages it across the ranks:

* ``ours``: ``flodl_mpi.bridge.Bridge.round(steps=1)`` in its background thread,
  plus the copy of the torch params into the bridge's staging and back: what a
  training round really pays. One row per chunk size (the default, then each
  ``--chunk-elems``). A second row, ``sumcount_reduce only``, calls
  ``flodl_mpi.reduce.sumcount_reduce`` directly on the same kind of persistent
  buffers (no thread, no control gather, no torch copies). ``params bound`` is
  the CPU training path: float32 CPU params are views of the bridge's staging
  (``flodl_mpi.worker.Replica.bind``), so a round has no copies in or out.
* raw floor: one MPICH ``Allreduce(IN_PLACE)`` of a P-element float32 buffer,
  and the same buffer as 1 MiB pieces one after another (a sum, no averaging).
* peers over torch.distributed gloo (loopback): DDP-style flatten, ``all_reduce``,
  divide by world size, unflatten and copy back; and PyTorch's
  ``PeriodicModelAverager(period=1, warmup_steps=0).average_parameters``.

Methods are warmed up, then timed interleaved (repeat r runs every method once)
so drift on a noisy machine hits all of them alike. Each timed run starts after a
barrier; its time is the slowest rank's. Rank 0 prints median and min (ms) and
``x ours``: a row's median over the median of ``ours`` at the default chunk, i.e.
how many times faster ours is than that row. Before timing, every method's
result is checked once against the float64 numpy mean of the ranks' inputs.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

from flodl_mpi.bridge import Bridge
from flodl_mpi.reduce import sumcount_reduce
from flodl_mpi.wire import DEFAULT_CHUNK_ELEMS, WireLayout

MIB_ELEMS = 1 << 18  # float32 elements in 1 MiB


def model_shapes(p: int, n_layers: int = 25, seed: int = 0) -> list[tuple[int, ...]]:
    """``2 * n_layers`` shapes (a weight matrix and its bias per layer) summing to ``p`` elements.

    Weight sizes are log-normal (a few big layers, many small ones, like real
    models); the same on every rank since the seed is fixed.
    """
    rng = np.random.default_rng(seed)
    bias = max(1, min(1024, p // (20 * n_layers)))
    weights = p - n_layers * bias
    rel = rng.lognormal(0.0, 1.0, n_layers)
    sizes = np.floor(weights * rel / rel.sum()).astype(np.int64)
    sizes[-1] += weights - sizes.sum()
    shapes: list[tuple[int, ...]] = []
    for s in sizes.tolist():
        shapes.append((s // bias, bias) if s % bias == 0 else (s,))
        shapes.append((bias,))
    assert sum(int(np.prod(s)) for s in shapes) == p
    return shapes


def init_gloo(comm: MPI.Comm) -> None:
    """A gloo process group over loopback, rank and size taken from MPI."""
    port = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=comm.rank, world_size=comm.size)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=16_000_000, help="P, float32 elements in all")
    ap.add_argument("--repeats", type=int, default=10, help="timed runs per method")
    ap.add_argument("--warmup", type=int, default=2, help="untimed runs per method first")
    ap.add_argument("--chunk-elems", type=int, nargs="*", default=[], help="extra chunk sizes for ours")
    args = ap.parse_args()

    comm = MPI.COMM_WORLD
    rank, world = comm.rank, comm.size
    say = print if rank == 0 else (lambda *a, **k: None)
    if world < 2:
        say("run with mpiexec -n 2 (or more); a world of 1 has nothing to average", file=sys.stderr)
        return 2
    if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
        say("MPI gave less than THREAD_SERIALIZED: the threaded bridge cannot run", file=sys.stderr)
        return 2

    shapes = model_shapes(args.params)
    gen = torch.Generator().manual_seed(1234 + rank)  # different inputs per rank
    inputs = [torch.randn(s, generator=gen) for s in shapes]
    params = [torch.nn.Parameter(t.clone()) for t in inputs]
    for p in params:  # as after a backward pass; PeriodicModelAverager skips params without .grad
        p.grad = torch.zeros_like(p)

    # The reference: float64 mean of the ranks' inputs.
    flat_in = np.concatenate([t.numpy().ravel() for t in inputs]).astype(np.float64)
    want = np.empty_like(flat_in)
    comm.Allreduce(flat_in, want, op=MPI.SUM)
    want /= world
    del flat_in

    init_gloo(comm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "period 1: use DDP instead"; that is the point here
        averager = PeriodicModelAverager(period=1, warmup_steps=0)

    # ---- the methods; each averages ``params`` (or its own buffer) in place ------
    chunks = [DEFAULT_CHUNK_ELEMS] + [c for c in args.chunk_elems if c != DEFAULT_CHUNK_ELEMS]
    bridges = {}
    for c in chunks:
        bridges[c] = Bridge(comm.Dup(), shapes, chunk_elems=c)
        bridges[c].start()

    def ours(bridge: Bridge):
        def run():
            for dst, p in zip(bridge.param_tensors, params):
                dst.copy_(p.detach())  # the snapshot
            update = bridge.round(steps=1, window=1)
            assert update.adopted
            for p, src in zip(params, bridge.param_tensors):
                p.detach().copy_(src)  # the adoption
        return run

    # The CPU training path: flodl_mpi.worker.Replica.bind makes float32 CPU params
    # views of the bridge's staging, so there is no snapshot or adoption copy.
    bound_bridge = Bridge(comm.Dup(), shapes)
    bound_bridge.start()
    bound_params = [torch.nn.Parameter(t.clone()) for t in inputs]
    with torch.no_grad():
        for p, view in zip(bound_params, bound_bridge.param_tensors):
            view.copy_(p)
            p.data = view

    def ours_bound():
        update = bound_bridge.round(steps=1, window=1)
        assert update.adopted

    red_comm = comm.Dup()
    layout = WireLayout(shapes)
    staging, frame, scratch = layout.new_staging(), layout.new_frame(), layout.new_scratch()
    last_stats = []

    def reduce_only():
        last_stats.append(sumcount_reduce(red_comm, layout, staging, frame, 1.0, scratch))

    raw = np.empty(args.params, dtype=np.float32)

    def raw_whole():
        comm.Allreduce(MPI.IN_PLACE, [raw, MPI.FLOAT], op=MPI.SUM)

    def raw_pieces():
        for lo in range(0, raw.size, MIB_ELEMS):
            comm.Allreduce(MPI.IN_PLACE, [raw[lo : lo + MIB_ELEMS], MPI.FLOAT], op=MPI.SUM)

    def gloo_flat():
        with torch.no_grad():
            tensors = [p.detach() for p in params]
            flat = _flatten_dense_tensors(tensors)
            dist.all_reduce(flat)
            flat.div_(world)
            for t, avg in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
                t.copy_(avg)

    def gloo_averager():
        averager.average_parameters(params)

    methods = [(f"ours: Bridge.round + copies, chunk {c}", ours(b)) for c, b in bridges.items()]
    methods += [
        ("ours: Bridge.round, params bound (CPU)", ours_bound),
        (f"ours: sumcount_reduce only, chunk {DEFAULT_CHUNK_ELEMS}", reduce_only),
        ("raw: MPICH Allreduce, whole buffer", raw_whole),
        ("raw: MPICH Allreduce, 1 MiB pieces", raw_pieces),
        ("peer: gloo all_reduce, flatten/unflatten", gloo_flat),
        ("peer: PeriodicModelAverager (gloo)", gloo_averager),
    ]

    # ---- correctness, once, from the original inputs -------------------------------
    def load_inputs():
        with torch.no_grad():
            for p, t in zip(params, inputs):
                p.copy_(t)
            for p, t in zip(bound_params, inputs):
                p.copy_(t)
        staging[:] = np.concatenate([t.numpy().ravel() for t in inputs])
        raw[:] = staging

    def result(name: str) -> np.ndarray:
        if name.startswith("raw"):
            return raw / world  # a plain sum; the average is one divide away
        if "sumcount" in name:
            return staging
        if "bound" in name:
            return np.concatenate([p.detach().numpy().ravel() for p in bound_params])
        return np.concatenate([p.detach().numpy().ravel() for p in params])

    bad = []
    for name, fn in methods:
        load_inputs()
        fn()
        # atol guards cancellation (mean near 0) in a float32 sum of > 2 ranks.
        ok = np.allclose(result(name), want, rtol=1e-5, atol=1e-6)
        if not comm.allreduce(ok, op=MPI.LAND):
            bad.append(name)
    say(f"correctness vs float64 mean (rtol 1e-5): {'all ok' if not bad else 'FAILED: ' + ', '.join(bad)}")

    # ---- timing ----------------------------------------------------------------
    for _, fn in methods:
        for _ in range(args.warmup):
            fn()
    times = {name: [] for name, _ in methods}
    last_stats.clear()
    for _ in range(args.repeats):
        for name, fn in methods:
            comm.Barrier()
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            times[name].append(1e3 * comm.allreduce(dt, op=MPI.MAX))  # the slowest rank

    base = statistics.median(times[methods[0][0]])
    say(
        f"\nP = {args.params:,} float32 ({4 * args.params / 2**20:.1f} MiB) in {len(shapes)} tensors, "
        f"{world} ranks, {args.repeats} repeats after {args.warmup} warm-up, torch threads "
        f"{torch.get_num_threads()}, {MPI.Get_library_version().splitlines()[0].strip()}, torch {torch.__version__}, "
        f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}"
    )
    width = max(len(n) for n, _ in methods)
    say(f"{'method':<{width}}  {'median ms':>9}  {'min ms':>8}  {'x ours':>6}")
    for name, _ in methods:
        t = times[name]
        say(f"{name:<{width}}  {statistics.median(t):9.1f}  {min(t):8.1f}  {statistics.median(t) / base:6.2f}")
    parts = {k: statistics.median(getattr(s, k) for s in last_stats) for k in ("pack_ms", "allreduce_ms", "unpack_ms")}
    say("sumcount_reduce phases (rank 0, median ms): " + ", ".join(f"{k[:-3]} {v:.1f}" for k, v in parts.items()))

    for b in [*bridges.values(), bound_bridge]:
        b.close()
    red_comm.Free()
    dist.destroy_process_group()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
