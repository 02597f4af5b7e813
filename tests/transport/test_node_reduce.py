"""Every reduce path of :class:`flodl_mpi.transport.reduce.Reducer` against a float64 numpy reference (issue 9).

Paths: the chunked float32 Allreduce, the shared-memory node reduce, both
hierarchical forms (simulated nodes: COMM_WORLD split into groups of ranks on
this machine), and the bf16 wire (flat Allgather and shared memory). Run at 2, 3
and 4 ranks under ``mpiexec ... --with-mpi``.
"""

import hashlib

import numpy as np
import pytest
import torch
from mpi4py import MPI

from flodl_mpi.transport.node_reduce import slices
from flodl_mpi.protocol.realized_work import gamma_mass
from flodl_mpi.transport.reduce import Reducer, WireOptions
from flodl_mpi.transport.slice_kernel import KERNELS
from flodl_mpi.protocol.wire import WireLayout

pytestmark = pytest.mark.mpi

SHAPES = [(17, 5), (5,), (3, 3, 3), (1,), (40,), (33,)]
#: A frame of 10 elements: one 16-element block, so at W >= 2 every rank but the first has an empty slice of
#: the in-place reduce (as the last rank has with SHAPES' 191 elements at W = 5, 7, 8).
TINY = [(3,), (2, 2), (3,)]

# (node_reduce, hierarchical, bf16, simulated node size or None for the machine's[, in place: its slice kernel])
PATHS = [
    ("shm", "off", False, None, "numba"),
    ("shm", "auto", False, None, "numba"),
    ("shm", "off", False, None, "numpy"),
    ("mpi", "off", False, None),
    ("shm", "off", False, None),
    ("shm", "auto", False, None),
    ("shm", "on", False, 2),
    ("shm", "on", False, 1),
    ("mpi", "on", False, 2),
    ("mpi", "off", True, None),
    ("shm", "off", True, None),
    ("shm", "on", True, 2),
]
IDS = [f"{a}-{b}{'-bf16' if c else ''}{f'-nodes-of-{d}' if d else ''}{f'-in-place-{e[0]}' if e else ''}"
       for a, b, c, d, *e in PATHS]


@pytest.fixture
def comm():
    c = MPI.COMM_WORLD.Dup()
    yield c
    c.Free()


def make(comm, path, chunk, shapes=SHAPES):
    node_reduce, hier, bf16, node_size, *in_place = path
    layout = WireLayout(shapes, chunk_elems=chunk)
    node = comm.Split(comm.rank // node_size, key=comm.rank) if node_size else None
    red = Reducer(comm, layout, WireOptions(node_reduce, hier, bf16), node_comm=node, in_place=bool(in_place))
    assert (red.staging is not None) == bool(in_place) and (red.path == "shm-in-place") == bool(in_place)
    if in_place:
        red._impl.use_kernel(in_place[0])
    return layout, red


def stage(red, values):
    """The array a round works in: the reducer's own staging (in place) holding ``values``, else ``values``."""
    if red.staging is None:
        return values
    red.staging[:] = values
    return red.staging


def reduce(red, staging, mass, masses, prepared):
    """One round as the bridge runs it (``prepared``: the pre-round pass, then the reduce given every mass)."""
    if not prepared:
        return red.reduce(staging, mass)
    pre_sq = red.prepare(staging)
    with np.errstate(invalid="ignore", over="ignore"):
        want = float(np.sum(staging.astype(np.float64) ** 2))
    assert pre_sq == pytest.approx(want, rel=1e-5, nan_ok=True)
    gathered = red.comm.allgather(mass)  # the control gather: every rank prepared before anyone sums
    assert gathered == list(masses)
    return red.reduce(staging, mass, gathered)


def across_nodes(path, W: int) -> bool:
    """The path's round crosses simulated nodes: the leaders exchange float32 (or bf16) node means."""
    return path[1] != "off" and path[3] is not None and W > path[3]


def rank_flat(r: int, shapes=SHAPES) -> np.ndarray:
    rng = np.random.default_rng(1000 + r)
    return np.concatenate([rng.standard_normal(s).astype(np.float32).ravel() for s in shapes])


def edge_positions(n: int, W: int, extra=()) -> list[int]:
    """Where a non-finite value is put: ``extra``, the frame's ends, and the first and last element of each
    non-empty slice of the in-place reduce and the one after it. A slice may be empty (the last ranks' when
    the frame has fewer 16-element blocks than ranks: 191 elements at W = 5); it has no element to name."""
    edges = {0, n - 1, *extra}
    for a, b in slices(n, W):
        if b > a:
            edges |= {a, b - 1, min(b, n - 1)}
    return sorted(p for p in edges if 0 <= p < n)


def test_edge_positions_name_only_elements_of_the_frame():
    # The hand-made positions of the non-finite tests at any world size: before, an empty last slice
    # (191 elements at W = 5) gave position 191, an IndexError on that rank alone (the others then
    # waited in the round's collective).
    for n, W in [(191, 5), (191, 7), (191, 8), (10, 2), (10, 3), (1, 4), (191, 2), (191, 3)]:
        got = edge_positions(n, W, (6, 7, 8))
        assert got == sorted(set(got)) and all(0 <= p < n for p in got)
        for a, b in slices(n, W):
            if b > a:
                assert {a, b - 1} <= set(got)
    assert edge_positions(191, 5) == [0, 47, 48, 95, 96, 143, 144, 190]


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 -> float32, round to nearest even (torch's conversion, checked below)."""
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(torch.bfloat16).float().numpy()


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def test_slices_cover_the_frame_on_aligned_bounds():
    for size, parts in [(1, 1), (1, 4), (100, 3), (1 << 20, 7), (33, 2)]:
        s = slices(size, parts)
        assert len(s) == parts and s[0][0] == 0 and s[-1][1] == size
        assert all(a == b_prev for (a, _), (_, b_prev) in zip(s[1:], s[:-1]))
        assert all(a % 16 == 0 for a, _ in s if a < size)


@pytest.mark.parametrize("prepared", [False, True], ids=["packed", "prepared"])
@pytest.mark.parametrize("chunk", [3, 64, 1 << 18])
@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_consensus_equals_float64_reference(comm, path, chunk, prepared):
    # Unequal masses (gamma 0.5 of unequal steps); with 3+ ranks the last rank is idle.
    W = comm.size
    steps = [3 + 2 * r for r in range(W)]
    if W >= 3:
        steps[-1] = 0
    masses = [gamma_mass(n, 0.5) for n in steps]
    layout, red = make(comm, path, chunk)
    try:
        staging = stage(red, rank_flat(comm.rank))
        pre = staging.astype(np.float64)
        stats = reduce(red, staging, masses[comm.rank], masses, prepared)
    finally:
        red.free()
    flats = [rank_flat(r) for r in range(W)]
    total = sum(masses)
    if path[2]:  # bf16: what travels is bf16(θ), scaled by W·m where it is summed; sums and the divide in float64
        ref = sum(W * m * bf16_round(f).astype(np.float64) for m, f in zip(masses, flats) if m) / (W * total)
        exact = sum(m * f.astype(np.float64) for m, f in zip(masses, flats)) / total
        # bf16 keeps 8 significant bits: the consensus is within 2**-8 of the exact one
        assert np.linalg.norm(staging - exact) / np.linalg.norm(exact) <= 2**-8
    else:
        ref = sum(m * f.astype(np.float64) for m, f in zip(masses, flats)) / total
    tol = 1e-7  # float64 sums and divide, one rounding to float32 (2**-24 relative at most)
    assert stats.realized and stats.post_finite
    if across_nodes(path, W):
        # The leaders exchange each node's mean rounded once (float32: 2**-24 relative; bf16: rounded from
        # that float32, 2**-8 + 2**-24), weighted by the node's share of the mass, then the consensus is rounded
        # to float32 once: |err_i| <= u·Σ_r w_r·|x_r,i| + 2**-24·|ref_i| (w_r = m_r / Σ m, the triangle
        # inequality over each node's mean), in norm with 0.1% headroom for the float64 steps.
        u = 2.0**-8 + 2.0**-24 if path[2] else 2.0**-24
        xs = [bf16_round(f) if path[2] else f for f in flats]
        a = sum(m / total * np.abs(x.astype(np.float64)) for m, x in zip(masses, xs))
        bound = 1.001 * (u * np.linalg.norm(a) + 2.0**-24 * np.linalg.norm(ref))
        assert np.linalg.norm(staging - ref) <= bound
        assert np.linalg.norm(staging - ref) / np.linalg.norm(ref) <= (2**-7 if path[2] else 4e-7)
        # the link carries the node's mean (4 bytes a value, bf16 2) and its float64 mass, among the leaders
        assert red.link == ((2 if path[2] else 4) * layout.n + 8, -(-W // path[3]))
    else:
        assert np.linalg.norm(staging - ref) / np.linalg.norm(ref) <= tol
    assert stats.total_mass == pytest.approx(W * total, rel=1e-6)
    # the sums of squares are of the consensus delivered (across nodes it differs from ref beyond 1e-5 with bf16)
    post = staging.astype(np.float64) if across_nodes(path, W) else ref
    assert stats.post_sq == pytest.approx(float(np.sum(post**2)), rel=1e-5)
    assert stats.diff_sq == pytest.approx(float(np.sum((pre - post) ** 2)), rel=1e-3)
    assert len(set(comm.allgather(digest(staging)))) == 1  # identical bits on every rank
    if red.staging is not None:  # the own segment outlives free(): bound parameters live there
        staging += 1.0
        assert np.isfinite(staging).all()


@pytest.mark.parametrize("prepared", [False, True], ids=["packed", "prepared"])
@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_idle_rank_with_nan_sends_true_zeros(comm, path, prepared):
    layout, red = make(comm, path, 50)
    idle = comm.size - 1
    staging = stage(red, np.full(layout.n, 1.0 + comm.rank, dtype=np.float32))
    if comm.rank == idle:
        staging[:] = np.nan
    try:
        masses = [0.0 if r == idle else 1.0 for r in range(comm.size)]
        stats = reduce(red, staging, masses[comm.rank], masses, prepared)
    finally:
        red.free()
    movers = [1.0 + r for r in range(comm.size) if r != idle]
    np.testing.assert_allclose(staging, np.mean(movers), rtol=1e-7)
    assert stats.realized and stats.post_finite


@pytest.mark.parametrize("prepared", [False, True], ids=["packed", "prepared"])
@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_all_idle_keeps_local_tensors_over_several_rounds(comm, path, prepared):
    layout, red = make(comm, path, 16)
    try:
        for round_ in range(3):  # the window's segments are reused round after round
            staging = stage(red, np.full(layout.n, comm.rank + 0.5 + round_, dtype=np.float32))
            stats = reduce(red, staging, 0.0, [0.0] * comm.size, prepared)
            assert not stats.realized and stats.total_mass == 0.0
            assert np.all(staging == comm.rank + 0.5 + round_)
            staging[:] = 2.0 * comm.rank + round_
            stats = reduce(red, staging, 1.0, [1.0] * comm.size, prepared)  # and a realized round in between
            np.testing.assert_allclose(staging, np.mean([2.0 * r + round_ for r in range(comm.size)]), rtol=1e-6)
    finally:
        red.free()


@pytest.mark.parametrize("prepared", [False, True], ids=["packed", "prepared"])
@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_a_non_finite_reduced_piece_is_never_unpacked(comm, path, prepared):
    # Rank 0 (mass > 0) sends an inf in the first piece: every rank stops before
    # unpacking it; the pieces unpacked before it (last to first) hold the consensus.
    layout, red = make(comm, path, 16)
    staging = stage(red, np.full(layout.n, 1.0 + comm.rank, dtype=np.float32))
    if comm.rank == 0:
        staging[3] = np.inf
    before = staging.copy()
    try:
        stats = reduce(red, staging, 1.0, [1.0] * comm.size, prepared)
    finally:
        red.free()
    assert stats.realized and not stats.post_finite
    lo = layout.chunks[0][1]
    np.testing.assert_array_equal(staging[:lo], before[:lo])
    np.testing.assert_allclose(staging[lo:], np.mean([1.0 + r for r in range(comm.size)]), rtol=1e-6)


def test_shm_without_hierarchy_across_nodes_is_refused_on_every_rank(comm):
    if comm.size < 2:
        pytest.skip("needs two simulated nodes")
    layout = WireLayout(SHAPES)
    node = comm.Split(comm.rank, key=comm.rank)  # every rank its own node
    with pytest.raises(ValueError, match="needs the world on one node, it spans"):
        Reducer(comm, layout, WireOptions("shm", "off"), node_comm=node)


def test_bf16_rounding_is_nearest_even_and_keeps_nan():
    # The torch conversion the wire uses, checked bit by bit against the rule.
    x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-8 + 2**-20, np.nan, -np.inf, 3.4e38],
                 dtype=np.float32)
    got = bf16_round(x)
    want = np.array([1.0, 1.0, 1.0 + 4 * 2**-8, 1.0 + 2 * 2**-8, np.nan, -np.inf, np.inf], dtype=np.float32)
    np.testing.assert_array_equal(got, want)


def test_auto_resolves_the_same_on_every_rank_and_shm_is_refused_without_room(comm, monkeypatch):
    import flodl_mpi.transport.reduce as reduce_mod

    layout = WireLayout(SHAPES)
    red = Reducer(comm, layout, WireOptions("auto"))
    try:
        assert red.node_reduce == "shm" and len(set(comm.allgather(red.path))) == 1
    finally:
        red.free()
    # /dev/shm too small on one rank's node: auto falls back to mpi everywhere, shm is refused everywhere
    monkeypatch.setattr(reduce_mod, "_shm_free", lambda: 1024 if comm.rank == comm.size - 1 else None)
    red = Reducer(comm, layout, WireOptions("auto"))
    try:
        assert red.node_reduce == "mpi" and red.path == "allreduce"
    finally:
        red.free()
    with pytest.raises(ValueError, match=r"node_reduce 'shm' needs about \d+ MiB of shared memory \(/dev/shm\)"):
        Reducer(comm, layout, WireOptions("shm"))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("equal", [False, True], ids=["unequal", "equal"])
@pytest.mark.parametrize("chunk", [3, 64, 1 << 18])
def test_in_place_equals_the_packing_shm_reduce_bit_for_bit(comm, chunk, equal, kernel):
    # The same float64 operations in the same order (scale, add in rank order, one
    # divide, one rounding to float32; equal masses at W = 2, 4: a power-of-two total,
    # divided by multiplying):
    # the in-place reduce and the packing one give the same bits.
    W = comm.size
    masses = [gamma_mass(1 + 3 * r, 0.5) if r != 1 else 0.0 for r in range(W)]  # rank 1 idle
    if equal:
        masses = [1.0] * W
    outs = []
    for in_place in (False, True):
        layout = WireLayout(SHAPES, chunk_elems=chunk)
        red = Reducer(comm, layout, WireOptions("shm", "off"), in_place=in_place)
        if in_place:
            red._impl.use_kernel(kernel)
        try:
            staging = stage(red, rank_flat(comm.rank))
            stats = reduce(red, staging, masses[comm.rank], masses, prepared=True)
            outs.append((staging.copy(), stats))
        finally:
            red.free()
    (a, sa), (b, sb) = outs
    assert a.tobytes() == b.tobytes()
    assert sb.total_mass == sa.total_mass and sb.realized and sb.post_finite
    assert sb.post_sq == pytest.approx(sa.post_sq, rel=1e-6)
    assert sb.diff_sq == pytest.approx(sa.diff_sq, rel=1e-5)


def test_in_place_leaves_no_file_and_refuses_a_foreign_staging(comm):
    import os

    from flodl_mpi.transport.shm_in_place import SHM_DIR

    layout = WireLayout(SHAPES)
    red = Reducer(comm, layout, WireOptions("shm"), in_place=True)
    try:
        # node rank 0 (this world's rank 0) made the file, named with its pid; it is gone already
        ours = f"flodl_mpi_{os.getpid()}_"
        assert not [f for f in os.listdir(SHM_DIR) if f.startswith(ours)]
        with pytest.raises(ValueError, match="works on its own staging"):
            red.reduce(np.zeros(layout.n, np.float32), 1.0, [1.0] * comm.size)
    finally:
        red.free()


def test_in_place_falls_back_alike_when_one_rank_has_no_shm_dir(comm, monkeypatch):
    import flodl_mpi.transport.shm_in_place as mod

    if comm.rank == comm.size - 1:
        monkeypatch.setattr(mod, "SHM_DIR", "/nonexistent/flodl-shm")
    red = Reducer(comm, WireLayout(SHAPES), WireOptions("shm"), in_place=True)
    try:
        assert red.staging is None and red.path == "shm"  # the packing reduce, on every rank
    finally:
        red.free()


def test_in_place_is_taken_only_when_every_rank_asks(comm):
    # A mixed cohort: a GPU rank's pinned staging does not ask for it (bridge._Plane).
    red = Reducer(comm, WireLayout(SHAPES), WireOptions("shm"), in_place=comm.rank != comm.size - 1)
    try:
        assert red.staging is None and red.path == "shm"
        staging = rank_flat(comm.rank)
        masses = [1.0] * comm.size
        reduce(red, staging, 1.0, masses, prepared=True)
    finally:
        red.free()
    ref = sum(rank_flat(r).astype(np.float64) for r in range(comm.size)) / comm.size
    assert np.linalg.norm(staging - ref) / np.linalg.norm(ref) <= 1e-6


def test_a_failed_shared_file_raises_on_every_rank_naming_the_rank(comm, monkeypatch):
    import errno
    import os

    def full(*a):
        raise OSError(errno.ENOSPC, "No space left on device")

    if comm.rank == comm.size - 1:
        monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match=rf"failed on node rank\(s\) {comm.size - 1}: OSError: .*No space left"):
        Reducer(comm, WireLayout(SHAPES), WireOptions("shm"), in_place=True)


@pytest.mark.parametrize("shapes", [SHAPES, TINY], ids=["frame", "tiny-frame"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_in_place_check_finds_a_non_finite_value_anywhere_and_the_quarantine_round_is_exact(comm, bad, shapes):
    # The pre-round check reads the segment piece by piece: a value at any position (each
    # slice's first and last element, piece edges, the frame's ends) of any rank is seen by
    # that rank's check only; the round that quarantines the rank (mass 0, as the bridge
    # decides from the gathered flags) equals the float64 mean of the others, is finite
    # (the bad value is never written anywhere) and gives every rank the same bits. The tiny
    # frame gives ranks an empty slice at 2 and 3 ranks already (SHAPES: at 5).
    W = comm.size
    layout = WireLayout(shapes, chunk_elems=7)
    red = Reducer(comm, layout, WireOptions("shm", "off"), in_place=True)
    try:
        n = layout.n
        for r in range(W):
            for pos in edge_positions(n, W, (6, 7, 8)):
                flat = rank_flat(comm.rank, shapes)
                if comm.rank == r:
                    flat[pos] = bad
                staging = stage(red, flat)
                pre_sq = red.prepare(staging)
                flags = comm.allgather(not np.isfinite(pre_sq))  # the control gather
                assert flags == [q == r for q in range(W)], (r, pos)
                if comm.rank != r:
                    assert pre_sq == pytest.approx(float(np.sum(flat.astype(np.float64) ** 2)), rel=1e-6)
                masses = [0.0 if flags[q] else 1.0 + q for q in range(W)]
                stats = red.reduce(staging, masses[comm.rank], masses)
                ref = sum(m * rank_flat(q, shapes).astype(np.float64) for q, m in enumerate(masses)) / sum(masses)
                assert stats.realized and stats.post_finite
                assert np.linalg.norm(staging - ref) / np.linalg.norm(ref) <= 1e-6
                assert np.isfinite(staging).all()
                assert len(set(comm.allgather(digest(staging)))) == 1
    finally:
        red.free()


def test_in_place_gather_gives_every_rank_the_same_rows_through_skewed_exchanges(comm):
    # The in-place reduce's Allgather through the shared file (the bridge's control gather and
    # the partial sums'): ranks out of step, row lengths changing, against MPI's allgather.
    import time

    from flodl_mpi.transport.shm_gather import STORES_ORDERED

    red = Reducer(comm, WireLayout(SHAPES), WireOptions("shm", "off"), in_place=True)
    try:
        gather = red.node_gather
        if not STORES_ORDERED:
            assert gather is None  # MPI's collectives instead
            return
        assert gather is not None
        rng = np.random.default_rng(comm.rank)
        for e in range(40):
            if rng.random() < 0.3:
                time.sleep(rng.random() * 2e-3)
            row = rng.standard_normal(1 + (e * 7) % 30)
            got = gather.allgather(row)
            np.testing.assert_array_equal(got, np.stack(comm.allgather(row)))
        with pytest.raises(ValueError, match=r"differ in length \(rank 0: 2, "):
            gather.allgather(np.zeros(2 if comm.rank == 0 else 3))
    finally:
        red.free()


def _bridge_round(bound_values, steps, loss_finite, mpi_gathers):
    """One Bridge round on the in-place path, its tensors bound to the staging; returns (staging copy, update)."""
    from flodl_mpi.transport.bridge import Bridge

    bridge = Bridge(MPI.COMM_WORLD.Dup(), SHAPES, [(4,)], gamma=0.5, wire=WireOptions("shm", "off"))
    try:
        assert bridge._p.reducer.path == "shm-in-place" and bridge._b.reducer.path == "shm-in-place"
        if mpi_gathers:
            for plane in (bridge._p, bridge._b):
                plane.reducer._impl.gather = None
        bridge._p.staging[:] = bound_values
        bridge._b.staging[:] = bound_values[:4] * 2
        bridge.start()
        update = bridge.round(steps=steps, window=max(steps, 1), loss_finite=loss_finite)
        return bridge._p.staging.copy(), bridge._b.staging.copy(), update
    finally:
        bridge.close()


@pytest.mark.parametrize("case", ["plain", "quarantine-params", "quarantine-loss", "idle"])
def test_bridge_round_on_the_shared_gather_equals_mpi_gathers_and_the_reference(case, monkeypatch):
    # The whole round through the bridge (control gather, masses, quarantine decision, pass,
    # partial sums) with the shared gather, and with MPI's: the same bits, the same update,
    # and the float64 reference of the finite, moving ranks.
    import flodl_mpi.transport.bridge as bridge_mod
    from flodl_mpi.transport.shm_gather import STORES_ORDERED

    comm = MPI.COMM_WORLD
    W, me = comm.size, comm.rank
    bad = W - 1 if case.startswith("quarantine") and W >= 2 else None
    idle = W - 1 if case == "idle" and W >= 2 else None
    steps = [0 if r == idle else 1 + 2 * r for r in range(W)]
    values = rank_flat(me)
    if bad == me and case == "quarantine-params":
        values[5] = np.nan
    outs = []
    for mpi_gathers in (False, True):
        if not mpi_gathers and STORES_ORDERED:  # proves the shared gather carried the control rows
            monkeypatch.setattr(bridge_mod, "control_gather", lambda *a: pytest.fail("MPI's control gather"))
        else:
            monkeypatch.undo()
        outs.append(_bridge_round(values, steps[me], loss_finite=not (bad == me and case == "quarantine-loss"),
                                  mpi_gathers=mpi_gathers))
    (p0, b0, u0), (p1, b1, u1) = outs
    assert p0.tobytes() == p1.tobytes() and b0.tobytes() == b1.tobytes()
    assert (u0.quarantined, u0.adopted, u0.version) == (u1.quarantined, u1.adopted, u1.version)
    assert u0.divergence == pytest.approx(u1.divergence, rel=1e-12, nan_ok=True)
    assert u0.pre_norm == pytest.approx(u1.pre_norm, rel=1e-12, nan_ok=True)
    live = [r for r in range(W) if r != bad and steps[r] > 0]
    masses = {r: gamma_mass(steps[r], 0.5) for r in live}
    ref = sum(masses[r] * rank_flat(r).astype(np.float64) for r in live) / sum(masses.values())
    assert u0.quarantined == ((bad,) if bad is not None else ())
    assert np.linalg.norm(p0 - ref) / np.linalg.norm(ref) <= 1e-6
    assert len(set(comm.allgather(digest(p0)))) == 1


def gathered_reduce(red, staging, masses):
    """The in-place reduce given every mass, after a control gather (the bridge's: every rank's segment final)."""
    assert red.comm.allgather(masses[red.comm.rank]) == list(masses)
    return red.reduce(staging, masses[red.comm.rank], masses, pre_sums=True)


@pytest.mark.parametrize("kernel", KERNELS)
def test_in_place_pass_sums_every_rank_pre_round_values(comm, kernel):
    # --on-non-finite stop reads no rank's params before the gather: the pass's own sums of
    # every rank's pre-round values (idle ranks' too) are the pre-round norms, the same on
    # every rank, against float64 sums of the inputs.
    if kernel == "numba" and "numba" not in KERNELS:
        pytest.skip("numba not installed")
    W = comm.size
    layout, red = make(comm, ("shm", "off", False, None, kernel), 7)
    try:
        for idle in (None, W - 1):
            masses = [0.0 if r == idle else 1.0 + r for r in range(W)]
            staging = stage(red, rank_flat(comm.rank))
            stats = gathered_reduce(red, staging, masses)
            assert stats.realized and stats.post_finite
            want = [float(np.sum(rank_flat(r).astype(np.float64) ** 2)) for r in range(W)]
            np.testing.assert_allclose(stats.pre_sums, want, rtol=1e-6)
            assert len(set(comm.allgather(stats.pre_sums.tobytes()))) == 1
            staging = stage(red, rank_flat(comm.rank))
            comm.Barrier()  # the control gather
            assert red.reduce(staging, masses[comm.rank], masses).pre_sums is None  # only when asked
    finally:
        red.free()


@pytest.mark.parametrize("shapes", [SHAPES, TINY], ids=["frame", "tiny-frame"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_in_place_pass_names_a_non_finite_rank_and_never_writes_its_value(comm, bad, kernel, shapes):
    # Without the pre-round check (--on-non-finite stop), a NaN or an infinity at any position
    # of any rank's segment, live or idle, shows in the gathered pre sums for that rank alone;
    # a live rank's stops the pass before the block is written (post_finite False), so the
    # value reaches no other rank; an idle rank's (mass 0: skipped by the sum) is overwritten by
    # the consensus of the others, which stays exact. The tiny frame gives ranks an empty slice
    # at 2 and 3 ranks already (SHAPES: at 5); their partial sums of it are zeros.
    if kernel == "numba" and "numba" not in KERNELS:
        pytest.skip("numba not installed")
    W = comm.size
    layout, red = make(comm, ("shm", "off", False, None, kernel), 7, shapes)
    try:
        n = layout.n
        for r in range(W):
            for idle in (False, True):
                for pos in edge_positions(n, W, (8,)):
                    flat = rank_flat(comm.rank, shapes)
                    if comm.rank == r:
                        flat[pos] = bad
                    staging = stage(red, flat)
                    masses = [0.0 if (idle and q == r) else 1.0 + q for q in range(W)]
                    stats = gathered_reduce(red, staging, masses)
                    assert (~np.isfinite(stats.pre_sums)).tolist() == [q == r for q in range(W)], (r, pos, idle)
                    assert stats.post_finite == idle
                    if comm.rank != r:
                        assert np.isfinite(staging).all()
                    if idle:
                        ref = sum(m * rank_flat(q, shapes).astype(np.float64) for q, m in enumerate(masses)) / sum(masses)
                        assert np.linalg.norm(staging - ref) / np.linalg.norm(ref) <= 1e-6
                    assert len(set(comm.allgather(stats.post_finite))) == 1
        # finite values whose float32 weighted sum would overflow: summed in float64, their mean comes
        # back (3e38 exactly: every rank holds it, issue 26 item 5), and nobody's values are named
        flat = rank_flat(comm.rank, shapes)
        flat[3] = 3e38
        stats = gathered_reduce(red, stage(red, flat), [1.0] * W)
        assert stats.post_finite and red.staging[3] == np.float32(3e38)
        assert np.isfinite(stats.pre_sums).all()
    finally:
        red.free()


def _stop_round(values, steps, monkeypatch, on_non_finite="stop"):
    """One Bridge round on the in-place path with ``on_non_finite``; the params' pre-round read must not run
    under "stop" (the pass checks them). Returns (params copy, update)."""
    from flodl_mpi.transport.bridge import Bridge

    bridge = Bridge(MPI.COMM_WORLD.Dup(), SHAPES, [(4,)], gamma=0.5, wire=WireOptions("shm", "off"),
                    on_non_finite=on_non_finite)
    try:
        assert bridge._p.reducer.checks_in_pass and bridge._p.reducer.path == "shm-in-place"
        if on_non_finite == "stop" and steps:
            monkeypatch.setattr(bridge._p.reducer, "prepare", lambda staging: pytest.fail("the pre-round read ran"))
        bridge._p.staging[:] = values
        bridge._b.staging[:] = 1.0
        bridge.start()
        update = bridge.round(steps=steps, window=max(steps, 1))
        return bridge._p.staging.copy(), update
    finally:
        bridge.close()


@pytest.mark.parametrize("steps", [3, 0], ids=["moving", "no-rank-moved"])
def test_stop_without_the_pre_round_read_names_the_rank_on_every_rank(monkeypatch, steps):
    # The same NonFiniteError, naming the same rank, as the pre-round check gave: after the pass
    # (moving ranks) or from the own check and one gather (a round in which no rank moved).
    from flodl_mpi.errors import NonFiniteError

    comm = MPI.COMM_WORLD
    W, me = comm.size, comm.rank
    if W < 2:
        pytest.skip("needs 2 ranks")
    values = rank_flat(me)
    if me == W - 1:
        values[len(values) // 2] = np.nan
    with pytest.raises(NonFiniteError, match=rf"^non-finite values in round 0: rank\(s\) {W - 1} "
                       r"\(parameters/buffers\) had NaN or infinite values; --on-non-finite stop, so the job stops"):
        _stop_round(values, steps, monkeypatch)


def test_stop_round_equals_the_quarantine_round(monkeypatch):
    # Finite ranks: the round without the pre-round read gives the same bits and the same
    # divergence triple (pre norm from the pass's sums) as the round with it.
    comm = MPI.COMM_WORLD
    values = rank_flat(comm.rank)
    p_stop, u_stop = _stop_round(values, 1 + comm.rank, monkeypatch)
    monkeypatch.undo()
    p_q, u_q = _stop_round(values, 1 + comm.rank, monkeypatch, "quarantine")
    assert p_stop.tobytes() == p_q.tobytes()
    assert u_stop.pre_norm == pytest.approx(float(np.linalg.norm(values.astype(np.float64))), rel=1e-6)
    assert u_stop.pre_norm == pytest.approx(u_q.pre_norm, rel=1e-6)
    assert u_stop.divergence == pytest.approx(u_q.divergence, rel=1e-6, abs=1e-12)
    assert u_stop.post_norm == pytest.approx(u_q.post_norm, rel=1e-9)


#: Masses a round gives: equal (sync), gamma-weighted unequal steps, cadence quotas, an idle rank.
ALIKE_MASSES = {
    "equal": lambda W: [1.0] * W,
    "gamma-0.5": lambda W: [gamma_mass(1 + 2 * r, 0.5) for r in range(W)],
    "quotas": lambda W: [float(10 * (r + 1) + 3 * r * r) for r in range(W)],
    "idle": lambda W: [0.0 if r == W - 1 and W > 1 else 7.0 / (r + 1) for r in range(W)],
}


def alike_values(n: int, bf16: bool) -> np.ndarray:
    """The same values on every rank: normal, large, tiny, subnormal, signed zeros, the extremes (bf16-exact
    for the bf16 wire: what every adopted value is after its first round, SPEC §7)."""
    f = np.finfo(np.float32)
    special = [0.0, -0.0, 1.0, 1 / 3, 3.0, f.tiny, f.smallest_subnormal, 1e30, -1e-30, f.max if not bf16 else 1e38]
    x = np.random.default_rng(26).standard_normal(n)
    x[: len(special)] = special
    x = x.astype(np.float32)
    return bf16_round(x) if bf16 else x


@pytest.mark.parametrize("masses", list(ALIKE_MASSES), ids=list(ALIKE_MASSES))
@pytest.mark.parametrize("prepared", [False, True], ids=["packed", "prepared"])
@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_values_every_rank_holds_alike_come_back_bit_for_bit(comm, path, prepared, masses):
    """issue 26 item 5: the same values on every (live) rank come out of every round unchanged, bit for bit,
    on every path (in place, packing shared memory, MPI Allreduce, both hierarchical forms, the bf16 wires),
    for equal and unequal masses, round after round; every live rank's divergence sum is exactly 0. Before,
    at W = 3 and 5 the float32 sums rounded by ulps each round (a frozen layer drifted)."""
    W = comm.size
    m = ALIKE_MASSES[masses](W)
    layout, red = make(comm, path, 64)
    try:
        values = alike_values(layout.n, path[2])
        staging = stage(red, values.copy())
        if not m[comm.rank]:
            staging[:] = np.nan  # an idle rank's values: never summed (true zeros), then overwritten
        for round_ in range(3):
            stats = reduce(red, staging, m[comm.rank], m, prepared)
            assert stats.realized and stats.post_finite
            assert staging.tobytes() == values.tobytes(), round_
            if m[comm.rank]:
                assert stats.diff_sq == 0.0
    finally:
        red.free()
