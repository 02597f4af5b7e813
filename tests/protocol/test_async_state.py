"""Async's delta adoption of the optimizer state on hand-worked values (issue 6).

The round averaged the state as the snapshot held it; the rank took ``n`` steps since, so
each running average becomes ``live + β^n · (consensus - kept)`` (the state it would hold
had it adopted the consensus at the snapshot), a second moment clamped at 0, step counters
untouched. No MPI: a float32 frame stands in for the bridge's state staging.
"""

import copy

import numpy as np
import pytest
import torch

from flodl_mpi.config import TrainConfig
from flodl_mpi.protocol.optimizer_state import OptimizerStateAverager, adopt_delta, decay_base
from flodl_mpi.protocol.wire import WireLayout


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def test_adopt_delta_hand_worked():
    live = torch.tensor([1.0, -2.0])
    adopt_delta(live, torch.tensor([3.0, 4.0]), torch.tensor([0.5, 1.0]))
    assert torch.equal(live, torch.tensor([3.5, 1.0]))  # [3 + (1 - 0.5), 4 + (-2 - 1)]
    # A second moment: 0.2 + (0.1 - 0.4) = -0.1 -> 0; 0.1 + (0.5 - 0.2) = 0.4.
    v = torch.tensor([0.1, 0.5])
    adopt_delta(v, torch.tensor([0.2, 0.1]), torch.tensor([0.4, 0.2]), non_negative=True)
    torch.testing.assert_close(v, torch.tensor([0.0, 0.4]), rtol=0, atol=1e-7)
    assert v[0].item() == 0.0
    # No state at the snapshot (the optimizer's zeros): consensus + live.
    fresh = torch.tensor([0.25, 0.5])
    adopt_delta(fresh, torch.tensor([1.0, 1.0]), None)
    assert torch.equal(fresh, torch.tensor([1.25, 1.5]))
    # Decayed: [1 + 0.25 * (3 - 0.5), -2 + 0.25 * (4 - 1)] = [1.625, -1.25].
    live = torch.tensor([1.0, -2.0])
    adopt_delta(live, torch.tensor([3.0, 4.0]), torch.tensor([0.5, 1.0]), decay=0.25)
    assert torch.equal(live, torch.tensor([1.625, -1.25]))
    # Another dtype: computed in the live tensor's dtype.
    half = torch.tensor([1.0, 2.0], dtype=torch.float64)
    adopt_delta(half, torch.tensor([1.0, 1.0]), torch.tensor([0.5, 0.5]))
    assert torch.equal(half, torch.tensor([1.5, 2.5], dtype=torch.float64))


def _adam():
    """One 2-element parameter, Adam (betas 0.5, 0.75) stepped once (so it holds state), then hand values set."""
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = torch.optim.Adam([w], lr=0.1, betas=(0.5, 0.75))
    w.grad = torch.tensor([1.0, 1.0])
    opt.step()
    st = opt.state[w]
    st["exp_avg"].copy_(torch.tensor([0.5, -0.5]))
    st["exp_avg_sq"].copy_(torch.tensor([0.04, 0.09]))
    return w, opt, st


def _frame(averager):
    layout = WireLayout(averager.wire_shapes)
    return [torch.from_numpy(v) for v in layout.views(layout.new_staging())]


def test_mean_mode_delta_adoption_hand_worked_and_the_kept_state_never_aliases():
    w, opt, st = _adam()
    averager = OptimizerStateAverager(opt, "mean")
    averager.keep_snapshot = True
    views = _frame(averager)  # mean: exp_avg then exp_avg_sq travel
    averager.fill(views)
    m_kept, v_kept = averager.kept
    assert torch.equal(m_kept, torch.tensor([0.5, -0.5])) and torch.equal(v_kept, torch.tensor([0.04, 0.09]))
    for kept in (m_kept, v_kept):
        for other in (st["exp_avg"], st["exp_avg_sq"], *views):
            assert not _overlap(kept, other)
    # Train on: the live state moves; the round's consensus lands in the frame.
    step_before = st["step"].clone()
    st["exp_avg"].copy_(torch.tensor([0.75, -0.25]))
    st["exp_avg_sq"].copy_(torch.tensor([0.01, 0.16]))
    assert torch.equal(averager.kept[0], torch.tensor([0.5, -0.5]))  # kept through the training
    views[0].copy_(torch.tensor([1.0, 0.0]))
    views[1].copy_(torch.tensor([0.02, 0.05]))
    averager.adopt(views, delta=True, steps=2)  # two steps since the fill: decays 0.5^2 and 0.75^2
    # m: [0.75 + 0.25 * (1 - 0.5), -0.25 + 0.25 * (0 + 0.5)] = [0.875, -0.125]
    # v: [0.01 + 0.5625 * (0.02 - 0.04), 0.16 + 0.5625 * (0.05 - 0.09)] = [-0.00125 -> 0, 0.1375]
    torch.testing.assert_close(st["exp_avg"], torch.tensor([0.875, -0.125]), rtol=0, atol=1e-7)
    torch.testing.assert_close(st["exp_avg_sq"], torch.tensor([0.0, 0.1375]), rtol=0, atol=1e-7)
    assert st["exp_avg_sq"][0].item() == 0.0
    assert torch.equal(st["step"], step_before)  # counters stay the rank's own
    # The next step is finite (a negative second moment would be a NaN in the square root).
    w.grad = torch.tensor([0.0, 1.0])
    opt.step()
    assert torch.isfinite(w).all()


def test_corrected_mode_delta_adopts_the_rebuilt_second_moment():
    _, opt, st = _adam()
    averager = OptimizerStateAverager(opt, "corrected")
    averager.keep_snapshot = True
    views = _frame(averager)  # corrected: only exp_avg travels; exp_avg_sq is rebuilt
    assert len(views) == 1
    averager.fill(views)
    st["exp_avg"].copy_(torch.tensor([0.75, -0.25]))
    st["exp_avg_sq"].copy_(torch.tensor([0.05, 0.1]))
    views[0].copy_(torch.tensor([1.0, 0.0]))
    averager.v_prev[:] = [0.08, 0.05]  # what finish() rebuilt from the consensus
    averager.adopt(views, delta=True, steps=1)
    # m: [0.75 + 0.5 * (1 - 0.5), -0.25 + 0.5 * (0 + 0.5)] = [1.0, 0.0]
    torch.testing.assert_close(st["exp_avg"], torch.tensor([1.0, 0.0]), rtol=0, atol=1e-7)
    # v: [0.05 + 0.75 * (0.08 - 0.04), 0.1 + 0.75 * (0.05 - 0.09)] = [0.08, 0.07]
    torch.testing.assert_close(st["exp_avg_sq"], torch.tensor([0.08, 0.07]), rtol=0, atol=1e-7)


def test_a_rank_that_trained_nothing_since_the_fill_takes_the_consensus():
    _, opt, st = _adam()
    averager = OptimizerStateAverager(opt, "mean")
    averager.keep_snapshot = True
    views = _frame(averager)
    averager.fill(views)
    views[0].copy_(torch.tensor([0.125, 0.25]))
    views[1].copy_(torch.tensor([0.5, 0.75]))
    averager.adopt(views, delta=True, steps=0)
    assert torch.equal(st["exp_avg"], torch.tensor([0.125, 0.25]))
    assert torch.equal(st["exp_avg_sq"], torch.tensor([0.5, 0.75]))


def test_delta_without_a_kept_state_is_refused():
    _, opt, _ = _adam()
    averager = OptimizerStateAverager(opt, "mean")
    views = _frame(averager)
    averager.fill(views)  # keep_snapshot not set
    with pytest.raises(ValueError, match="needs the state kept at the last fill"):
        averager.adopt(views, delta=True)


def test_easgd_pulls_the_state_at_the_fill_by_alpha_decayed():
    # As the params: live + alpha * beta^n * (consensus - kept), alpha 0.5, two steps since the fill:
    # m: [0.75 + 0.5 * 0.25 * (1 - 0.5), -0.25 + 0.5 * 0.25 * (0 + 0.5)] = [0.8125, -0.1875]
    # v: [0.01 + 0.5 * 0.5625 * (0.02 - 0.04), 0.16 + 0.5 * 0.5625 * (0.05 - 0.09)] = [0.004375, 0.14875]
    _, opt, st = _adam()
    averager = OptimizerStateAverager(opt, "mean")
    averager.keep_snapshot = True
    views = _frame(averager)
    averager.fill(views)
    st["exp_avg"].copy_(torch.tensor([0.75, -0.25]))
    st["exp_avg_sq"].copy_(torch.tensor([0.01, 0.16]))
    views[0].copy_(torch.tensor([1.0, 0.0]))
    views[1].copy_(torch.tensor([0.02, 0.05]))
    averager.adopt(views, delta=True, steps=2, alpha=0.5)
    torch.testing.assert_close(st["exp_avg"], torch.tensor([0.8125, -0.1875]), rtol=0, atol=1e-7)
    torch.testing.assert_close(st["exp_avg_sq"], torch.tensor([0.004375, 0.14875]), rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="alpha must be in"):
        averager.adopt(views, alpha=0.5)  # a pull is relative to the fill: delta only


def test_async_averages_the_state_under_both_adoptions():
    # Both adoptions are relative to the snapshot, so the state is adopted by the params' rule
    # under easgd too (before: refused, each rank kept its own state).
    for adopt in ("delta", "easgd"):
        TrainConfig(policy="async", average_optimizer_state="corrected", async_adopt=adopt)
        TrainConfig(policy="async", average_optimizer_state="mean", async_adopt=adopt)
    TrainConfig(policy="async", async_adopt="easgd", average_optimizer_state="off")


@pytest.mark.parametrize("opt_kind", ["adam", "adamw", "sgd", "rmsprop"])
def test_delta_adoption_equals_adopting_the_consensus_at_the_snapshot(opt_kind):
    """Independent reference: torch's own optimizer run from the consensus state.

    Rank A holds its state at the snapshot, then takes 3 steps; B starts those same 3 steps
    (same gradients, same step counter) from the consensus state. A's delta adoption must
    give B's state, for every running average the optimizer keeps.
    """
    def make():
        w = torch.nn.Parameter(torch.tensor([1.0, -1.0, 0.5]))
        opt = {"adam": lambda: torch.optim.Adam([w], lr=0.01, betas=(0.8, 0.9)),
               "adamw": lambda: torch.optim.AdamW([w], lr=0.01, betas=(0.7, 0.95)),
               "sgd": lambda: torch.optim.SGD([w], lr=0.01, momentum=0.6),
               "rmsprop": lambda: torch.optim.RMSprop([w], lr=0.01, alpha=0.8, momentum=0.5, centered=True)}[opt_kind]()
        return w, opt

    def step(w, opt, g):
        w.grad = torch.tensor(g)
        opt.step()

    a, opt_a = make()
    step(a, opt_a, [0.3, -0.2, 0.1])  # this rank's state at the snapshot
    b, opt_b = make()
    step(b, opt_b, [-0.5, 0.4, 0.9])  # another rank's
    averager = OptimizerStateAverager(opt_a, "mean")
    averager.keep_snapshot = True
    views = _frame(averager)
    averager.fill(views)
    other = OptimizerStateAverager(opt_b, "mean")
    other_views = _frame(other)
    other.fill(other_views)
    for mine, theirs in zip(views, other_views):  # the round: the mean of the two, in the staging
        mine.copy_((mine + theirs) / 2)
    # B': A's optimizer with the consensus state at the snapshot, then A's steps.
    ref, opt_ref = make()
    ref.data.copy_(a.detach())
    step(ref, opt_ref, [0.0, 0.0, 0.0])
    opt_ref.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # its own tensors: load_state_dict keeps them
    assert all(not _overlap(x, y) for x in opt_ref.state[ref].values() for y in opt_a.state[a].values())
    for entry, value in zip(averager.plan.wire, views):
        opt_ref.state[ref][entry.key].copy_(value)
    grads = [[0.1, 0.2, -0.3], [-0.4, 0.5, 0.6], [0.7, -0.8, 0.05]]
    for g in grads:
        step(a, opt_a, g)
        step(ref, opt_ref, g)
    averager.adopt(views, delta=True, steps=len(grads))
    for entry in averager.plan.wire:
        if entry.key == "momentum_buffer" and opt_kind == "rmsprop":
            continue  # RMSprop's momentum adds g / sqrt(square_avg): its own part depends on the state
        torch.testing.assert_close(opt_a.state[a][entry.key], opt_ref.state[ref][entry.key], rtol=1e-6, atol=1e-7)
        assert decay_base(entry.key, opt_a.param_groups[0]) < 1.0  # every entry is a running average
    assert torch.equal(opt_a.state[a].get("step", torch.tensor(0.0)), opt_ref.state[ref].get("step", torch.tensor(0.0)))


def test_an_async_run_averages_adams_first_moment_by_default_and_not_with_off(tmp_path, tmp_path_factory):
    """Two ranks on digits: each realized round moves the params' frame, the buffers'
    and, by default (``auto``: ``corrected``), a third frame the size of the params (Adam's
    ``exp_avg``; ``exp_avg_sq`` is rebuilt, it does not travel); with ``off`` no third frame.
    ``auto`` is the session's async run (`tests._runs.RUN_ASYNC`: 3 epochs, Adam and ``auto`` by
    default; it was a 1-epoch run of this test's own with them given); ``off`` is 1 epoch."""
    from flodl_mpi.config import TrainConfig
    from flodl_mpi.outputs.checkpoint import latest_checkpoint, read_checkpoint
    from flodl_mpi.outputs.metrics import read_table
    from tests._runs import RUN_ASYNC, session_run_async
    from tests.conftest import run_flodl

    defaults = TrainConfig()
    assert (defaults.optimizer, defaults.average_optimizer_state) == ("adam", "auto")  # what RUN_ASYNC runs
    for mode in ("auto", "off"):
        if mode == "auto":
            assert RUN_ASYNC[1:3] == ("--policy", "async")
            d = session_run_async(tmp_path_factory)
        else:
            d = tmp_path / mode
            proc = run_flodl(2, "train", "--policy", "async", "--epochs", "1", "--optimizer", "adam",
                             "--average-optimizer-state", mode, "--run-dir", str(d), timeout=300)
            assert proc.returncode == 0, proc.stderr[-3000:]
        ckpt = read_checkpoint(latest_checkpoint(d / "checkpoints"))
        params = sum(v.size for v in ckpt.params.values())
        buffers = sum(v.size for v in ckpt.buffers.values() if v.dtype.kind == "f")
        frames = (params, buffers) + ((params,) if mode == "auto" else ())
        moved = read_table(d / "metrics.h5", "rounds")["bytes"]
        assert moved.size and set(moved[moved > 0].tolist()) == {4 * sum(n + 1 for n in frames)}
        for r in (0, 1):  # every rank kept finite Adam state (no negative second moment)
            arrays, _ = ckpt.ranks[r]
            sq = [v for k, v in arrays.items() if k.endswith("/exp_avg_sq")]
            assert sq and all(np.all(np.isfinite(v)) and np.all(v >= 0) for v in sq)
