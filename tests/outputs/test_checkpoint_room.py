"""Room for a run's checkpoints, before training: one checkpoint's bytes, the run's peak, the one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from flodl_mpi.training import rank_state
from flodl_mpi.outputs.checkpoint_room import Room, optimizer_state_bytes, refusal, room_needed, saves_ahead


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 2), nn.ReLU(), nn.Linear(2, 4))  # 8 + 12 = 20 float32 params: 80 bytes


@pytest.mark.parametrize("make, expected", [
    (lambda p: torch.optim.SGD(p, lr=0.1), 0),                    # no momentum: no state tensor
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 80),     # momentum_buffer
    (lambda p: torch.optim.Adam(p), 2 * 80 + 4 * 4),              # exp_avg, exp_avg_sq; a float32 step per param
    (lambda p: torch.optim.Adam(p, amsgrad=True), 3 * 80 + 4 * 4),
    (lambda p: torch.optim.AdamW(p, weight_decay=0.1), 2 * 80 + 4 * 4),
    (lambda p: torch.optim.RMSprop(p, momentum=0.5, centered=True), 3 * 80 + 4 * 4),
])
def test_the_state_a_first_step_creates_is_predicted_without_touching_anything(make, expected):
    model = _model()
    optimizer = make(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    assert optimizer_state_bytes(optimizer) == expected
    assert not optimizer.state  # nothing created, nothing stepped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # Independently: a real step, then the bytes rank_state.capture saves of the optimizer state.
    model(torch.ones(5, 3)).sum().backward()
    optimizer.step()
    arrays, _ = rank_state.capture(optimizer, 1)
    assert sum(a.nbytes for k, a in arrays.items() if k.startswith("optimizer/")) == expected
    assert optimizer_state_bytes(optimizer) == expected  # held state counts as it is


def test_an_optimizer_whose_step_cannot_run_on_meta_counts_what_it_holds():
    class Odd(torch.optim.SGD):
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p]["x"] = torch.from_numpy(np.zeros(p.shape, np.float32) + p.detach().numpy())
            return None

    model = _model()
    assert optimizer_state_bytes(Odd(model.parameters(), lr=0.1)) == 0  # a lower bound, no error


@pytest.mark.parametrize("args, expected", [
    ((5, 0, 1), 5), ((5, 0, 2), 3), ((5, 5, 1), 0), ((5, 3, 0), 1), ((4, 1, 3), 2), ((6, 0, 0), 1),
])
def test_saves_ahead(args, expected):
    assert saves_ahead(*args) == expected


@pytest.mark.parametrize("present, keep, saves, count", [
    (0, 3, 5, 4),    # 3 kept and the 4th written beside them
    (0, 3, 2, 2),    # only 2 saves: the 2nd beside the 1st
    (0, 3, 1, 1),
    (3, 3, 10, 1),   # a resume with 3 already: one more at a time
    (5, 3, 10, 1),   # more than kept: the first save prunes to 3
    (1, 3, 10, 3),
])
def test_room_needed_counts_the_peak(present, keep, saves, count):
    room = room_needed(100, 10_000, present, keep, saves)
    assert room.count == count and room.need == 100 * count and room.fits


def test_room_needed_names_the_largest_keep_that_fits():
    room = room_needed(100, 250, 0, 3, 5)
    assert (room.count, room.fits, room.keep_fit) == (4, False, 1)
    assert room_needed(100, 250, 0, 1, 5).fits and not room_needed(100, 250, 0, 2, 5).fits
    assert room_needed(100, 0, 0, 3, 0) == Room(100, 0, 0, 3)  # nothing to save: needs nothing


def test_the_refusal_line():
    assert refusal(room_needed(100, 1000, 0, 3, 5), "R/checkpoints", 3) is None
    assert refusal(room_needed(342_100_000, 200_000_000, 0, 3, 1), "R/checkpoints", 3) == (
        "R/checkpoints has 200.0 MB free, this run needs about 342.1 MB there (1 checkpoint of about 342.1 MB); "
        "free space there or choose a run dir on a larger file system (nothing was trained)")
    assert refusal(room_needed(342_100_000, 200_000_000, 0, 3, 3), "R/checkpoints", 3) == (
        "R/checkpoints has 200.0 MB free, this run needs about 1.0 GB there (3 checkpoints of about 342.1 MB: "
        "--keep-checkpoints 3 kept, and the next written beside them before the oldest is deleted); free space "
        "there or choose a run dir on a larger file system (nothing was trained)")
    assert refusal(room_needed(342_100_000, 800_000_000, 0, 3, 4), "R/checkpoints", 3) == (
        "R/checkpoints has 800.0 MB free, this run needs about 1.4 GB there (4 checkpoints of about 342.1 MB: "
        "--keep-checkpoints 3 kept, and the next written beside them before the oldest is deleted); free space "
        "there or lower --keep-checkpoints to 1 (nothing was trained)")
