"""The Python API refuses a model that differs across ranks as the CLI does (the same check)."""

import pytest
import torch
from torch import nn

import flodl_mpi
from flodl_mpi.errors import InputError


@pytest.mark.mpi
def test_the_averager_refuses_a_parameter_free_layer_that_differs_across_ranks():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    act = nn.ReLU() if comm.rank == 0 else nn.Tanh()  # no tensors: model_signature alone matches
    model = nn.Sequential(nn.Linear(8, 4), act, nn.Linear(4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(InputError) as info:
        flodl_mpi.Averager(model, optimizer=opt, policy="window", window=2)
    ranks = ", ".join(str(r) for r in range(1, comm.size))
    assert str(info.value) == (f"the model differs across ranks: module '1' is ReLU on rank 0 but Tanh on rank(s) "
                               f"{ranks} (every rank must build the same model)")
    assert comm.allgather(comm.rank) == list(range(comm.size))  # the world still works after the refusal
