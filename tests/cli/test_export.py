"""flodl-mpi export: a checkpoint as a plain state dict that a fresh nn.Module loads."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch
from torch import nn

from flodl_mpi.outputs.checkpoint import latest_checkpoint, load_state_dict, read_checkpoint, write_checkpoint
from flodl_mpi.cli.export import main
from flodl_mpi.outputs.metrics import read_table
from tests._runs import session_run_a


@pytest.fixture(scope="session")
def run_a(tmp_path_factory):
    return session_run_a(tmp_path_factory)


def _plain_mlp() -> nn.Module:
    """The built-in model's architecture written out by hand: no flodl_mpi code involved."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(),
                         nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


@pytest.mark.slow
def test_export_loads_into_a_fresh_module_with_the_logged_accuracy(run_a, tmp_path):
    out = tmp_path / "model.pt"
    proc = subprocess.run([sys.executable, "-m", "flodl_mpi", "export", str(run_a), str(out)],
                          capture_output=True, text=True, check=False, timeout=120)
    assert proc.returncode == 0, proc.stderr
    state = torch.load(out, weights_only=True)
    model = _plain_mlp()
    model.load_state_dict(state)        # strict: every key, every shape
    model.eval()
    with h5py.File(run_a / "metrics.h5", "r", libver="latest", swmr=True) as f:
        source = f.attrs["data_source"]
    with h5py.File(source, "r") as f:
        x, y = torch.from_numpy(f["test/x"][()]), torch.from_numpy(f["test/y"][()])
    with torch.no_grad():
        correct = int((model(x).argmax(dim=1) == y).sum())
    logged = read_table(run_a / "metrics.h5", "epochs")["test_accuracy"][-1]
    assert correct == round(logged * len(y))
    assert read_checkpoint(latest_checkpoint(run_a / "checkpoints")).meta["test_accuracy"] == logged


def _small_checkpoint(tmp_path):
    params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(2, np.float32)}
    buffers = {"n": np.array(3, np.int64)}
    return write_checkpoint(tmp_path / "ckpt-e000001-r000001.h5", params, buffers, {"epoch": 1, "round": 1},
                            ["w", "b", "n"])


def test_export_pt_is_exactly_the_state_dict(tmp_path, capsys):
    path = _small_checkpoint(tmp_path)
    assert main([str(path), str(tmp_path / "m.pt")]) == 0
    got = torch.load(tmp_path / "m.pt", weights_only=True)
    want = load_state_dict(path)
    assert list(got) == ["w", "b", "n"]
    for k in want:
        assert torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype
    assert "exported 3 tensors" in capsys.readouterr().out


@pytest.mark.skipif(importlib.util.find_spec("safetensors") is None, reason="safetensors not installed")
def test_export_safetensors(tmp_path):
    from safetensors.torch import load_file

    path = _small_checkpoint(tmp_path)
    assert main([str(path), str(tmp_path / "m.safetensors")]) == 0   # format from the suffix
    got = load_file(str(tmp_path / "m.safetensors"))
    for k, v in load_state_dict(path).items():
        assert torch.equal(got[k], v)


def test_damaged_checkpoint_is_refused_and_nothing_written(tmp_path, capsys):
    path = _small_checkpoint(tmp_path)
    with h5py.File(path, "a") as f:
        del f.attrs["complete"]
    assert main([str(path), str(tmp_path / "m.pt")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("flodl-mpi export: error: checkpoint") and "incomplete" in err
    assert not (tmp_path / "m.pt").exists() and not list(tmp_path.glob(".m.pt*"))
    assert main([str(tmp_path / "empty_dir_missing"), str(tmp_path / "m.pt")]) == 2
