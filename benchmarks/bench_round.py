"""One averaging of P float32 parameters: flodl_mpi's round against the raw floor and the peers.

Run under the venv's own launcher, two ranks or more::

    mpiexec -n 2 python benchmarks/bench_round.py [--params 100000 1000000 16000000 64000000] [--repeats 7]
    mpiexec -n 2 python benchmarks/bench_round.py --quick      # seconds; the suite runs this

Each rank holds a realistic parameter set (about 50 torch tensors of varied
sizes summing to P elements, different random values per rank) and every
method averages it across the ranks:

* ``ours``: ``flodl_mpi.transport.bridge.Bridge.round(steps=1)`` in its background thread.
  ``+ copies``: the torch params are copied into the bridge's staging and back
  (the CUDA / non-float32 path). ``bound``: float32 CPU params are views of the
  staging (``replica.Replica.bind``, the CPU training path), so a round has no
  copies in or out. One bound row per wire: ``--node-reduce mpi`` (chunked
  Allreduce), ``shm`` (the shared-memory node reduce), each with ``--bf16-wire``.
  ``Reducer.reduce only``: the reduce alone (no thread, no control gather).
* raw floor: MPICH ``Allreduce(IN_PLACE)`` of a P-element float32 buffer, whole
  and in pieces of 256 KiB, 1 MiB and 4 MiB one after another (a sum, no averaging).
* peers over torch.distributed gloo (loopback): DDP-style flatten, ``all_reduce``,
  divide by world size, unflatten and copy back; and PyTorch's
  ``PeriodicModelAverager(period=1, warmup_steps=0).average_parameters``.

Methods are warmed up, then timed interleaved (repeat r runs every method once)
so drift on a noisy machine hits all of them alike. Each timed run starts after a
barrier; its time is the slowest rank's. Rank 0 prints, per P, median and min
(ms), ``x floor`` (the row's median over the raw 1 MiB pieces' median: 1.0 is the
floor) and ``PMA / row`` (how many times faster than PeriodicModelAverager).
Then, for the bridge rows, where a round's time goes (rank 0's mean ms per round
from the bridge's own profile: control gather, pack, reduce, unpack, other,
hand-off between threads), each phase's throughput in model bytes (4P) per
second against a plain copy of the same bytes measured in the same run, and the
extra memory the averaging holds per rank (its staging when not bound, its
wire buffers or its share of the shared window) over the model's float32 bytes.
Before timing, every method's result is checked once against the float64 numpy
mean of the ranks' inputs (bf16 rows: within 2**-8 relative norm).
"""

from __future__ import annotations

import argparse
import math
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

from flodl_mpi.transport import shm_in_place
from flodl_mpi.transport.bridge import Bridge
from flodl_mpi.transport.reduce import Reducer, WireOptions
from flodl_mpi.protocol.round_profile import PHASES
from flodl_mpi.transport.slice_kernel import consensus_slice, default_kernel
from flodl_mpi.protocol.wire import DEFAULT_CHUNK_ELEMS, WireLayout

MIB_ELEMS = 1 << 18  # float32 elements in 1 MiB

#: ``id`` of the in-place reducers' segment arrays whose slice pass is the one before this
#: branch's fused sweeps (``bench_slice_pass.before_pass``): the "before" row, same bits.
_BEFORE: set[int] = set()


def _dispatch_pass(segs, scales, total, a, b, step, c, partial, kernel="numba", pre_sums=False):
    if id(segs) in _BEFORE and kernel == "numba" and b > a and not pre_sums:
        from bench_slice_pass import before_pass  # this directory: the script's own

        inverse = np.float32(0.0)
        if math.frexp(float(total))[0] == 0.5 and np.finfo(np.float32).tiny <= 1.0 / float(total) < 2.0**127:
            inverse = np.float32(1.0 / float(total))
        # the float32 pass of before issue 26 item 5 (its float64 sum): float32 masses, a float32 block
        return before_pass(segs, np.asarray(scales, np.float32), np.float32(total), inverse, a, b, step,
                           c.view(np.float32), partial)
    return consensus_slice(segs, scales, total, a, b, step, c, partial, kernel, pre_sums)


shm_in_place.consensus_slice = _dispatch_pass  # bench only: the "before" row's pass beside the kept one
FLOOR = "raw: Allreduce, 1 MiB pieces"
PEER = "peer: PeriodicModelAverager (gloo)"


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


def copy_gbs(p: int, repeats: int = 5) -> float:
    """This machine's copy bandwidth: 4P bytes by ``np.copyto`` per second (best of ``repeats``), GB/s."""
    a = np.ones(p, dtype=np.float32)
    b = np.empty_like(a)
    best = min(_timed(lambda: np.copyto(b, a)) for _ in range(repeats))
    return 4 * p / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_size(comm: MPI.Comm, P: int, args, averager) -> bool:
    rank, world = comm.rank, comm.size
    say = print if rank == 0 else (lambda *a, **k: None)
    load_start = os.getloadavg()[0]
    shapes = model_shapes(P)
    gen = torch.Generator().manual_seed(1234 + rank)  # different inputs per rank
    inputs = [torch.randn(s, generator=gen) for s in shapes]
    params = [torch.nn.Parameter(t.clone()) for t in inputs]
    for p in params:  # as after a backward pass; PeriodicModelAverager skips params without .grad
        p.grad = torch.zeros_like(p)
    flat_in = np.concatenate([t.numpy().ravel() for t in inputs])
    want = np.empty(P, dtype=np.float64)  # the reference: float64 mean of the ranks' inputs
    comm.Allreduce(flat_in.astype(np.float64), want, op=MPI.SUM)
    want /= world

    # ---- the methods; each averages its params (or its own buffer) in place ------
    results, methods, bridges, extra = {}, [], {}, {}

    def add(name, fn, result, extra_bytes=None):
        methods.append((name, fn))
        results[name] = result
        if extra_bytes is not None:
            extra[name] = extra_bytes

    def reducer_bytes(b: Bridge) -> int:
        return b._p.reducer.extra_bytes + b._b.reducer.extra_bytes

    copies = Bridge(comm.Dup(), shapes, wire=WireOptions(args.node_reduce[0]))
    bridges["ours: Bridge.round + copies"] = copies

    def ours_copies():
        for dst, p in zip(copies.param_tensors, params):
            dst.copy_(p.detach())  # the snapshot
        assert copies.round(steps=1, window=1).adopted
        for p, src in zip(params, copies.param_tensors):
            p.detach().copy_(src)  # the adoption

    flat_of_params = lambda: np.concatenate([p.detach().numpy().ravel() for p in params])  # noqa: E731
    add("ours: Bridge.round + copies", ours_copies, flat_of_params, 4 * P + reducer_bytes(copies))

    wires = [(nr, bf, None, None) for nr in args.node_reduce for bf in ((False, True) if args.bf16 else (False,))]
    if "shm" in args.node_reduce:  # beside the in-place round: its variants, measured in the same run
        # --on-non-finite stop: a product setting (the params checked by the pass itself)
        extra_rows = [("shm", False, None, "stop")]
        if default_kernel() != "numpy":
            extra_rows.append(("shm", False, "numpy", None))
        if args.variants:
            extra_rows.append(("shm", False, None, "mpisync"))
            extra_rows.append(("shm", False, None, "nocheck"))
            if default_kernel() == "numba":
                extra_rows.append(("shm", False, None, "before"))
        at = wires.index(("shm", False, None, None)) + 1
        wires[at:at] = extra_rows
    for nr, bf, kernel, variant in wires:
        b = Bridge(comm.Dup(), shapes, wire=WireOptions(nr, "auto", bf),
                   on_non_finite="stop" if variant == "stop" else "quarantine")
        path = b._p.reducer.path
        if path == "shm-in-place":
            for plane in (b._p, b._b):
                if plane.reducer.staging is not None:
                    plane.reducer._impl.use_kernel(kernel or default_kernel())
                    if variant == "before":  # the compiled pass before its fused sweeps
                        _BEFORE.add(id(plane.reducer._impl.rows))
                    elif variant == "mpisync":  # before: MPI's Allgathers for the control and the partial sums
                        plane.reducer._impl.gather = None
                    elif variant == "nocheck":  # NOT a product path: what folding the check into the pass
                        plane.reducer.prepare = lambda staging: 0.0  # could save at most (see README)
            path += f", {kernel or default_kernel()} pass"
            path += {None: "", "nocheck": ", NO pre-round check", "before": ", before: unfused pass",
                     "mpisync": ", before: MPI gathers", "stop": ", --on-non-finite stop: check in the pass"}[variant]
        name = f"ours: bound, {nr}{' bf16' if bf else ''} ({path})"
        bridges[name] = b
        with torch.no_grad():  # Replica.bind: the params are views of the staging
            bound = [torch.nn.Parameter(view) for view in b.param_tensors]

        def run(b=b):
            assert b.round(steps=1, window=1).adopted

        add(name, run, lambda b=b: b._p.staging, reducer_bytes(b))
        b._bench_bound = bound

    layout = WireLayout(shapes)
    red_comm = comm.Dup()
    reducer = Reducer(red_comm, layout, WireOptions(args.node_reduce[-1]), in_place=True)
    staging = reducer.staging if reducer.staging is not None else layout.new_staging()
    only = reducer.path + (f", {reducer._impl.kernel} pass" if reducer.path == "shm-in-place" else "")
    add(f"ours: Reducer.reduce only ({only})", lambda: reducer.reduce(staging, 1.0), lambda: staging,
        reducer.extra_bytes)

    raw = np.empty(P, dtype=np.float32)
    add("raw: Allreduce, whole buffer", lambda: comm.Allreduce(MPI.IN_PLACE, [raw, MPI.FLOAT], op=MPI.SUM),
        lambda: raw / world)
    for kib in (256, 1024, 4096):
        elems = kib * 256

        def pieces(elems=elems):
            for lo in range(0, P, elems):
                comm.Allreduce(MPI.IN_PLACE, [raw[lo : lo + elems], MPI.FLOAT], op=MPI.SUM)

        add(FLOOR if kib == 1024 else f"raw: Allreduce, {kib // 1024 or kib} {'MiB' if kib >= 1024 else 'KiB'} pieces",
            pieces, lambda: raw / world)

    def gloo_flat():
        with torch.no_grad():
            tensors = [p.detach() for p in params]
            flat = _flatten_dense_tensors(tensors)
            dist.all_reduce(flat)
            flat.div_(world)
            for t, avg in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
                t.copy_(avg)

    add("peer: gloo all_reduce, flatten/unflatten", gloo_flat, flat_of_params)
    add(PEER, lambda: averager.average_parameters(params), flat_of_params)
    for b in bridges.values():
        b.start()

    # ---- correctness, once, from the original inputs -------------------------------
    def load_inputs():
        with torch.no_grad():
            for p, t in zip(params, inputs):
                p.copy_(t)
        for b in bridges.values():
            b._p.staging[:] = flat_in
        staging[:] = flat_in
        raw[:] = flat_in

    bad = []
    for name, fn in methods:
        load_inputs()
        fn()
        got = results[name]()
        if "bf16" in name:
            ok = np.linalg.norm(got - want) / np.linalg.norm(want) <= 2**-8
        else:  # atol guards cancellation (mean near 0) in a float32 sum of > 2 ranks
            ok = np.allclose(got, want, rtol=1e-5, atol=1e-6)
        if not comm.allreduce(bool(ok), op=MPI.LAND):
            bad.append(name)
    verdict = "all ok" if not bad else "FAILED: " + ", ".join(bad)
    say(f"\ncorrectness vs float64 mean (rtol 1e-5; bf16 rows 2**-8): {verdict}")

    # ---- timing ----------------------------------------------------------------
    for _, fn in methods:
        for _ in range(args.warmup):
            fn()
    before = {n: (b.profile.rounds[0], {p: b.profile.ms[p][0] for p in PHASES}) for n, b in bridges.items()}
    times = {name: [] for name, _ in methods}
    for _ in range(args.repeats):
        for name, fn in methods:
            comm.Barrier()
            dt = _timed(fn)
            times[name].append(1e3 * comm.allreduce(dt, op=MPI.MAX))  # the slowest rank
    for b in bridges.values():  # one more gather brings in the last round's ack
        b.round(steps=0, window=0)
    gbs = copy_gbs(P)

    med = {n: statistics.median(t) for n, t in times.items()}
    say(f"\nP = {P:,} float32 ({4 * P / 2**20:.1f} MiB) in {len(shapes)} tensors, {world} ranks, "
        f"{args.repeats} repeats after {args.warmup} warm-up, torch threads {torch.get_num_threads()}, "
        f"{MPI.Get_library_version().splitlines()[0].strip()}, torch {torch.__version__}; "
        f"1-min load average {load_start:.1f} before, {os.getloadavg()[0]:.1f} after ({os.cpu_count()} cores)")
    width = max(len(n) for n, _ in methods)
    say(f"{'method':<{width}}  {'median ms':>9}  {'min ms':>8}  {'x floor':>7}  {'PMA/row':>7}")
    for name, _ in methods:
        t = times[name]
        say(f"{name:<{width}}  {med[name]:9.2f}  {min(t):8.2f}  {med[name] / med[FLOOR]:7.2f}  "
            f"{med[PEER] / med[name]:7.2f}")
    best_raw = min((n for n in med if n.startswith("raw")), key=med.get)
    say(f"raw best: {best_raw} ({med[best_raw]:.2f} ms)")

    say(f"\nwhere the time goes (rank 0, mean ms per round from Bridge.profile; GB/s of the model's 4P bytes "
        f"through the phase; a plain copy of them: {gbs:.1f} GB/s)")
    say(f"{'bridge row':<{width}}  " + "  ".join(f"{p:>14}" for p in PHASES) + f"  {'extra mem':>14}")
    for name, b in bridges.items():
        n0, ms0 = before[name]
        n = b.profile.rounds[0] - n0
        cells = []
        for p in PHASES:
            ms = (b.profile.ms[p][0] - ms0[p]) / max(n, 1)
            rate = 4 * P / (ms / 1e3) / 1e9 if ms > 0 and p in ("pack", "allreduce", "unpack") else None
            cells.append(f"{ms:7.2f}" + (f" {rate:5.1f}G" if rate is not None else "       "))
        mem = extra[name]
        say(f"{name:<{width}}  " + "  ".join(cells) + f"  {mem / 2**20:7.1f}M {mem / (4 * P):4.2f}x")

    for b in bridges.values():
        b.close()
    reducer.free()
    red_comm.Free()
    return not bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, nargs="+", default=[16_000_000], help="P, float32 elements in all")
    ap.add_argument("--repeats", type=int, default=7, help="timed runs per method")
    ap.add_argument("--warmup", type=int, default=2, help="untimed runs per method first")
    ap.add_argument("--node-reduce", nargs="+", default=["mpi", "shm"], choices=["mpi", "shm"],
                    help="wires of the bound rows (the first also for the copies row)")
    ap.add_argument("--no-bf16", dest="bf16", action="store_false", help="skip the --bf16-wire rows")
    ap.add_argument("--no-variants", dest="variants", action="store_false",
                    help="skip the in-place round's variant rows (no pre-round check; the unfused pass)")
    ap.add_argument("--quick", action="store_true", help="P = 100,000, 1 repeat, 1 warm-up: a smoke test")
    args = ap.parse_args()
    if args.quick:
        args.params, args.repeats, args.warmup = [100_000], 1, 1

    comm = MPI.COMM_WORLD
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    if comm.size < 2:
        say("run with mpiexec -n 2 (or more); a world of 1 has nothing to average", file=sys.stderr)
        return 2
    if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
        say("MPI gave less than THREAD_SERIALIZED: the threaded bridge cannot run", file=sys.stderr)
        return 2
    say(f"default chunk {DEFAULT_CHUNK_ELEMS} elements; OPENBLAS_NUM_THREADS="
        f"{os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}")
    init_gloo(comm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "period 1: use DDP instead"; that is the point here
        averager = PeriodicModelAverager(period=1, warmup_steps=0)
    ok = all([bench_size(comm, P, args, averager) for P in args.params])
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
