"""flodl_mpi.Averager's ``wire=`` (the CLI's ``--wire``): the refusals (serial, before MPI starts) and, over
2 ranks, ``wire="int8-delta"``'s consensus against a float64 numpy reference of the quantisation
(tests/transport/test_delta_wire.py's) and its state carried through a checkpoint and ``resume=True``."""

import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import flodl_mpi
from flodl_mpi.errors import InputError
from tests.transport.test_delta_wire import int8_ref


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(8, 3)


@pytest.mark.parametrize("kwargs, match", [
    ({"wire": "int4"}, r"^wire must be one of fp32, bf16, bf16-delta, int8-delta or None, got 'int4'$"),
    ({"wire": "int8-delta", "bf16_wire": True}, r"^bf16_wire=True with wire='int8-delta': bf16_wire=True is "
                                                r"wire='bf16'; give one of them$"),
    ({"wire": "bf16-delta", "node_reduce": "shm"}, r"^wire='bf16-delta' travels over MPI .* it does not run with "
                                                   r"node_reduce='shm': use node_reduce='mpi' or auto$"),
    ({"wire": "int8-delta", "hierarchical": "on"}, r"^wire='int8-delta' is flat over the world .* "
                                                   r"hierarchical='on' is not implemented with it"),
])
def test_wire_refusals_name_the_keywords(kwargs, match):
    with pytest.raises(InputError, match=match):
        flodl_mpi.Averager(model(), **kwargs)


def params(m: nn.Module) -> np.ndarray:
    return np.concatenate([p.detach().numpy().ravel() for p in m.parameters()])


def put(m: nn.Module, flat: np.ndarray) -> None:
    o = 0
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.from_numpy(flat[o:o + p.numel()].reshape(p.shape)))
            o += p.numel()


class _Layout:  # int8_ref's view of the model's tensors (weight, bias)
    def __init__(self, m):
        self.sizes = [p.numel() for p in m.parameters()]
        self.offsets = list(np.cumsum([0, *self.sizes]))
        self.n = int(sum(self.sizes))


@pytest.mark.mpi
def test_int8_delta_consensus_and_its_state_through_resume():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    run_dir = Path(comm.bcast(tempfile.mkdtemp(prefix="flodl-avgwire-") if rank == 0 else None, root=0)) / "r"
    m = model()
    lay = _Layout(m)
    rng = np.random.default_rng(7)
    thetas = [[rng.standard_normal(lay.n).astype(np.float32) * s for _ in range(size)] for s in (1.0, 1e-2, 1e-2)]
    with flodl_mpi.Averager(m, run_dir=run_dir, wire="int8-delta") as avg:
        assert avg.bridge.reducer.path == "allgather-int8-delta" and avg.cfg.wire_mode == "int8-delta"
        put(m, thetas[0][rank])
        avg.step(realized=True)  # round 1: the exact float64 mean, which becomes the reference
        c = (sum(t.astype(np.float64) for t in thetas[0]) / size).astype(np.float32)
        np.testing.assert_array_equal(params(m), c)
        errors = [np.zeros(lay.n, np.float32) for _ in range(size)]
        for r in (1, 2):  # the quantised deltas with error feedback (equal masses: one step each)
            put(m, c + thetas[r][rank])
            avg.step(realized=True)
            ds = [(c + t - c) + e for t, e in zip(thetas[r], errors)]
            deq = int8_ref(ds, lay)
            c = (c.astype(np.float64) + sum(deq) / size).astype(np.float32)
            errors = [(d.astype(np.float64) - q).astype(np.float32) for d, q in zip(ds, deq)]
            np.testing.assert_allclose(params(m), c, rtol=0, atol=1e-7)
        avg.end_epoch()  # checkpoint: the reference (cohort) and each rank's error feedback
        saved = avg.bridge.wire_state()
    assert np.abs(errors[rank]).max() > 1e-6  # the feedback is not zero: its restore is tested
    np.testing.assert_allclose(saved[2]["wire/error/params"], errors[rank], rtol=0, atol=1e-7)
    np.testing.assert_allclose(saved[0]["wire_reference_params"], c, rtol=0, atol=1e-7)  # the last consensus
    m2 = nn.Linear(8, 3)
    with flodl_mpi.Averager(m2, run_dir=run_dir, wire="int8-delta", resume=True) as avg:
        back = avg.bridge.wire_state()
        np.testing.assert_array_equal(back[0]["wire_reference_params"], saved[0]["wire_reference_params"])
        np.testing.assert_array_equal(back[2]["wire/error/params"], saved[2]["wire/error/params"])
        assert back[1] == saved[1]
    if rank == 0:
        log = (run_dir / "train.log").read_text()
        assert "--wire int8-delta: the reference and each rank's error feedback restored from the checkpoint" in log
