"""A model the float32 consensus would round is refused at start (trial6 F1): a float64
(or complex) parameter or floating buffer, on the CLI, in ``fit`` and in an ``Averager``:
exit 2, one line naming the tensor, nothing trained, no run dir. float16/bfloat16 pass.

The runs are at a world of 1 in forked children of pytest (tests/conftest.py's fork_flodl and
fork_python;
they were a 2-rank launch and 1-rank launches): the refusal is the model's, decided before any peer
matters; that every rank of a launched run refuses with one line between them, exit 2, is
tests/cli/test_cli.py's (test_models_that_differ_across_ranks_are_refused and the missing data file's)."""

from __future__ import annotations

import textwrap
import time

import pytest
import torch
from torch import nn

from flodl_mpi.training.models import wide_tensor
from tests.conftest import fork_flodl, fork_python

TAIL = ("flodl_mpi averages and checkpoints in float32, which would round it at every round; "
        "cast the model to float32 first (model.float())")


class _Stats(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))
        self.register_buffer("scale", torch.ones(2, dtype=dtype))


@pytest.mark.parametrize(("model", "want"), [
    (nn.Sequential(nn.Linear(2, 2)).double(), "parameter '0.weight' is float64"),
    (nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double()), "parameter '1.weight' is float64"),
    (_Stats(torch.float64), "buffer 'scale' is float64"),
])
def test_the_first_tensor_the_consensus_would_round_is_named(model, want):
    assert wide_tensor(model) == f"{want}: {TAIL}"


def test_a_complex_parameter_is_named():
    model = nn.ParameterDict({"z": nn.Parameter(torch.zeros(2, dtype=torch.complex64))})
    assert wide_tensor(model) == ("parameter 'z' is complex64: flodl_mpi averages and checkpoints real float32 "
                                  "tensors; hold the real and imaginary parts as two float32 parameters")


@pytest.mark.parametrize("model", [nn.Linear(2, 2), nn.Linear(2, 2).half(), nn.Linear(2, 2).bfloat16(),
                                   _Stats(torch.float32), _Stats(torch.float16),
                                   nn.BatchNorm1d(3)])   # an int64 buffer (num_batches_tracked) is not averaged
def test_float32_float16_bfloat16_and_integer_buffers_pass(model):
    assert wide_tensor(model) is None


def _one_error_line(proc, start, want):
    assert time.monotonic() - start < 200
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and want in lines[0] and TAIL in lines[0], proc.stderr


@pytest.mark.slow
def test_the_cli_refuses_a_float64_model_before_training(tmp_path):
    (tmp_path / "nets.py").write_text(textwrap.dedent("""
        from torch import nn
        def make(input_shape, num_classes):
            return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], num_classes)).double()
    """))
    start = time.monotonic()
    proc = fork_flodl("train", "--model", f"{tmp_path / 'nets.py'}:make", "--epochs", "1",
                      "--run-dir", str(tmp_path / "run"), "-q", timeout=300)
    _one_error_line(proc, start, f"--model '{tmp_path / 'nets.py'}:make': parameter '1.weight' is float64")
    assert not (tmp_path / "run").exists()      # refused before the run dir is made


SCRIPT = """
import sys, torch, flodl_mpi
from torch import nn
api, what = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
if what == "param":
    m = m.double()
else:
    m.register_buffer("scale", torch.ones(2, dtype=torch.float64))
run_dir = sys.argv[0] + "." + api + what
if api == "averager":
    opt = torch.optim.SGD(m.parameters(), lr=1e-9)
    with flodl_mpi.Averager(m, optimizer=opt, run_dir=run_dir) as avg:
        print("TRAINED", flush=True)
else:
    x = torch.randn(64, 4); y = (x[:, 0] > 0).long()
    flodl_mpi.fit(m, "sgd", data=((x.numpy(), y.numpy()), (x.numpy(), y.numpy())), epochs=1, run_dir=run_dir)
    print("TRAINED", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize(("api", "what", "want"), [
    ("averager", "param", "parameter '0.weight' is float64"),
    ("averager", "buffer", "buffer 'scale' is float64"),
    ("fit", "param", "parameter '0.weight' is float64"),
])
def test_fit_and_the_averager_refuse_a_float64_model(tmp_path, api, what, want):
    script = tmp_path / "own.py"
    script.write_text(textwrap.dedent(SCRIPT))
    start = time.monotonic()
    proc = fork_python(script, api, what, timeout=300)
    assert "TRAINED" not in proc.stdout
    _one_error_line(proc, start, want)
    assert not (tmp_path / f"own.py.{api}{what}").exists()
