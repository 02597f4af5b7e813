"""The learning-rate schedules' closed forms against torch.optim.lr_scheduler's own schedulers, the warm-up,
the config's refusals, and gradient accumulation's micro-batches (flodl_mpi.training.lr_schedule,
flodl_mpi.training.accumulate). Pure: no MPI, no run."""

import math

import numpy as np
import pytest
import torch

from flodl_mpi.config import ConfigError, TrainConfig
from flodl_mpi.training.accumulate import micro_batches, smallest_micro_batch
from flodl_mpi.training.data import batch_indices, num_batches
from flodl_mpi.training.lr_schedule import decay_factor, learning_rate_factor, warmup_factor
from flodl_mpi.training.task import ClassificationTask


def torch_lrs(make, steps: int) -> list[float]:
    """The lr torch's scheduler ``make(optimizer)`` gives at steps 0..steps-1 (base lr 1: the factor)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = make(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize(
    "name, make",
    [
        ("cosine", lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=37)),
        ("linear", lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=1.0, end_factor=0.0, total_iters=37)),
        ("step", lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.3)),
    ],
)
def test_each_schedule_after_the_warm_up_is_torchs(name, make):
    # 7 warm-up steps, then torch's scheduler from its step 0 over the 37 steps left of 44
    ours = [decay_factor(name, s, 44, 7, step_size=5, gamma=0.3) for s in range(44)]
    assert ours[:7] == [1.0] * 7
    np.testing.assert_allclose(ours[7:], torch_lrs(make, 37), rtol=1e-12, atol=1e-15)


def test_the_closed_forms_by_hand():
    assert decay_factor("cosine", 10 + 18, 46, 10) == pytest.approx(0.5)  # half way: (1 + cos(pi/2)) / 2
    assert decay_factor("linear", 10 + 9, 46, 10) == pytest.approx(0.75)  # a quarter of 36 steps
    assert decay_factor("step", 10 + 11, 46, 10, step_size=4, gamma=0.5) == 0.5**2
    assert decay_factor("constant", 45, 46, 10) == 1.0
    with pytest.raises(ValueError, match="no step after the warm-up"):
        decay_factor("cosine", 0, 10, 10)


def test_the_warm_up_rises_from_0_or_with_scale_lr_from_the_lr():
    # from 0: (step + 1) / warmup, the step-0 factor torch's LinearLR(start_factor=1/warmup) starts at
    assert [warmup_factor(s, 4, 3, False) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    ref = torch_lrs(lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.25, total_iters=3), 6)
    np.testing.assert_allclose([warmup_factor(s, 4, 1, False) for s in range(6)], ref, rtol=1e-12)
    # Goyal et al.: from 1 to W over the warm-up; at W = 1 there is nothing to warm up to
    assert [warmup_factor(s, 4, 3, True) for s in range(5)] == [1.5, 2.0, 2.5, 3.0, 3.0]
    assert warmup_factor(0, 4, 1, True) == 1.0 and warmup_factor(0, 0, 1, False) == 1.0
    # the schedule multiplies the warm-up
    f = learning_rate_factor(20, 2, True, 4, lambda s: decay_factor("cosine", s, 40, 4))
    assert f == pytest.approx(2.0 * (1 + math.cos(math.pi * 16 / 36)) / 2)


def test_the_task_binds_the_named_schedule_to_the_runs_length_and_sets_the_lr():
    cfg = TrainConfig(lr=0.1, lr_schedule="cosine", warmup_steps=5, epochs=2)
    task = ClassificationTask(cfg, world_size=2)
    task.set_total_steps(30)
    model = torch.nn.Linear(2, 1)
    opt = task.make_optimizer(cfg, model)
    model(torch.ones(1, 2)).sum().backward()
    for step in (0, 4, 5, 17, 29):
        assert task.step(model, opt, step) is True
        want = 0.1 * min(1.0, (step + 1) / 5) * (1 + math.cos(math.pi * max(step - 5, 0) / 25)) / 2
        assert opt.param_groups[0]["lr"] == pytest.approx(want, rel=1e-12)
    with pytest.raises(
        ValueError,
        match=r"--warmup-steps 30 covers the whole run \(30 cohort steps: --epochs 2 x "
        r"15 steps\), leaving --lr-schedule linear nothing to decay over",
    ):
        ClassificationTask(TrainConfig(lr_schedule="linear", warmup_steps=30, epochs=2)).set_total_steps(30)


def test_the_config_refuses_what_a_schedule_does_not_take():
    with pytest.raises(ConfigError, match="^--lr-schedule step needs --lr-step-size N"):
        TrainConfig(lr_schedule="step")
    with pytest.raises(
        ConfigError,
        match="^--lr-step-size and --lr-gamma take effect with --lr-schedule step; --lr-schedule cosine does not",
    ):
        TrainConfig(lr_schedule="cosine", lr_gamma=0.5)
    with pytest.raises(ConfigError, match=r"^--lr-gamma 1.5: must be a number in \(0, 1\]"):
        TrainConfig(lr_schedule="step", lr_step_size=3, lr_gamma=1.5)
    with pytest.raises(ConfigError, match="^--lr-schedule 'exp': must be one of constant, cosine, step, linear"):
        TrainConfig(lr_schedule="exp")
    with pytest.raises(ConfigError, match="^--accumulate 0: must be an integer >= 1"):
        TrainConfig(accumulate=0)
    with pytest.raises(ConfigError, match="^--amp 'fp8': must be one of off, bf16, fp16"):
        TrainConfig(amp="fp8")
    assert TrainConfig(lr_schedule="step", lr_step_size=3).lr_gamma_value == 0.1


@pytest.mark.parametrize(
    "n, batch, k, drop_last",
    [
        (1437, 8, 4, False),
        (1437, 8, 4, True),
        (65, 8, 4, False),
        (33, 8, 4, False),
        (10, 8, 4, False),
        (31, 8, 4, True),
        (1437, 32, 1, False),
    ],
)
def test_micro_batches_cover_each_step_once_weighted_by_their_samples(n, batch, k, drop_last):
    perm = np.random.default_rng(0).permutation(n)
    steps = num_batches(n, batch * k, drop_last)
    seen, sizes = [], []
    for b in range(steps):
        step = batch_indices(perm, batch * k, b, drop_last)
        parts = micro_batches(step, batch)
        assert sum(w for _, w in parts) == pytest.approx(1.0)
        assert all(w == len(p) / len(step) for p, w in parts)
        assert np.array_equal(np.concatenate([p for p, _ in parts]), step)  # in order, each once
        assert len(parts) <= k and all(len(p) <= batch + 1 for p, _ in parts)
        seen.append(step)
        sizes += [len(p) for p, _ in parts]
    covered = np.concatenate(seen) if seen else np.array([], dtype=int)
    assert len(covered) == len(set(covered.tolist()))  # no sample twice in an epoch
    if not drop_last:
        assert sorted(covered.tolist()) == list(range(n))
    assert smallest_micro_batch(n, batch, k, drop_last) == (min(sizes) if sizes else 0)
