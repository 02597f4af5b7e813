"""A resume compares the model with the one its checkpoint was written for (trial6 F4):
a changed layer class, shape, tensor set or dtype is refused with one line, exit 2,
before anything is touched; on the CLI, in ``fit`` and in an own loop's Averager
(one resume function). Checkpoints without the record are compared by their tensors.

The runs are at a world of 1 in forked children of pytest (tests/conftest.py's fork_flodl and
fork_python;
they were 2-rank launches on the CLI, 1-rank launches for the Averager): the comparison is of the model
with the checkpoint's record, the same on every rank; every rank of a launched run refusing with one line
between them, exit 2, is tests/cli/test_cli.py's."""

from __future__ import annotations

import json
import textwrap
import time

import h5py
import numpy as np
import pytest
from torch import nn

from flodl_mpi.outputs.checkpoint import latest_checkpoint, read_checkpoint
from flodl_mpi.training.model_record import model_record, resume_difference
from tests.conftest import fork_flodl, fork_python


def _net(act=nn.ReLU, hidden=32, extra=False):
    layers = [nn.Flatten(), nn.Linear(64, hidden), act(), nn.Dropout(0.1), nn.Linear(hidden, 10)]
    return nn.Sequential(*layers, *([nn.Linear(10, 10)] if extra else []))


def _meta_and_arrays(model):
    state = {k: v.detach().numpy().astype(np.float32) if v.is_floating_point() else v.numpy()
             for k, v in model.state_dict().items()}
    return {"model": model_record(model)}, state


# ------------------------------------------------------------------ the comparison itself (pure)

def test_the_same_model_matches():
    meta, arrays = _meta_and_arrays(_net())
    assert resume_difference(_net(), meta, arrays) is None
    assert resume_difference(_net(), {}, arrays) is None      # an older checkpoint, the same tensors


def test_a_changed_layer_class_is_named():
    meta, arrays = _meta_and_arrays(_net())
    assert resume_difference(_net(nn.Tanh), meta, arrays) == "module '2' is Tanh, the checkpoint's is ReLU"


def test_a_changed_shape_is_named_with_both_shapes():
    meta, arrays = _meta_and_arrays(_net())
    assert resume_difference(_net(hidden=48), meta, arrays) == (
        "parameter '1.weight' shape (48, 64), the checkpoint's (32, 64)")


def test_an_added_layer_is_named():
    meta, arrays = _meta_and_arrays(_net())
    assert resume_difference(_net(extra=True), meta, arrays) == (
        "the model has module '5' (Linear) where the checkpoint's has no further module")


def test_a_changed_dtype_is_named():
    meta, arrays = _meta_and_arrays(_net())
    assert resume_difference(_net().half(), meta, arrays) == (
        "parameter '1.weight' dtype float16, the checkpoint's float32")


def test_a_changed_buffer_is_named():
    a = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    b = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, track_running_stats=False))
    meta, arrays = _meta_and_arrays(a)
    assert resume_difference(b, meta, arrays) == (
        "the model has no further tensor where the checkpoint's has buffer '1.running_mean' (4,) float32")


@pytest.mark.parametrize(("model", "want"), [
    (_net(hidden=48), "'1.weight' shape (48, 64), the checkpoint's (32, 64)"),
    (_net(extra=True), "the model has '5.weight' (10, 10), which the checkpoint does not hold"),
])
def test_an_older_checkpoint_is_compared_by_its_tensors(model, want):
    _, arrays = _meta_and_arrays(_net())
    assert resume_difference(model, {}, arrays) == want
    fewer = _meta_and_arrays(_net(extra=True))[1]
    assert resume_difference(_net(), {}, fewer) == (
        "the checkpoint holds '5.weight' (10, 10), which the model does not have")


# ------------------------------------------------------------------ the CLI, end to end

MODEL = """
from torch import nn
def make(input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], 32), nn.ReLU(), nn.Dropout(0.1),
                         nn.Linear(32, num_classes))
"""


def _files(run_dir):
    return {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name != "train.log"}


def _refused(proc, start, want):
    assert time.monotonic() - start < 200
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "error" in ln]
    assert len(lines) == 1, proc.stderr
    assert "the model differs from the one ckpt-e000001-" in lines[0] and want in lines[0], lines[0]
    assert "Error(s) in loading state_dict" not in proc.stderr + proc.stdout


@pytest.mark.slow
def test_the_cli_refuses_an_edited_model_file_on_resume(tmp_path):
    model = tmp_path / "nets.py"
    model.write_text(MODEL)
    run_dir = tmp_path / "run"
    first = fork_flodl("train", "--model", f"{model}:make", "--epochs", "1", "--run-dir", str(run_dir), "-q",
                       timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    assert read_checkpoint(ckpt, ranks=[]).meta["model"]["modules"][3] == ["2", "ReLU"]
    before = _files(run_dir)
    for edit, want in [(("nn.ReLU()", "nn.Tanh()"), "module '2' is Tanh, the checkpoint's is ReLU"),
                       (("32", "48"), "parameter '1.weight' shape (48, 64), the checkpoint's (32, 64)")]:
        model.write_text(MODEL.replace(*edit))
        start = time.monotonic()
        proc = fork_flodl("train", "--model", f"{model}:make", "--epochs", "2", "--run-dir", str(run_dir),
                          "--resume", "-q", timeout=300)
        _refused(proc, start, want)
        assert _files(run_dir) == before          # nothing touched: no record, no checkpoint, no metrics row
    # A checkpoint of an older flodl-mpi (no record): compared by its tensors, still one line, exit 2.
    with h5py.File(ckpt, "a") as f:
        keys = [k for k in json.loads(f.attrs["json_keys"]) if k != "model"]
        f.attrs["json_keys"] = json.dumps(keys)
        del f.attrs["model"]
    start = time.monotonic()
    proc = fork_flodl("train", "--model", f"{model}:make", "--epochs", "2", "--run-dir", str(run_dir),
                      "--resume", "-q", timeout=300)
    _refused(proc, start, "'1.weight' shape (48, 64), the checkpoint's (32, 64)")


# ------------------------------------------------------------------ an own loop's Averager

OWN = """
import sys, torch, flodl_mpi
from torch import nn
variant, epochs, resume = sys.argv[1], int(sys.argv[2]), len(sys.argv) > 3
torch.manual_seed(0)
act = nn.Tanh() if variant == "tanh" else nn.ReLU()
m = nn.Sequential(nn.Linear(4, 8), act, nn.Linear(8, 2), *([nn.Linear(2, 2)] if variant == "extra" else []))
opt = torch.optim.SGD(m.parameters(), lr=0.1)
x = torch.randn(64, 4); y = (x[:, 0] > 0).long()
with flodl_mpi.Averager(m, optimizer=opt, run_dir=sys.argv[0] + ".run", resume=resume) as avg:
    for e in range(avg.epoch, epochs):
        for i in range(avg.rank, 8 - 8 % avg.world_size, avg.world_size):
            opt.zero_grad(); l = nn.functional.cross_entropy(m(x[i*8:(i+1)*8]), y[i*8:(i+1)*8]); l.backward()
            opt.step(); avg.step(l, samples=8)
        avg.end_epoch({"loss": (l.detach(), 1)})
"""


@pytest.mark.slow
def test_the_averager_refuses_a_changed_model_on_resume(tmp_path):
    script = tmp_path / "own.py"
    script.write_text(textwrap.dedent(OWN))

    def own(*args):
        return fork_python(script, *args, timeout=300)

    first = own("relu", "1")
    assert first.returncode == 0, first.stdout + first.stderr
    run_dir = tmp_path / "own.py.run"
    before = _files(run_dir)
    for variant, want in [("tanh", "module '1' is Tanh, the checkpoint's is ReLU"),
                          ("extra", "the model has module '3' (Linear) where the checkpoint's has no further module")]:
        start = time.monotonic()
        proc = own(variant, "2", "resume")
        assert time.monotonic() - start < 200
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "the model differs from the one ckpt-e000001-" in proc.stderr and want in proc.stderr, proc.stderr
        assert "Missing key(s)" not in proc.stderr
        assert _files(run_dir) == before
    again = own("relu", "2", "resume")      # the run's own model still resumes
    assert again.returncode == 0, again.stdout + again.stderr
