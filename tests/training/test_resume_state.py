"""The one per-rank restore (flodl_mpi.training.resume_state): a rank's own state and its bridge's counters
from a checkpoint's contents, as the CLI's Trainer and the Averager both take them back."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from flodl_mpi.outputs.checkpoint_contents import CheckpointContents, read_contents
from flodl_mpi.training import rank_state
from flodl_mpi.training.resume_state import restore_bridge, restore_rank


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))


def _stepped(k: int):
    """A model and SGD-momentum optimizer after ``k`` steps (its momentum and BatchNorm count differ by k)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(k):
        opt.zero_grad()
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
    return model, opt


def _contents(ranks: dict) -> CheckpointContents:
    return CheckpointContents(params={}, buffers={}, order=[], epoch=1, round=7, reason="checkpoint",
                              world_size=len(ranks), config={}, guard={}, ranks=ranks, elapsed_s=12.5)


def test_a_rank_takes_the_state_of_old_rank_r_mod_w_old(tmp_path):
    """Saved at 2 ranks, resumed as rank 3 of 4: old rank 1's optimizer state, step count and integer buffers;
    the RNG is not restored on another world size, and is on the same."""
    states = {}
    for r, k in ((0, 1), (1, 3)):
        model, opt = _stepped(k)
        states[r] = rank_state.capture(opt, 10 * (r + 1), model)
    path = _contents(states).write(tmp_path / "c.h5")
    contents = read_contents(path, ranks=[1])
    model, opt = _stepped(0)
    torch.manual_seed(123)
    before = torch.get_rng_state().clone()
    got = restore_rank(contents, 3, 4, opt, model)
    assert (got.source, got.same_world, got.global_step) == (1, False, 20)
    assert torch.equal(torch.get_rng_state(), before)  # another world size: the RNG is this run's
    saved = states[1][0]
    assert np.array_equal(opt.state_dict()["state"][0]["momentum_buffer"].numpy(),
                          saved["optimizer/state/0/momentum_buffer"])
    assert int(model[1].num_batches_tracked) == 3
    got = restore_rank(contents, 1, 2, opt, model)  # the same world size: its RNG too
    assert got.same_world and np.array_equal(torch.get_rng_state().numpy(), saved["rng/torch"])


def test_an_own_loop_without_optimizer_takes_its_rng_and_step_count():
    model = _model()
    rng = torch.manual_seed(5).get_state().numpy().copy()
    ints = {f"int_buffers/{k}": v for k, v in rank_state.integer_buffers(model).items()}
    ints["int_buffers/1.num_batches_tracked"] = np.array(9, np.int64)
    contents = _contents({0: ({"rng/torch": rng, **ints}, {"global_step": 4})})
    torch.manual_seed(99)
    got = restore_rank(contents, 0, 1, None, model)
    assert got.global_step == 4 and np.array_equal(torch.get_rng_state().numpy(), rng)
    assert int(model[1].num_batches_tracked) == 9


def test_no_state_for_the_source_rank_is_refused():
    with pytest.raises(ValueError, match="no state read for rank 1"):
        restore_rank(CheckpointContents(params={}, buffers={}, order=[], epoch=0, round=0, reason="checkpoint",
                                        world_size=2, config={}, guard={}, ranks={0: ({}, {})}),
                     1, 2, None, _model())


class _Part:
    def __init__(self, name: str = "") -> None:
        self.name, self.loaded = name, None

    def load_state_dict(self, state) -> None:
        self.loaded = state


class _Bridge:
    def __init__(self, policy: str) -> None:
        self.policy, self.guard, self.outer, self.version, self.clock = _Part(policy), _Part(), None, 0, None

    def resume_clock(self, elapsed: float) -> None:
        self.clock = elapsed


def test_the_bridge_takes_the_round_the_clock_and_its_policys_state_or_the_guards():
    contents = _contents({0: ({}, {})})
    contents.guard = {"g": 1}
    contents.policy = {"name": "cadence", "anchor": 12, "guard": {"g": 1}}
    same, other = _Bridge("cadence"), _Bridge("window")
    restore_bridge(contents, same)
    restore_bridge(contents, other)
    assert (same.version, same.clock, same.policy.loaded, same.guard.loaded) == (7, 12.5, contents.policy, None)
    assert (other.policy.loaded, other.guard.loaded) == (None, {"g": 1})  # another policy's state: the guard's only
    contents.policy = None  # written before the policies kept state (the Averager's before this version)
    restore_bridge(contents, same := _Bridge("cadence"))
    assert (same.policy.loaded, same.guard.loaded) == (None, {"g": 1})


class _DeltaBridge:
    """The wire-state half of a `Bridge` over real `DeltaReduce` planes (no round runs: no MPI call)."""

    from flodl_mpi.transport.bridge import Bridge

    wire_kind, wire_state, load_wire_state = Bridge.wire_kind, Bridge.wire_state, Bridge.load_wire_state

    def __init__(self, kind: str = "int8", n: int = 5):
        from types import SimpleNamespace

        from flodl_mpi.protocol.wire import WireLayout
        from flodl_mpi.transport.delta_reduce import DeltaReduce

        def plane(shapes):
            return SimpleNamespace(reducer=SimpleNamespace(delta=DeltaReduce(SimpleNamespace(size=2),
                                                                             WireLayout(shapes), kind, None)))

        self._p, self._b = plane([(n,)]), plane([])


def _delta_checkpoint(tmp_path, rng) -> tuple:
    """A 2-rank checkpoint of a delta wire after some rounds: the planes' reference and each rank's error."""
    reference = rng.standard_normal(5).astype(np.float32)
    errors = [rng.standard_normal(5).astype(np.float32) * 1e-3 for _ in (0, 1)]
    ranks = {}
    for r in (0, 1):
        b = _DeltaBridge()
        b._p.reducer.delta.load_state(reference, errors[r])
        cohort, attrs, mine = b.wire_state()
        ranks[r] = (mine, {"global_step": 3})
    contents = _contents(ranks)
    contents.cohort = (cohort, attrs)
    return read_contents(contents.write(tmp_path / "c.h5"), ranks=[0, 1]), reference, errors


def test_a_delta_wire_takes_its_reference_and_error_feedback_back(tmp_path):
    """Same world size: the reference (saved once) and rank r's own error feedback, bit for bit; another world
    size: the reference, error feedback zero; a checkpoint without the state: none, the exact first round."""
    from flodl_mpi.training.resume_state import restore_wire

    contents, reference, errors = _delta_checkpoint(tmp_path, np.random.default_rng(3))
    assert set(contents.cohort_state()[0]) == {"wire_reference_params"}  # the buffers plane is empty: no round
    for r in (0, 1):
        b = _DeltaBridge()
        line = restore_wire(contents, b, r, 2)
        d = b._p.reducer.delta
        assert d.has_reference and d.reference.tobytes() == reference.tobytes()
        assert d.error.tobytes() == errors[r].tobytes()
        assert line == "--wire int8-delta: the reference and each rank's error feedback restored from the checkpoint"
        assert not b._b.reducer.delta.has_reference  # a plane without a saved reference: the exact first round
    b = _DeltaBridge()
    line = restore_wire(contents, b, 2, 3)
    d = b._p.reducer.delta
    assert d.has_reference and d.reference.tobytes() == reference.tobytes() and not np.any(d.error)
    assert line == ("--wire int8-delta: world size 2 -> 3: the reference restored, each rank's error feedback started "
                    "at zero (the old ranks' residuals do not map onto the new ranks)")
    old = _contents({0: ({}, {}), 1: ({}, {})})  # an older flodl-mpi's (or another --wire's): no wire state
    b = _DeltaBridge()
    b._p.reducer.delta.load_state(reference, errors[0])  # whatever it held is dropped
    assert "the first round after the resume is the exact float64 Allreduce" in restore_wire(old, b, 0, 2)
    assert not b._p.reducer.delta.has_reference and not np.any(b._p.reducer.delta.error)
    with pytest.raises(ValueError, match="for --wire int8-delta, the run uses --wire bf16-delta"):
        restore_wire(contents, _DeltaBridge("bf16"), 0, 2)
    with pytest.raises(ValueError, match=r"reference has shape \(5,\), expected \(6,\)"):
        restore_wire(contents, _DeltaBridge(n=6), 0, 2)
