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
