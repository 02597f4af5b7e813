"""Optimizer state under averaging (issue 12): the plan, the rebuilt second moment, one process."""

import numpy as np
import pytest
import torch

from flodl_mpi.config import ConfigError, TrainConfig
from flodl_mpi.protocol.optimizer_state import OptimizerStateAverager, StatePlan, rebuild_second_moment, resolve_mode
from flodl_mpi.protocol.wire import WireLayout


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(5, 4)
        self.b = torch.nn.Linear(4, 3)
        self.scale = torch.nn.Parameter(torch.tensor(1.5))  # a 0-d parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * self.b(torch.tanh(self.a(x)))


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return Net()


def keys(entries) -> list[tuple[int, str]]:
    return [(e.index, e.key) for e in entries]


def test_plan_finds_param_shaped_floating_state_and_leaves_counters_local():
    net = model()
    n = len(list(net.parameters()))
    adam = torch.optim.Adam(net.parameters())
    plan = StatePlan(adam, correct=True)
    # Adam's step is a 0-d float tensor: shaped like the 0-d parameter, still a counter.
    assert keys(plan.wire) == [(i, "exp_avg") for i in range(n)]
    assert keys(plan.rebuilt) == [(i, "exp_avg_sq") for i in range(n)]
    assert [(p.first, p.second, p.beta1, p.beta2) for p in plan.pairs] == [(i, i, 0.9, 0.999) for i in range(n)]
    assert plan.wire_shapes == [tuple(p.shape) for p in net.parameters()]
    assert adam.state == {}  # the probe touched neither the optimizer nor the parameters
    plain = StatePlan(torch.optim.Adam(net.parameters()), correct=False)
    assert keys(plain.wire) == [(i, k) for i in range(n) for k in ("exp_avg", "exp_avg_sq")]
    assert plain.rebuilt == [] and plain.pairs == []
    nadam = StatePlan(torch.optim.NAdam(net.parameters()), correct=False)  # mu_product: a counter too
    assert keys(nadam.wire) == [(i, k) for i in range(n) for k in ("exp_avg", "exp_avg_sq")]
    sgd = StatePlan(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    assert keys(sgd.wire) == [(i, "momentum_buffer") for i in range(n)]
    assert StatePlan(torch.optim.SGD(net.parameters(), lr=0.1)).wire == []  # no state at all
    rms = StatePlan(torch.optim.RMSprop(net.parameters(), centered=True))
    assert keys(rms.wire) == [(i, k) for i in range(n) for k in ("grad_avg", "square_avg")]


def test_auto_is_corrected_for_the_adam_family_and_off_otherwise():
    net = model()
    assert resolve_mode("auto", torch.optim.AdamW(net.parameters())) == "corrected"
    assert resolve_mode("auto", torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)) == "off"
    assert resolve_mode("mean", torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)) == "mean"
    with pytest.raises(ValueError, match="mode must be one of"):
        resolve_mode("on", torch.optim.Adam(net.parameters()))
    with pytest.raises(ConfigError, match="--average-optimizer-state 'on': must be one of auto, off, mean"):
        TrainConfig(average_optimizer_state="on")


def test_rebuilt_second_moment_hand_worked():
    # One step from m_prev 0.5, v_prev 0.04 with betas (0.9, 0.999); gradients 1 and 3:
    # m_r = 0.45 + 0.1 g_r = 0.55, 0.75, mean 0.65; g_bar = (0.65 - 0.45) / 0.1 = 2;
    # v = 0.999 * 0.04 + 0.001 * 2**2 = 0.04396 (the plain mean of v_r: 0.04496).
    out = np.empty(1, dtype=np.float32)
    rebuild_second_moment(np.float32([0.65]), np.float32([0.5]), np.float32([0.04]), [1.0, 1.0], [1, 1],
                          0.9, 0.999, out)
    np.testing.assert_allclose(out, [0.04396], rtol=1e-5)
    # Unequal weights, one step each: g_bar is their weighted mean, (1 * 1 + 3 * 3) / 4 = 2.5.
    m_bar = np.float32([(0.55 * 1 + 0.75 * 3) / 4])
    rebuild_second_moment(m_bar, np.float32([0.5]), np.float32([0.04]), [1.0, 3.0], [1, 1], 0.9, 0.999, out)
    np.testing.assert_allclose(out, [0.999 * 0.04 + 0.001 * 2.5**2], rtol=1e-5)
    # Windows of k steps, constant gradient 2 on both ranks: m = 0.9^k m_prev + (1 - 0.9^k) 2, recovered exactly.
    for k in (3, 8):
        m_bar = np.float32([0.9**k * 0.5 + (1 - 0.9**k) * 2.0])
        rebuild_second_moment(m_bar, np.float32([0.5]), np.float32([0.04]), [1.0, 1.0], [k, k], 0.9, 0.999, out)
        np.testing.assert_allclose(out, [0.999**k * 0.04 + (1 - 0.999**k) * 4.0], rtol=1e-4)
    # A round whose contributors took no step (a quarantined rank handed the consensus back): v stays.
    rebuild_second_moment(np.float32([0.5]), np.float32([0.5]), np.float32([0.04]), [1.0, 0.0], [0, 5],
                          0.9, 0.999, out)
    np.testing.assert_array_equal(out, np.float32([0.04]))


@pytest.mark.parametrize("opt", ["adam", "adamw"])
@pytest.mark.parametrize("world", [2, 3])
def test_corrected_state_equals_an_adam_step_on_the_mean_gradient(opt, world):
    """W replicas, one step each from the same consensus: the corrected state is DDP's optimizer's state.

    The gradients are given (random, per rank and round), so the state depends on them
    only: Adam's and AdamW's moments do not read the parameters (Adam without weight decay).
    """
    make = {"adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
            "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)}[opt]
    nets = [model() for _ in range(world)]
    ref = model()
    opts = [make(n.parameters()) for n in nets]
    ref_opt = make(ref.parameters())
    avgs = [OptimizerStateAverager(o, "corrected") for o in opts]
    layout = WireLayout(avgs[0].wire_shapes)
    flats = [layout.new_staging() for _ in range(world)]
    views = [[torch.from_numpy(v) for v in layout.views(f)] for f in flats]
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):  # rounds: each rank one step on its own gradient, then average the state
        grads = [[torch.randn(p.shape, generator=gen) * (1 + r) for p in ref.parameters()] for r in range(world)]
        for net, o, g in zip(nets, opts, grads):
            for p, gp in zip(net.parameters(), g):
                p.grad = gp.clone()
            o.step()
        for p, *gs in zip(ref.parameters(), *grads):
            p.grad = (sum(g.double() for g in gs) / world).float()  # DDP's mean gradient
        ref_opt.step()
        for a, v in zip(avgs, views):
            a.fill(v)
        mean = sum(f.astype(np.float64) for f in flats) / world  # the reduce, in float64
        for a, f, v in zip(avgs, flats, views):
            f[:] = mean
            a.finish(f, layout.offsets, [1.0] * world, [1] * world)
            a.adopt(v)
        for name in ("exp_avg", "exp_avg_sq"):
            for r in range(world):
                got = [opts[r].state[p][name] for p in nets[r].parameters()]
                want = [ref_opt.state[p][name] for p in ref.parameters()]
                for g, w in zip(got, want):
                    torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-7)
    # Step counters stay each rank's own and untouched (counters do not travel).
    assert all(float(opts[r].state[p]["step"]) == 5.0 for r in range(world) for p in nets[r].parameters())


def test_mean_mode_averages_every_state_tensor_and_missing_state_enters_as_zeros():
    nets = [model(), model()]
    opts = [torch.optim.SGD(n.parameters(), lr=0.1, momentum=0.9) for n in nets]
    avgs = [OptimizerStateAverager(o, "mean") for o in opts]
    layout = WireLayout(avgs[0].wire_shapes)
    flats = [layout.new_staging() for _ in range(2)]
    views = [[torch.from_numpy(v) for v in layout.views(f)] for f in flats]
    # Rank 0 steps twice; rank 1 never: it holds no momentum buffer yet.
    for _ in range(2):
        opts[0].zero_grad()
        nets[0](torch.ones(2, 5)).sum().backward()
        opts[0].step()
    for a, v in zip(avgs, views):
        a.fill(v)
    bufs0 = [opts[0].state[p]["momentum_buffer"].clone() for p in nets[0].parameters()]
    assert all(np.all(f == 0) for f in layout.views(flats[1]))
    got = [t.clone() for t in views[0]]
    for g, b in zip(got, bufs0):
        torch.testing.assert_close(g, b)
    for a, v in zip(avgs, views):
        a.adopt(v)
    assert opts[1].state == {}  # nothing is made up for a rank that holds no state


def test_a_resumed_averager_starts_from_the_loaded_state_and_a_reset_from_zeros():
    """What makes a resume exact: (m_prev, v_prev) are the saved state, which is the last consensus."""
    net = model()
    opt = torch.optim.Adam(net.parameters())
    averager = OptimizerStateAverager(opt, "corrected")
    assert not averager.m_prev.any() and not averager.v_prev.any()  # before any step: Adam's zeros
    net(torch.ones(2, 5)).sum().backward()
    opt.step()
    saved = opt.state_dict()
    fresh_net = model()
    fresh = torch.optim.Adam(fresh_net.parameters())
    fresh.load_state_dict(saved)
    resumed = OptimizerStateAverager(fresh, "corrected")  # as Trainer.resume: restore, then start()
    ps = list(fresh_net.parameters())
    np.testing.assert_array_equal(resumed.m_prev, torch.cat([fresh.state[p]["exp_avg"].ravel() for p in ps]))
    np.testing.assert_array_equal(resumed.v_prev, torch.cat([fresh.state[p]["exp_avg_sq"].ravel() for p in ps]))
    assert resumed.v_prev.any()
    resumed.reset()  # the cohort cleared its state (--outer-reset-inner)
    assert not resumed.m_prev.any() and not resumed.v_prev.any()
