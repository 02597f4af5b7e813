"""flodl_mpi.fit and flodl_mpi.Averager on every rank, in process (pytest-mpi): accuracy, the own
loop's consensus against the trainer's, record_scalar across ranks, intents from one rank."""

import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import flodl_mpi
from flodl_mpi.policy.cadence import fixed_quotas, plan_window
from flodl_mpi.training.data import (
    batch_indices,
    default_digits_path,
    ensure_digits,
    epoch_permutation,
    load_dataset,
    num_batches,
)
from flodl_mpi.outputs.metrics import read_table
from flodl_mpi.training.models import digits_mlp

pytestmark = pytest.mark.mpi


def shared_dir(comm) -> Path:
    """A fresh directory that every rank names alike (rank 0 makes it)."""
    return Path(comm.bcast(tempfile.mkdtemp(prefix="flodl-api-") if comm.rank == 0 else None, root=0))


def ce_step(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def test_train_step_api_reaches_the_cli_accuracy_on_digits():
    """5 epochs of the built-in digits: the CLI's end-to-end test asks >= 0.93 at 1-3 ranks."""
    run = flodl_mpi.fit(train_step=ce_step, epochs=5)
    history = run.wait()
    assert [h.epoch for h in history] == [1, 2, 3, 4, 5] and run.done
    acc = history[-1].metrics["accuracy"]
    assert acc == history[-1].summary.test_accuracy
    from mpi4py import MPI

    assert len(set(MPI.COMM_WORLD.allgather(acc))) == 1  # identical on every rank
    assert acc >= 0.93


def test_fit_runs_the_balanced_policies_with_rounds_inside_epochs():
    """cadence and async plan windows of --anchor batches: rounds fall inside epochs, and async's
    blended adoption needs a replica that is not bound to the staging."""
    from mpi4py import MPI

    from flodl_mpi.errors import InputError

    with pytest.raises(InputError, match="fit\\(\\) got unknown option\\(s\\) bogus; the options it takes by name "
                                         "are accumulate, amp, anchor, async_adopt, average_optimizer_state, batch_size"):
        flodl_mpi.fit(train_step=ce_step, epochs=1, bogus=3)
    for policy in ("cadence", "async"):
        # any other CLI option by its config name: the anchor of the balanced policies
        run = flodl_mpi.fit(train_step=ce_step, epochs=2, policy=policy, batch_size=16, anchor=4)
        history = run.wait()
        assert run.done and [h.epoch for h in history] == [1, 2]
        n_batches = num_batches(1437, 16, False)  # the built-in digits' training split
        assert 1 < history[-1].summary.rounds < 2 * n_batches  # windows of several batches, several per epoch
        assert len(set(MPI.COMM_WORLD.allgather(history[-1].metrics["accuracy"]))) == 1


def test_own_loop_gives_the_trainers_consensus_for_the_same_steps():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, W = comm.rank, comm.size
    bs = 64

    def model():
        torch.manual_seed(3)
        return digits_mlp((64,), 10, hidden=32)

    # -- the trainer: one epoch, plain SGD (no state: the same step from the same values)
    run = flodl_mpi.fit(model(), lambda p: torch.optim.SGD(p, lr=0.05), train_step=ce_step, batch_size=bs,
                          epochs=1, eval_every=0)
    run.wait()
    trained = {k: v.clone() for k, v in run.model.state_dict().items()}

    # -- the same batches through the user's own loop and the Averager
    ensure_digits(default_digits_path()) if rank == 0 else None
    comm.Barrier()
    data = load_dataset(default_digits_path())
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    perm = epoch_permutation(data.train.n, 0, 0)
    n_batches, cursor = num_batches(data.train.n, bs), 0
    with flodl_mpi.Averager(net, optimizer=opt) as avg:
        while cursor < n_batches:
            w = plan_window(fixed_quotas(W, 1), cursor, n_batches)
            if w.counts[rank]:
                idx = batch_indices(perm, bs, w.starts[rank])
                opt.zero_grad(set_to_none=True)
                ce_step(net, (torch.from_numpy(data.train.x[idx]), torch.from_numpy(data.train.y[idx]))).backward()
                opt.step()
                avg.step()
            else:
                avg.step(realized=False)  # no batch left for this rank: it joins with mass 0
            cursor = w.end
    for name, value in net.state_dict().items():
        torch.testing.assert_close(value, trained[name], rtol=1e-6, atol=1e-7, msg=name)


def test_record_scalar_is_batch_weighted_across_ranks():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, W = comm.rank, comm.size
    gen = np.random.default_rng(0)
    x, y = gen.normal(size=(24, 4)).astype(np.float32), gen.integers(0, 3, 24)
    # 24 samples in batches of 8: 3 global batches; at W=2 rank 0 trains 2 and rank 1 one.

    def step(model, batch):
        for _ in range(rank + 1):  # rank r records 10r + 1, r + 1 times per batch
            flodl_mpi.record_scalar("s", 10.0 * rank + 1.0)
        return ce_step(model, batch)

    run_dir = shared_dir(comm)
    run = flodl_mpi.fit(lambda input_shape: nn.Linear(input_shape[0], 3), train_step=step,
                          data={"train": (x, y), "test": (x, y)}, batch_size=8, epochs=2, run_dir=run_dir / "r")
    result = run.wait()[-1]  # epoch 2: the default eval of epoch 1 (it calls the step) records nothing
    batches = [sum(plan_window(fixed_quotas(W, 1), c, 3).counts[r] for c in range(0, 3, W)) for r in range(W)]
    expected = sum(b * (10.0 * r + 1.0) for r, b in enumerate(batches)) / sum(batches)
    if W == 2:
        assert batches == [2, 1] and expected == pytest.approx(13 / 3)  # the hand-worked case (test_scalars)
    assert result.scalars["s"] == pytest.approx(expected, rel=1e-12)
    if rank == 0:
        rows = read_table(run_dir / "r" / "metrics.h5", "scalars")
        row = len(rows["name"]) - 1 - rows["name"].tolist()[::-1].index(b"s")  # epoch 2's row
        assert rows["epoch"][row] == 2
        assert rows["value"][row] == pytest.approx(expected, rel=1e-12)
        assert rows["count"][row] == sum(b * (r + 1) for r, b in enumerate(batches))
        np.testing.assert_allclose(rows["per_rank_mean"][row], [10.0 * r + 1.0 for r in range(W)])


def test_an_intent_of_one_rank_acts_on_every_rank_at_the_same_epoch():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.rank
    run_dir = shared_dir(comm)
    run = flodl_mpi.fit(train_step=ce_step, epochs=3, eval_every=0, checkpoint_every=0, run_dir=run_dir / "i",
                          batch_size=128)
    for epoch in run:
        if epoch.epoch == 1 and rank == comm.size - 1:  # the last rank alone (rank 1 at W=2)
            run.request_eval()
            run.request_checkpoint()
    seen = comm.allgather([(h.epoch, h.intents, sorted(h.metrics)) for h in run.history])
    assert all(s == seen[0] for s in seen)  # every rank saw the same
    assert seen[0] == [(1, (), []), (2, ("eval", "checkpoint"), ["accuracy", "loss"]), (3, (), ["accuracy", "loss"])]
    assert run.last_eval[0] == 3 and set(run.last_eval[1]) == {"accuracy", "loss"}
    if rank == 0:
        names = sorted(p.name[:12] for p in (run_dir / "i" / "checkpoints").glob("ckpt-*.h5"))
        assert names == ["ckpt-e000002", "ckpt-e000003"]  # the asked one, and the last


def test_scale_lr_and_a_schedule_follow_the_cohort_step():
    """The lr of every batch record: lr0 x (linear scaling with warm-up) x schedule, at the batch's cohort step."""
    from mpi4py import MPI

    from flodl_mpi.training.task import learning_rate_factor

    comm = MPI.COMM_WORLD
    W = comm.size
    run_dir = shared_dir(comm)
    gen = np.random.default_rng(1)
    x, y = gen.normal(size=(40, 3)).astype(np.float32), gen.normal(size=(40, 2)).astype(np.float32)
    run = flodl_mpi.fit(lambda input_shape, target_shape: nn.Linear(input_shape[0], target_shape[0]),
                        lambda p: torch.optim.SGD(p, lr=0.01), data=((x, y), (x, y)), batch_size=4, epochs=2,
                        scale_lr=True, warmup_steps=6, lr_schedule=lambda s: 1.0 / (1 + s), clip_grad_norm=0.5,
                        run_dir=run_dir / "lr")
    run.wait()
    if comm.rank == 0:
        b = read_table(run_dir / "lr" / "metrics.h5", "batches")
        # sync: in each epoch rank r trains global batches r, r + W, ... (10 per epoch); its k-th is r + kW
        for rank in range(W):
            mine = b["rank"] == rank
            per_epoch = len(range(rank, 10, W))
            k = np.arange(mine.sum())
            cohort = (k // per_epoch) * 10 + rank + (k % per_epoch) * W
            expected = [0.01 * learning_rate_factor(int(c), W, True, 6, lambda s: 1.0 / (1 + s)) for c in cohort]
            np.testing.assert_allclose(b["lr"][mine], expected, rtol=1e-12)


def test_resume_continues_the_run_and_keeps_the_scalars_of_the_epochs_done():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    run_dir = shared_dir(comm) / "resume"

    def step(model, batch):
        flodl_mpi.record_scalar("one", 1.0)
        return ce_step(model, batch)

    def make(input_shape, num_classes):
        return nn.Linear(input_shape[0], num_classes)

    def sgd(params):
        return torch.optim.SGD(params, lr=0.05, momentum=0.5)

    first = flodl_mpi.fit(make, sgd, train_step=step, epochs=2, batch_size=128, run_dir=run_dir).wait()
    assert [h.epoch for h in first] == [1, 2]
    run = flodl_mpi.fit(make, sgd, train_step=step, epochs=4, batch_size=128, run_dir=run_dir, resume=True)
    group = run.optimizer.param_groups[0]
    assert (group["lr"], group["momentum"]) == (0.05, 0.5)  # the factory's, not the config's defaults
    assert run.optimizer.state  # the momentum buffers came back
    again = run.wait()
    assert [h.epoch for h in again] == [3, 4]
    if comm.rank == 0:
        rows = read_table(run_dir / "metrics.h5", "scalars")
        ones = rows["name"] == b"one"
        np.testing.assert_array_equal(rows["epoch"][ones], [1, 2, 3, 4])  # epochs 1-2 kept, 3-4 added
        np.testing.assert_array_equal(read_table(run_dir / "metrics.h5", "epochs")["epoch"], [1, 2, 3, 4])


@pytest.mark.parametrize("policy", ["sync", "cadence"])
def test_a_frozen_layer_and_an_unused_parameter_stay_bit_identical_over_a_run(policy):
    """issue 26 item 5: a frozen (``requires_grad=False``) layer and a parameter no step touches hold the
    same values on every rank, so every round gives them back unchanged: after a multi-round fit (sync:
    equal masses; cadence: unequal quotas) they are bit for bit rank 0's initial values (broadcast at
    the start), while the trained layer moved and is the same on every rank. Before, at W = 3 the float32
    sums drifted the frozen layer by ulps every round."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    torch.manual_seed(comm.rank)  # different initial values per rank: rank 0's are broadcast
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    net[0].requires_grad_(False)
    net.register_parameter("unused", nn.Parameter(torch.randn(5)))
    initial = comm.bcast({k: v.detach().clone() for k, v in net.state_dict().items()}, root=0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((120, 8)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0)
    run = flodl_mpi.fit(net, train_step=ce_step, data=((x, y), (x[:30], y[:30])), epochs=2, batch_size=8, lr=1e-2,
                        policy=policy, **({"anchor": 2} if policy == "cadence" else {}))
    history = run.wait()
    assert run.done and sum(h.summary.rounds for h in history) >= 4  # several rounds
    final = run.model.state_dict()
    for name in ("0.weight", "0.bias", "unused"):
        assert final[name].numpy().tobytes() == initial[name].numpy().tobytes(), name
    assert not torch.equal(final["2.weight"], initial["2.weight"])  # the trained layer moved
    assert len(set(comm.allgather(final["2.weight"].numpy().tobytes()))) == 1
