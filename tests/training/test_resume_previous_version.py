"""A run directory written by the landed version before the sub-packages (ea0275a) resumes, reports and
exports with this one (issue 20, "Behaviour unchanged"): the run dirs it wrote are kept as data
(tests/data/runs_ea0275a, README.md there), and so is what its own resume of each gave.

Each resume here is on the same world size (2) and threads (1) as the old version's: the run then goes
on bit for bit, so its final parameters equal the old version's resume exactly, and its epochs' rows too.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch

from flodl_mpi.outputs.checkpoint import latest_checkpoint, list_checkpoints, read_checkpoint
from flodl_mpi.outputs.checkpoint_contents import read_contents
from tests import _old_runs
from tests.conftest import launch_argv, launch_env, run_flodl


def _assert_same_arrays(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert got[k].tobytes() == want[k].tobytes(), f"{k}: max |diff| {np.abs(got[k] - want[k]).max()}"


def _epoch_rows(run_dir) -> dict[str, list]:
    with h5py.File(run_dir / "metrics.h5", "r") as f:
        return {c: f[f"epochs/{c}"][()].tolist() for c in ("avg_loss", "test_accuracy")}


@pytest.mark.parametrize("name, epochs, said", [
    ("cli_done", 3, "resuming from ckpt-e000002-r000046.h5: 2 epoch(s) done, 0 batch(es) into the next, round 46"),
    ("cli_stopped", 2, "resuming from ckpt-e000002-r000030.h5: 1 epoch(s) done, 14 batch(es) into the next, "
                       "round 30"),
])
def test_cli_resumes_an_old_run_as_the_old_version_did(tmp_path_factory, tmp_path, name, epochs, said):
    """``flodl-mpi train --resume`` on the old run: it goes on from the saved epoch and round, and ends where
    the old version's own resume ended: the same last checkpoint, params and buffers bit for bit, the
    same epoch rows (avg_loss, test accuracy); its checkpoints hold the old ones' meta keys."""
    run_dir = _old_runs.copy_of(tmp_path_factory, name, tmp_path / name)
    old_keys = set(read_checkpoint(latest_checkpoint(run_dir / "checkpoints"), ranks=[]).meta)
    proc = run_flodl(2, "train", *_old_runs.CLI, "--run-dir", str(run_dir), "--epochs", str(epochs), "--resume",
                     timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert said in (run_dir / "train.log").read_text()
    arrays, ref = _old_runs.reference(name, tmp_path_factory)
    newest = read_contents(latest_checkpoint(run_dir / "checkpoints"), ranks=None)
    assert (newest.name, newest.round, newest.epoch) == (ref["checkpoint"], ref["round"], ref["epoch"])
    _assert_same_arrays({**newest.params, **newest.buffers}, arrays)
    assert _epoch_rows(run_dir) == {k: ref[k] for k in ("avg_loss", "test_accuracy")}
    # the same meta keys as the old version's (a complete epoch's: no epoch_reports)
    assert set(newest.meta) == old_keys - {"epoch_reports"}


def test_averager_resumes_an_old_cut_short_epoch_as_the_old_version_did(tmp_path_factory, tmp_path):
    """The own loop's checkpoint of an epoch cut short (3 step() calls into epoch 3): Averager(resume=True)
    goes on at epoch 3, step 4 (start_epoch 2, start_step 3), and the loop ends with the old version's
    resume's model, bit for bit, and its epoch's loss, test loss and scalar."""
    run_dir = _old_runs.copy_of(tmp_path_factory, "averager_cut", tmp_path / "averager_cut")
    out = tmp_path / "final.npz"
    argv = launch_argv(2, sys.executable, str(_old_runs.DATA / "averager_loop.py"), str(run_dir), "3", "0",
                       "--resume", "--out", str(out))
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=400, env=launch_env(), check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ("resuming from ckpt-e000003-r000010.h5: 2 epoch(s) done, 3 step() call(s) into the next, round 10; "
            "go on at epoch 3 from step() call 4 (avg.start_epoch 2, avg.start_step 3") in proc.stderr
    arrays, ref = _old_runs.reference("averager_cut", tmp_path_factory)
    with np.load(out) as npz:
        _assert_same_arrays({k: npz[k] for k in npz.files}, arrays)
    assert json.loads(out.with_suffix(".json").read_text()) == ref
    newest = read_contents(latest_checkpoint(run_dir / "checkpoints"), ranks=None)
    # the old version's resume ended with ckpt-e000003-r000013.h5 (3 rounds: 2 windows and the short last)
    assert (newest.name, newest.epoch_complete, newest.api) == ("ckpt-e000003-r000013.h5", True, "Averager")
    # the keys the old Averager wrote, and the policy's state (the CLI's key for it, now written by both)
    old = read_checkpoint(list_checkpoints(_old_runs.unpacked(tmp_path_factory) / "averager_cut" /
                                           "checkpoints")[-2], ranks=[])  # a complete epoch's
    assert set(newest.meta) == set(old.meta) | {"policy"}
    assert newest.policy == {"name": "window", "guard": newest.guard}


@pytest.mark.parametrize("name", _old_runs.RUNS)
def test_report_and_inspect_read_an_old_run(tmp_path_factory, tmp_path, name, capsys):
    """``flodl-mpi report`` and ``inspect`` read the old run dir as written: its rounds, its stops, a sound
    newest checkpoint with both ranks' state, and its metrics.h5."""
    from flodl_mpi.cli.inspect_cmd import main as inspect
    from flodl_mpi.cli.report import main as report

    run_dir = _old_runs.unpacked(tmp_path_factory) / name
    assert report([str(run_dir), "--no-plots"]) == 0
    out = capsys.readouterr().out
    rounds = {"cli_done": 46, "cli_stopped": 30, "averager_cut": 10}[name]
    assert f"run {run_dir} " in out and re.search(rf"\n  rounds +{rounds} \(0 skipped\)", out), out
    assert f"stops {int(name == 'cli_stopped')}, resumes 0" in out, out
    newest = list_checkpoints(run_dir / "checkpoints")[-1]
    assert inspect([str(newest)]) == 0
    out = capsys.readouterr().out
    assert "verdict: sound" in out and f"round            {rounds}" in out and "ranks with saved state: [0, 1]" in out
    assert inspect([str(run_dir / "metrics.h5")]) == 0
    assert "rounds" in capsys.readouterr().out


@pytest.mark.parametrize("name", _old_runs.RUNS)
def test_export_of_an_old_run_is_its_newest_state_dict(tmp_path_factory, tmp_path, name):
    """``flodl-mpi export RUN_DIR model.pt`` of the old run dir: its newest checkpoint's state dict, in order,
    bit for bit."""
    from flodl_mpi.cli.export import main as export

    run_dir = _old_runs.unpacked(tmp_path_factory) / name
    out = tmp_path / "model.pt"
    assert export([str(run_dir), str(out)]) == 0
    state = torch.load(out, weights_only=True)
    newest = read_checkpoint(list_checkpoints(run_dir / "checkpoints")[-1], ranks=[])
    assert list(state) == newest.order
    _assert_same_arrays({k: v.numpy() for k, v in state.items()}, {**newest.params, **newest.buffers})
