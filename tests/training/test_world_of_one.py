"""A world of one (no launcher): the trainer, fit and the Averager step exactly as a plain PyTorch loop,
and what a round still does (its rows, the checkpoints) is all there (issue 26 item 10).

One process, no launcher: MPI starts as a singleton, so every test here runs at W = 1, each in a forked
child of the pytest process (the ``in_fork`` marker, tests/conftest.py): MPI started in the pytest process itself would stay there for
the later tests, whose forked runs (tests/conftest.py) it would break.
"""

import copy

import numpy as np
import pytest
import torch
from torch import nn

import flodl_mpi
from flodl_mpi.outputs.checkpoint import latest_checkpoint, read_checkpoint
from flodl_mpi.training.data import batch_indices, default_digits_path, ensure_digits, epoch_permutation, load_dataset, num_batches
from flodl_mpi.outputs.metrics import MetricsWriter, read_table
from flodl_mpi.training.models import digits_mlp

pytestmark = pytest.mark.in_fork

EPOCHS, BATCH = 2, 32


def ce_step(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def digits():
    ensure_digits(default_digits_path())
    return load_dataset(default_digits_path())


def batches(data, epochs=EPOCHS, batch_size=BATCH):
    """``(epoch, last batch of the epoch?, (x, y))`` in the trainer's order (each epoch's permutation)."""
    for epoch in range(epochs):
        perm = epoch_permutation(data.train.n, 0, epoch)
        n = num_batches(data.train.n, batch_size)
        for b in range(n):
            idx = batch_indices(perm, batch_size, b)
            yield epoch, b == n - 1, (torch.from_numpy(data.train.x[idx]), torch.from_numpy(data.train.y[idx]))


def train_step(model, opt, batch) -> torch.Tensor:
    """zero_grad, loss, backward, step: a plain PyTorch step."""
    opt.zero_grad(set_to_none=True)
    loss = ce_step(model, batch)
    loss.backward()
    opt.step()
    return loss


def plain_loop(model, make_opt, data, epochs=EPOCHS):
    """The reference: plain steps over each epoch's permutation, nothing else; the losses."""
    opt = make_opt(model.parameters())
    return [train_step(model, opt, batch).item() for _, _, batch in batches(data, epochs)]


def assert_same_bits(got: dict, want: dict):
    assert list(got) == list(want)
    for name, value in want.items():
        assert torch.equal(torch.as_tensor(got[name]), value), name


OPTIMIZERS = {
    # Adam: the default --average-optimizer-state (corrected) rebuilt the second moment from the first
    # at every round, off by float32 rounding at W = 1 (up to 7e-8 in the weights after 2 epochs)
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "sgd momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
}


@pytest.mark.slow  # trains: not in tests/run.sh --quick
@pytest.mark.parametrize("opt,policy,window", [("adam", "sync", 1), ("adam", "window", 3), ("sgd momentum", "sync", 1)])
def test_fit_at_one_rank_steps_as_a_plain_pytorch_loop_bit_for_bit(opt, policy, window):
    """issue 26 item 10: the consensus of a world of one is its own parameters (and optimizer state): fit's
    model after an epoch is the plain loop's, bit for bit, parameters and buffers (BatchNorm's statistics)."""
    data = digits()
    torch.manual_seed(3)
    model = digits_mlp((64,), 10, hidden=32)
    reference = copy.deepcopy(model)
    run = flodl_mpi.fit(model, OPTIMIZERS[opt], train_step=ce_step, batch_size=BATCH, epochs=1, eval_every=0,
                        policy=policy, window=window)
    history = run.wait()
    assert history[-1].summary.rounds == -(-num_batches(data.train.n, BATCH) // window)  # the rounds still run
    plain_loop(reference, OPTIMIZERS[opt], data, epochs=1)
    assert_same_bits(run.model.state_dict(), reference.state_dict())


@pytest.mark.slow  # trains: not in tests/run.sh --quick
def test_averager_at_one_rank_is_the_plain_loop_and_still_writes_its_rows_and_checkpoints(tmp_path):
    """issue 26 item 10: the Averager at W = 1 adopts nothing, yet every round counts: one ``rounds`` row per
    step() (version, steps, mass 1, divergence 0, pre_norm = post_norm = the model's norm), the epochs' rows,
    and checkpoints holding the model, which is the plain loop's bit for bit."""
    data = digits()
    torch.manual_seed(5)
    model = digits_mlp((64,), 10, hidden=32)
    reference = copy.deepcopy(model)
    want_losses = plain_loop(reference, OPTIMIZERS["adam"], data)
    opt = OPTIMIZERS["adam"](model.parameters())
    norms, steps = [], 0
    with flodl_mpi.Averager(model, optimizer=opt, run_dir=tmp_path / "run") as avg:
        assert avg.world_size == 1
        for _, last, batch in batches(data):
            update = avg.step(train_step(model, opt, batch))
            steps += 1
            assert update.version == steps and update.adopted and update.divergence == 0.0
            norms.append(np.sqrt(sum(float((p.detach().double() ** 2).sum()) for p in model.parameters())))
            if last:
                avg.end_epoch()
    assert_same_bits(model.state_dict(), reference.state_dict())
    rounds = read_table(tmp_path / "run" / "metrics.h5", "rounds")
    assert rounds["version"].tolist() == list(range(1, steps + 1))
    assert rounds["steps"].tolist() == [[1]] * steps and rounds["mass"].tolist() == [[1.0]] * steps
    assert (rounds["divergence"] == 0.0).all() and not rounds["skipped"].any()
    np.testing.assert_allclose(rounds["pre_norm"][:, 0], norms, rtol=1e-6)
    np.testing.assert_array_equal(rounds["post_norm"], rounds["pre_norm"][:, 0])
    epochs = read_table(tmp_path / "run" / "metrics.h5", "epochs")
    assert epochs["rounds"].tolist() == [steps // EPOCHS, steps]
    np.testing.assert_allclose(epochs["avg_loss"][-1] * (steps // EPOCHS), sum(want_losses[steps // EPOCHS:]),
                               rtol=1e-9)
    ckpt = read_checkpoint(latest_checkpoint(tmp_path / "run" / "checkpoints"))
    assert ckpt.meta["round"] == steps
    for name, value in reference.state_dict().items():
        saved = ckpt.params.get(name, ckpt.buffers.get(name))
        np.testing.assert_array_equal(saved, value.numpy(), err_msg=name)


def _round_row(i: int) -> dict:
    """One ``rounds`` row of a world of one whose values name the row."""
    one = np.array([float(i)])
    return {"round": i, "version": i + 1, "time_s": 0.5 * i, "skipped": False, "steps": np.array([1]),
            "mass": np.array([1.0]), "quarantined": np.array([False]), "divergence": np.zeros(1), "pre_norm": one,
            "post_norm": float(i), "pack_ms": one, "allreduce_ms": one, "unpack_ms": one, "outer_ms": one,
            "bytes": 0, "window": np.array([1]), "anchor": 1, "guard": 0, "quota": np.array([1]),
            "batch_ms": one, "round_ms": one, "wait_ms": one, "bridge_ms": one, "control_ms": one,
            "snapshot_ms": one, "adopt_ms": one, "link_bytes": 0, "link_ranks": 1, "link_ms": one,
            "busbw_gbs": one}


def test_held_round_rows_reach_the_file_before_anything_queued_after_them(tmp_path):
    """issue 26 item 10: rows a round are held and appended in blocks; a checkpoint (or an epoch's rows, a
    flush, the close) queued after them finds every one of them written, in order."""
    from flodl_mpi.outputs.metrics import HOLD_ROWS

    writer = MetricsWriter(tmp_path, 1, {"world_size": 1}, checkpoint_dir=tmp_path / "ck")
    writer.start()
    n = HOLD_ROWS + 7  # one block queued by the count, 7 rows held
    for i in range(n):
        writer.append_held("rounds", _round_row(i))
    writer.save_checkpoint("c.h5", {"w": np.ones(2, np.float32)}, {}, {"epoch": 1}, ["w"])
    assert writer.flush_wait(timeout=60)
    rounds = read_table(tmp_path / "metrics.h5", "rounds")
    assert rounds["round"].tolist() == list(range(n)) and rounds["post_norm"].tolist() == [float(i) for i in range(n)]
    assert (tmp_path / "ck" / "c.h5").exists()
    writer.append_held("rounds", _round_row(n))  # held at the close: written by it
    writer.close(timeout=60)
    assert read_table(tmp_path / "metrics.h5", "rounds")["round"].tolist() == list(range(n + 1))
