import numpy as np
import pytest
import torch

from flodl_mpi.outputs.checkpoint import read_checkpoint, write_checkpoint
from flodl_mpi.training.models import digits_mlp
from flodl_mpi.training.rank_state import capture, restore, restore_integer_buffers


def train(model, opt, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(16, 64, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.Adam(p, lr=1e-3),
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01),
], ids=["adam", "sgd", "adamw"])
def test_state_survives_a_checkpoint_file_exactly(tmp_path, make_opt):
    torch.manual_seed(0)
    model = digits_mlp((64,), 10, hidden=16)
    opt = make_opt(model.parameters())
    train(model, opt, 3, seed=1)
    arrays, attrs = capture(opt, global_step=3)
    path = write_checkpoint(tmp_path / "c.h5", {}, {}, {}, [], ranks=[(arrays, attrs)])
    reference_next = torch.rand(4)  # the RNG stream after the capture

    # A fresh replica of the same parameters, restored from the file ...
    clone = digits_mlp((64,), 10, hidden=16)
    clone.load_state_dict(model.state_dict())
    clone_opt = make_opt(clone.parameters())
    saved_arrays, saved_attrs = read_checkpoint(path).ranks[0]
    assert restore(clone_opt, saved_arrays, saved_attrs) == 3
    assert torch.equal(torch.rand(4), reference_next)
    # ... takes exactly the same next steps as the original.
    train(model, opt, 2, seed=2)
    train(clone, clone_opt, 2, seed=2)
    for a, b in zip(model.parameters(), clone.parameters()):
        assert torch.equal(a, b)


def test_restore_refuses_another_optimizer():
    model = digits_mlp((64,), 10, hidden=8)
    arrays, attrs = capture(torch.optim.Adam(model.parameters()), 0)
    with pytest.raises(ValueError, match="holds Adam state, the run uses SGD"):
        restore(torch.optim.SGD(model.parameters(), lr=0.1), arrays, attrs)
    assert np.asarray(arrays["rng/torch"]).dtype == np.uint8


def test_integer_buffers_are_each_ranks_own_and_survive_odd_names(tmp_path):
    def make():
        return torch.nn.ModuleDict({"bn/a": torch.nn.BatchNorm1d(4), "bn%b": torch.nn.ModuleDict(
            {"x/y": torch.nn.BatchNorm1d(2)})})

    model = make()
    model["bn/a"](torch.randn(8, 4))
    for _ in range(3):
        model["bn%b"]["x/y"](torch.randn(8, 2))
    arrays, attrs = capture(torch.optim.SGD(model.parameters(), lr=0.1), 4, model)
    assert sorted(k for k in arrays if k.startswith("int_buffers/")) == [
        "int_buffers/bn%25b.x%2Fy.num_batches_tracked", "int_buffers/bn%2Fa.num_batches_tracked"]
    path = write_checkpoint(tmp_path / "c.h5", {}, {}, {}, [], ranks=[(arrays, attrs)])

    fresh = make()
    saved, _ = read_checkpoint(path).ranks[0]
    assert sorted(restore_integer_buffers(fresh, saved)) == ["bn%b.x/y.num_batches_tracked",
                                                            "bn/a.num_batches_tracked"]
    assert int(fresh["bn/a"].num_batches_tracked) == 1 and int(fresh["bn%b"]["x/y"].num_batches_tracked) == 3
    assert restore_integer_buffers(fresh, {"rng/torch": arrays["rng/torch"]}) == []  # schema 1: nothing per rank
    with pytest.raises(ValueError, match="does not fit the model"):
        restore_integer_buffers(torch.nn.Linear(2, 2), saved)
