"""Multi-rank tests of the bridge thread through its public behaviour."""

import hashlib
import time

import numpy as np
import pytest
import torch
from mpi4py import MPI

from flodl_mpi.transport.bridge import Bridge
from flodl_mpi.protocol.divergence import divergence_triple
from flodl_mpi.errors import InputError, NonFiniteError, RoundError
from flodl_mpi.training.models import digits_mlp
from flodl_mpi.transport.reduce import WireOptions
from flodl_mpi.training.replica import ReplacedTensorError, Replica, state_arrays
from flodl_mpi.runtime.world import agree

pytestmark = pytest.mark.mpi


def make_replica() -> Replica:
    torch.manual_seed(0)
    return Replica(digits_mlp((64,), 10, hidden=16), torch.device("cpu"))


def make_bridge(replica: Replica, **kw) -> Bridge:
    bridge = Bridge(
        MPI.COMM_WORLD.Dup(),
        [tuple(p.shape) for p in replica.params],
        [tuple(b.shape) for b in replica.float_buffers],
        **kw,
    )
    bridge.start()
    return bridge


def local_steps(replica: Replica, rank: int, n: int) -> None:
    """n SGD steps on rank-specific data: params and BatchNorm stats diverge."""
    opt = torch.optim.SGD(replica.model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(n):
        x = torch.randn(32, 64, generator=gen) * (1 + rank)
        y = torch.randint(0, 10, (32,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(replica.model(x), y).backward()
        opt.step()


def flat(tensors) -> np.ndarray:
    return np.concatenate([t.detach().numpy().astype(np.float64).ravel() for t in tensors])


@pytest.mark.parametrize("bound", [False, True], ids=["copies", "bound"])
def test_round_with_batchnorm_matches_reference(bound):
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    replica = make_replica()
    steps = rank + 1  # unequal work
    local_steps(replica, rank, steps)
    pre_params = [p.detach().numpy().copy() for p in replica.params]
    all_params = comm.allgather(flat(replica.params))
    all_buffers = comm.allgather(flat(replica.float_buffers))
    all_steps = comm.allgather(steps)

    gamma = 0.5
    bridge = make_bridge(replica, gamma=gamma, chunk_elems=100)
    if bound:  # the CPU path: params live in the staging, no copies
        assert replica.bind(bridge)
        assert all(p.data_ptr() == v.data_ptr() for p, v in zip(replica.params, bridge.param_tensors))
    replica.snapshot(bridge)
    update = bridge.round(steps=steps, window=steps)
    replica.adopt(bridge)
    bridge.close()

    masses = np.array([n**gamma for n in all_steps])
    ref_params = sum(m * p for m, p in zip(masses, all_params)) / masses.sum()
    ref_buffers = sum(all_buffers) / size  # buffers: equal weight among movers
    got = flat(replica.params)
    assert np.linalg.norm(got - ref_params) / np.linalg.norm(ref_params) <= 1e-6
    np.testing.assert_allclose(flat(replica.float_buffers), ref_buffers, rtol=1e-5, atol=1e-7)
    nbt = replica.model.get_buffer("2.num_batches_tracked")
    assert nbt.dtype == torch.int64 and int(nbt) == steps  # local value, still an integer
    assert update.adopted and update.version == 1 and update.steps_at_snapshot == steps
    d, post_norm, pre_norm = divergence_triple(pre_params, [p.detach().numpy() for p in replica.params])
    assert update.divergence == pytest.approx(d, rel=1e-4)
    assert update.post_norm == pytest.approx(post_norm, rel=1e-6)
    assert update.pre_norm == pytest.approx(pre_norm, rel=1e-6)
    digests = comm.allgather(hashlib.sha256(got.tobytes()).hexdigest())
    assert len(set(digests)) == 1


def test_all_idle_round_is_skipped_and_changes_nothing():
    replica = make_replica()
    local_steps(replica, MPI.COMM_WORLD.rank, 1)  # ranks differ, but nobody reports a step
    before = flat(replica.params), flat(replica.float_buffers)
    bridge = make_bridge(replica)
    replica.snapshot(bridge)
    update = bridge.round(steps=0, window=0)
    if update.adopted:
        replica.adopt(bridge)
    second = bridge.round(steps=0, window=0)
    bridge.close()
    assert not update.adopted and update.divergence == 0.0
    assert (update.version, second.version) == (1, 2)  # skipped rounds still count
    np.testing.assert_array_equal(flat(replica.params), before[0])
    np.testing.assert_array_equal(flat(replica.float_buffers), before[1])
    assert update.pre_norm == pytest.approx(np.linalg.norm(before[0]), rel=1e-6)


def test_stop_flag_from_one_rank_reaches_every_rank():
    replica = make_replica()
    bridge = make_bridge(replica)
    replica.snapshot(bridge)
    update = bridge.round(steps=1, window=1, stop=MPI.COMM_WORLD.rank == MPI.COMM_WORLD.size - 1)
    bridge.close()
    assert update.stop


def test_error_in_a_round_crosses_to_the_training_thread(run_hook):
    def fault(bridge, stage):
        if stage == "params reduce":  # every rank, before the collective: nobody is left waiting
            raise MemoryError("staging allocation failed (injected)")

    run_hook("bridge_stage", fault)  # the bridge's extension point (flodl_mpi.runtime.hooks)
    replica = make_replica()
    bridge = make_bridge(replica)
    replica.snapshot(bridge)
    with pytest.raises(RoundError, match=r"round 0 failed at stage 'params reduce': MemoryError"):
        bridge.round(steps=1, window=1)
    with pytest.raises(RoundError, match="already failed"):
        bridge.round(steps=1, window=1)


def test_non_finite_params_stop_every_rank_with_on_non_finite_stop():
    comm = MPI.COMM_WORLD
    replica = make_replica()
    bad = comm.size - 1
    if comm.rank == bad:
        with torch.no_grad():
            replica.params[0][0, 0] = float("nan")
    before = flat(replica.params)
    bridge = make_bridge(replica, on_non_finite="stop")
    replica.snapshot(bridge)
    t0 = time.monotonic()
    with pytest.raises(NonFiniteError, match=rf"round 0: rank\(s\) {bad} \(parameters/buffers\) had NaN or infinite"):
        bridge.round(steps=1, window=1)
    assert time.monotonic() - t0 < 30
    after = flat(bridge.param_tensors)
    if not bridge._p.reducer.checks_in_pass:
        # Decided from the control gather, before any reduce: every staging is untouched.
        np.testing.assert_array_equal(after, before)
        return
    # In place, the pass checked the params (no read before the gather; that this path ran is proved in
    # test_node_reduce.py): blocks before the non-finite one hold the consensus, the same bits on every
    # rank; every other element is the rank's own; the NaN was never written anywhere.
    everyone = np.stack(comm.allgather(after))
    same_everywhere = (everyone == everyone[0]).all(axis=0)
    own = (after == before) | (np.isnan(after) & np.isnan(before))
    assert (own | same_everywhere).all()
    assert np.isfinite(after).all() == (comm.rank != bad)
    assert (comm.rank != bad) or np.isnan(after[0])


# ---- quarantine (issue 5 item 7) ---------------------------------------------------


# ---- tensors the model replaces (issue 5 item 6) --------------------------------------


class Reassigning(torch.nn.Module):
    """Re-assigns a registered buffer in forward, as users write running statistics."""

    def __init__(self, shape_change: bool = False) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(64, 10)
        self.register_buffer("stat", torch.zeros(64))
        self.shape_change = shape_change

    def forward(self, x):
        if self.training:
            self.stat = x.mean(1).detach() if self.shape_change else x.mean(0).detach()
        return self.fc(x)


@pytest.mark.parametrize("bound", [False, True], ids=["copies", "bound"])
def test_replaced_buffer_and_param_data_are_averaged_and_adopted(bound):
    comm = MPI.COMM_WORLD
    rank = comm.rank
    torch.manual_seed(0)
    model = Reassigning()
    replica = Replica(model, torch.device("cpu"))
    bridge = make_bridge(replica, chunk_elems=100)
    if bound:
        assert replica.bind(bridge)  # before the optimizer, as train.py does
    steps = rank + 1
    local_steps(replica, rank, steps)
    model.fc.bias.data = model.fc.bias.data.clone()  # p.data replaced: a new storage
    stat = model.get_buffer("stat")
    assert stat.abs().sum() > 0
    all_params = comm.allgather(flat([model.fc.weight, model.fc.bias]))
    all_stats = comm.allgather(stat.numpy().astype(np.float64))
    replica.snapshot(bridge)
    update = bridge.round(steps=steps, window=steps)
    replica.adopt(bridge)
    bridge.close()

    masses = np.arange(1, comm.size + 1, dtype=np.float64)  # gamma 1: steps
    ref_params = sum(m * p for m, p in zip(masses, all_params)) / masses.sum()
    ref_stat = sum(all_stats) / comm.size  # buffers: equal weight among movers
    live = flat([model.fc.weight, model.fc.bias])
    assert update.adopted
    assert np.linalg.norm(live - ref_params) / np.linalg.norm(ref_params) <= 1e-6
    np.testing.assert_allclose(model.get_buffer("stat").numpy(), ref_stat, rtol=1e-5, atol=1e-7)
    # What a checkpoint saves (the state dict by name) is the consensus too.
    params, buffers, _ = state_arrays(model)
    np.testing.assert_allclose(buffers["stat"], ref_stat, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(params["fc.bias"], ref_params[-10:], rtol=1e-5, atol=1e-7)
    digests = comm.allgather(hashlib.sha256(live.tobytes() + buffers["stat"].tobytes()).hexdigest())
    assert len(set(digests)) == 1
    if bound:  # bound again: the optimizer's parameter lives in the staging once more
        assert model.fc.bias.data_ptr() == bridge.param_tensors[1].data_ptr()


def test_a_replaced_submodule_is_averaged():
    comm = MPI.COMM_WORLD
    torch.manual_seed(0)
    model = Reassigning()
    replica = Replica(model, torch.device("cpu"))
    bridge = make_bridge(replica)
    torch.manual_seed(10 + comm.rank)
    model.fc = torch.nn.Linear(64, 10)  # new values on every rank, same shapes
    all_params = comm.allgather(flat([model.fc.weight, model.fc.bias]))
    replica.snapshot(bridge)
    bridge.round(steps=1, window=1)
    replica.adopt(bridge)
    bridge.close()
    ref = sum(all_params) / comm.size
    np.testing.assert_allclose(flat([model.fc.weight, model.fc.bias]), ref, rtol=1e-6, atol=1e-7)


def test_a_tensor_replaced_with_another_shape_is_an_error_naming_it():
    torch.manual_seed(0)
    model = Reassigning(shape_change=True)
    replica = Replica(model, torch.device("cpu"))
    bridge = make_bridge(replica)
    model(torch.randn(8, 64))
    with pytest.raises(ReplacedTensorError, match=r"model buffer 'stat' was replaced by a \(8,\) torch.float32 "
                                                  r"tensor; it was \(64,\) torch.float32 when training started"):
        replica.snapshot(bridge)
    model.fc.weight.data = torch.zeros(3, 3, dtype=torch.float64)
    with pytest.raises(ReplacedTensorError, match=r"model parameter 'fc.weight' was replaced by a \(3, 3\)"):
        replica.adopt(bridge)
    bridge.close()


def quarantine_case(bound: bool, *, bad_loss: bool = False, bad_params: bool = True):
    """The last rank is non-finite; returns (update, replica, float64 reference of the others)."""
    comm = MPI.COMM_WORLD
    rank, size, bad = comm.rank, comm.size, comm.size - 1
    replica = make_replica()
    steps = rank + 1
    local_steps(replica, rank, steps)
    all_params = comm.allgather(flat(replica.params))  # before the NaN: the others' are what counts
    all_buffers = comm.allgather(flat(replica.float_buffers))
    bridge = make_bridge(replica, gamma=0.5, chunk_elems=100)
    if bound:
        assert replica.bind(bridge)
    if rank == bad and bad_params:
        with torch.no_grad():
            replica.params[1][3] = float("nan")
            replica.params[0][2, 2] = float("inf")
    replica.snapshot(bridge)
    update = bridge.round(steps=steps, window=steps, loss_finite=not (rank == bad and bad_loss))
    if update.adopted:
        replica.adopt(bridge)
    version = bridge.version
    bridge.close()
    good = range(size - 1)
    masses = np.array([(r + 1) ** 0.5 for r in good])  # SPEC §1, gamma 0.5, by hand
    ref_params = sum(m * all_params[r] for m, r in zip(masses, good)) / masses.sum()
    ref_buffers = sum(all_buffers[r] for r in good) / len(good)
    return update, replica, ref_params, ref_buffers, version


@pytest.mark.parametrize("bound", [False, True], ids=["copies", "bound"])
@pytest.mark.parametrize("what", ["params", "loss", "both"])
def test_a_non_finite_rank_is_quarantined_and_adopts_the_others_consensus(bound, what):
    comm = MPI.COMM_WORLD
    if comm.size < 2:
        pytest.skip("quarantine needs a finite peer")
    update, replica, ref_params, ref_buffers, version = quarantine_case(
        bound, bad_loss=what in ("loss", "both"), bad_params=what in ("params", "both"))
    got = flat(replica.params)
    assert update.quarantined == (comm.size - 1,) and update.adopted and version == 1
    assert np.linalg.norm(got - ref_params) / np.linalg.norm(ref_params) <= 1e-6
    np.testing.assert_allclose(flat(replica.float_buffers), ref_buffers, rtol=1e-5, atol=1e-7)
    digests = comm.allgather(hashlib.sha256(got.tobytes()).hexdigest())
    assert len(set(digests)) == 1  # every rank, the quarantined one too, holds the same consensus


def test_every_rank_non_finite_stops_the_job_naming_them():
    comm = MPI.COMM_WORLD
    replica = make_replica()
    with torch.no_grad():
        replica.params[0][0, 0] = float("nan")
    bridge = make_bridge(replica)
    replica.snapshot(bridge)
    names = ", ".join(f"{r} \\(parameters/buffers\\)" for r in range(comm.size - 1))
    names = ", ".join([*([names] if names else []), f"{comm.size - 1} \\(loss and parameters/buffers\\)"])
    with pytest.raises(NonFiniteError, match=rf"round 0: rank\(s\) {names} had NaN .*no rank is finite"):
        bridge.round(steps=1, window=1, loss_finite=comm.rank != comm.size - 1)


@pytest.mark.parametrize("wire", ["mpi", "shm"])
def test_finite_ranks_near_float32_s_largest_give_their_consensus_back(wire):
    """issue 26 item 5: 3e38 on every rank (W·m·3e38 overflowed the float32 sum, and the job stopped)
    is summed in float64 and comes back exactly, on the MPI wire and in shared memory."""
    replica = make_replica()
    with torch.no_grad():
        replica.params[0].fill_(3e38)
    bridge = make_bridge(replica, wire=WireOptions(wire))
    replica.snapshot(bridge)
    update = bridge.round(steps=1, window=1)
    replica.adopt(bridge)
    bridge.close()
    assert update.adopted and (replica.params[0] == np.float32(3e38)).all()


def test_an_overflowing_bf16_consensus_of_finite_ranks_stops_every_rank():
    # bfloat16's largest finite is about 3.39e38: a finite float32 above it travels as an infinity.
    replica = make_replica()
    with torch.no_grad():
        replica.params[0].fill_(3.4e38)
    bridge = make_bridge(replica, wire=WireOptions(bf16=True))
    replica.snapshot(bridge)
    with pytest.raises(NonFiniteError, match="finite but their weighted sum overflowed"):
        bridge.round(steps=1, window=1)


def test_large_finite_params_are_averaged_not_stopped():
    comm = MPI.COMM_WORLD
    replica = make_replica()
    with torch.no_grad():
        for p in replica.params:
            p.mul_(1e25 * (1 + comm.rank))
    all_params = comm.allgather(flat(replica.params))
    bridge = make_bridge(replica, chunk_elems=100)
    replica.snapshot(bridge)
    update = bridge.round(steps=1, window=1)
    replica.adopt(bridge)
    bridge.close()
    ref = sum(all_params) / comm.size
    assert update.adopted and not update.quarantined
    assert np.linalg.norm(flat(replica.params) - ref) / np.linalg.norm(ref) <= 1e-6
    assert update.post_norm == pytest.approx(np.linalg.norm(ref), rel=1e-5)
    assert update.pre_norm == pytest.approx(np.linalg.norm(all_params[comm.rank]), rel=1e-5)


def test_the_guard_reads_only_ranks_that_contributed():
    # The last rank is idle (steps 0) and far from the others: its divergence is large
    # but says nothing of the cohort's drift; the guard must see the movers' max only.
    comm = MPI.COMM_WORLD
    if comm.size < 2:
        pytest.skip("needs an idle peer")
    idle = comm.rank == comm.size - 1
    replica = make_replica()
    local_steps(replica, comm.rank, 1)
    if idle:
        with torch.no_grad():
            for p in replica.params:
                p.mul_(50.0)
    bridge = make_bridge(replica)
    replica.snapshot(bridge)
    first = bridge.round(steps=0 if idle else 1, window=1)
    replica.adopt(bridge)
    replica.snapshot(bridge)
    bridge.round(steps=1, window=1)  # its control gather carries the first round's acks
    history = bridge.guard.state_dict()["history"]
    bridge.close()
    divs = comm.allgather(first.divergence)
    assert divs[-1] > 10 * max(divs[:-1])
    assert history == [pytest.approx(max(divs[:-1]))]


def test_agree_turns_one_rank_failure_into_an_error_everywhere():
    comm = MPI.COMM_WORLD

    def step():
        if comm.rank == comm.size - 1:
            raise FileNotFoundError("--data 'x.h5': no such file")
        return comm.rank

    prefix = f"rank\\(s\\) {comm.size - 1}: " if comm.size > 1 else ""
    with pytest.raises(InputError, match=f"^{prefix}--data 'x.h5': no such file$"):
        agree(comm, "data", step)
    def missing_everywhere():
        raise FileNotFoundError("--data 'x.h5': no such file")

    with pytest.raises(InputError, match="^--data 'x.h5': no such file$"):  # every rank alike: no prefix
        agree(comm, "data", missing_everywhere)
    assert agree(comm, "ok", lambda: comm.rank * 2) == comm.rank * 2


# ---------------------------------------------------------------- outer optimizer (SPEC §7)


@pytest.mark.parametrize("kind", ["slowmo", "nesterov"])
def test_outer_step_on_the_consensus_matches_a_float64_reference(kind):
    """Three rounds with unequal steps, an all-idle round between: every rank ends with the
    outer step of the float64 mass-weighted consensus, and the idle round does not step."""
    from flodl_mpi.protocol.outer import OuterOptimizer

    comm = MPI.COMM_WORLD
    rank = comm.rank
    replica = make_replica()
    n = sum(p.numel() for p in replica.params)
    lr, mu = 0.5, 0.9
    bridge = make_bridge(replica, chunk_elems=100, outer=OuterOptimizer(kind, n, lr, mu))
    prev = v = None
    for r, steps in enumerate([rank + 1, 0, 2 * rank + 1, rank + 2]):
        if steps:
            local_steps(replica, rank + 10 * r, steps)
        all_params = comm.allgather(flat(replica.params))
        all_steps = np.array(comm.allgather(steps), dtype=float)
        replica.snapshot(bridge)
        update = bridge.round(steps=steps, window=steps)
        replica.adopt(bridge)
        if all_steps.sum() == 0:  # no rank moved: no consensus, no outer step
            assert not update.adopted and not update.outer_stepped and bridge.outer.steps == (r > 0) + (r > 1)
            np.testing.assert_array_equal(flat(replica.params), all_params[rank])
            continue
        consensus = sum(m * p for m, p in zip(all_steps, all_params)) / all_steps.sum()
        if prev is None:  # the first realized round: a zero step
            new, v = consensus, np.zeros_like(consensus)
        else:
            g = prev - consensus
            v = mu * v + g
            new = prev - lr * ((mu * v + g) if kind == "nesterov" else v)
        prev = new
        got = flat(replica.params)
        assert update.outer_stepped
        assert np.max(np.abs(got - new)) <= 1e-5 * max(1.0, np.max(np.abs(new)))
        # identical on every rank, bit for bit
        digest = hashlib.sha256(got.tobytes()).hexdigest()
        assert len(set(comm.allgather(digest))) == 1
    bridge.close()
    assert bridge.outer.steps == 3


def test_outer_state_is_identical_on_every_rank_and_round_trips():
    from flodl_mpi.protocol.outer import OuterOptimizer

    comm = MPI.COMM_WORLD
    replica = make_replica()
    n = sum(p.numel() for p in replica.params)
    bridge = make_bridge(replica, outer=OuterOptimizer("nesterov", n))
    for r in range(3):
        local_steps(replica, comm.rank + 10 * r, 1 + comm.rank)
        replica.snapshot(bridge)
        if bridge.round(steps=1 + comm.rank, window=1).adopted:
            replica.adopt(bridge)
    bridge.close()
    arrays, attrs = bridge.outer.state_dict()
    digests = comm.allgather(hashlib.sha256(arrays["prev"].tobytes() + arrays["velocity"].tobytes()).hexdigest())
    assert len(set(digests)) == 1 and attrs["steps"] == 3
    again = OuterOptimizer("nesterov", n)
    again.load_state_dict(arrays, attrs)
    assert np.array_equal(again.prev, bridge.outer.prev) and np.array_equal(again.velocity, bridge.outer.velocity)


def _ranges_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def test_async_snapshot_never_aliases_the_live_parameters_and_the_blend_matches_easgd():
    """Async: the round runs on the snapshot while training goes on; EASGD's adoption pulls at the
    snapshot and keeps the steps since: theta + a (avg - theta_snapshot)."""
    comm = MPI.COMM_WORLD
    rank = comm.rank
    replica = make_replica()
    replica.keep_snapshot = True
    bridge = make_bridge(replica, chunk_elems=50)  # not bound: the async staging
    local_steps(replica, rank, rank + 1)
    for p in replica.params:
        for v in bridge.param_tensors:
            assert not _ranges_overlap(p, v)
    steps = rank + 1
    snapshots = comm.allgather(flat(replica.params))
    all_steps = comm.allgather(steps)
    replica.snapshot(bridge)
    bridge.submit(steps=steps, window=steps)
    assert bridge.in_flight
    local_steps(replica, rank + 10, 3)  # training goes on while the round runs
    with torch.no_grad():
        replica.params[0].add_(1000.0)  # and a write the round must never see
    live = flat(replica.params)
    update = bridge.wait()
    ref = sum(n * s for n, s in zip(all_steps, snapshots)) / sum(all_steps)
    got = flat(bridge.param_tensors)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) <= 1e-6  # the consensus of the snapshots only
    replica.adopt(bridge, alpha=0.5, delta=True)
    np.testing.assert_allclose(flat(replica.params), live + 0.5 * (ref - snapshots[rank]), rtol=1e-5, atol=1e-5)
    assert update.steps_at_snapshot == steps and update.plan.quotas == (1,) * comm.size
    with pytest.raises(RuntimeError, match="no round is in flight"):
        bridge.wait()
    bridge.close()


def test_a_bound_replica_refuses_a_blend():
    replica = make_replica()
    bridge = make_bridge(replica)
    assert replica.bind(bridge)
    with pytest.raises(ValueError, match="a delta adoption needs params apart from the staging"):
        replica.adopt(bridge, alpha=0.5, delta=True)
    with pytest.raises(ValueError, match="a pull alpha < 1 is computed at the snapshot"):
        replica.adopt(bridge, alpha=0.5)
    bridge.close()
