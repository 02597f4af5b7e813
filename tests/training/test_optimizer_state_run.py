"""``--average-optimizer-state`` in real runs: exact resume, SGD unchanged, the bytes it adds (issue 12)."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from flodl_mpi.outputs.checkpoint import latest_checkpoint, read_checkpoint
from flodl_mpi.errors import EXIT_STOPPED
from flodl_mpi.outputs.metrics import read_table
from tests.conftest import MPIEXEC, launch_argv, launch_env, run_flodl

pytestmark = pytest.mark.slow

HOOKED = str(Path(__file__).parents[1] / "hooked_flodl.py")


def _final(run_dir: Path):
    ckpt = read_checkpoint(latest_checkpoint(run_dir / "checkpoints"))
    return ckpt, {**ckpt.params, **ckpt.buffers}


def _rank_state(ckpt, rank: int, key: str) -> dict[str, np.ndarray]:
    arrays, _ = ckpt.ranks[rank]
    return {k: v for k, v in arrays.items() if k.startswith("optimizer/state/") and k.endswith("/" + key)}


def test_a_run_stopped_mid_epoch_and_resumed_equals_the_uninterrupted_one(tmp_path):
    """Adam, ``corrected``: weights and every rank's optimizer state bit-identical after a resume."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    args = ("--epochs", "3", "--optimizer", "adam", "--average-optimizer-state", "corrected")
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert run_flodl(2, "train", *args, "--run-dir", str(straight), timeout=300).returncode == 0
    # 23 rounds an epoch at 2 ranks: round 30 is in epoch 2
    proc = subprocess.run(launch_argv(2, sys.executable, HOOKED, "--stop-at-round", "30", "--", "train", *args,
                                      "--run-dir", str(stopped)),
                          env=launch_env(), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == EXIT_STOPPED, proc.stderr[-3000:]
    mid, _ = _final(stopped)
    assert not mid.meta["epoch_complete"] and 0 < mid.meta["cursor"] < 45  # the stop was mid-epoch
    # The saved state is the consensus: the same on both ranks (the step counters too, here).
    for key in ("exp_avg", "exp_avg_sq"):
        s0, s1 = _rank_state(mid, 0, key), _rank_state(mid, 1, key)
        assert s0 and s0.keys() == s1.keys()
        for k in s0:
            np.testing.assert_array_equal(s0[k], s1[k], err_msg=k)
    resumed = run_flodl(2, "train", *args, "--run-dir", str(stopped), "--resume", timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a_meta, a = _final(straight)
    b_meta, b = _final(stopped)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    for rank in (0, 1):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            sa, sb = _rank_state(a_meta, rank, key), _rank_state(b_meta, rank, key)
            assert sa and sa.keys() == sb.keys()
            for k in sa:
                np.testing.assert_array_equal(sa[k], sb[k], err_msg=f"rank {rank} {k}")
    assert a_meta.meta["test_accuracy"] == b_meta.meta["test_accuracy"]
    # Resuming with another setting is refused: the saved state means something else.
    other = run_flodl(2, "train", "--epochs", "4", "--optimizer", "adam", "--average-optimizer-state", "off",
                      "--run-dir", str(stopped), "--resume", timeout=300)
    assert other.returncode == 2
    assert "--average-optimizer-state 'off' (was 'corrected')" in other.stderr


def test_sgd_momentum_averaged_or_not_gives_the_same_parameters_when_every_rank_trains_every_round(tmp_path):
    """SGD's update is linear: with equal masses, averaging the momentum buffers changes nothing.

    Equal masses: ``--drop-last`` leaves 44 batches, so at 2 ranks every round has both
    ranks training one batch. Then the mean of the ranks' buffers is what the mean of
    their parameters already implies, and the parameters agree up to float32 rounding
    (the buffers' mean is taken in float32 on the wire), asserted to 1e-4 relative per
    tensor, not bitwise. Without ``--drop-last`` the 45th batch leaves rank 1 idle at
    each epoch's end; its own buffer is then stale under ``off``, and the runs differ.
    """
    args = ("--epochs", "2", "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9")
    runs = {}
    for drop in (True, False):
        for mode in ("off", "mean"):
            d = tmp_path / f"{mode}-{drop}"
            extra = ("--drop-last",) if drop else ()
            proc = run_flodl(2, "train", *args, *extra, "--average-optimizer-state", mode, "--run-dir", str(d),
                             timeout=300)
            assert proc.returncode == 0, proc.stderr[-3000:]
            runs[(mode, drop)] = _final(d)[1]
            rounds = read_table(d / "metrics.h5", "rounds")
            if drop:  # every round: both ranks one step
                assert np.all(rounds["steps"] == 1)
            ckpt = _final(d)[0]
            params = sum(v.size for v in ckpt.params.values())
            buffers = sum(v.size for v in ckpt.buffers.values() if v.dtype.kind == "f")
            # The momentum buffers travel in a frame of their own: the parameters' bytes again.
            frames = (params, buffers) + ((params,) if mode == "mean" else ())
            assert set(rounds["bytes"].tolist()) == {4 * sum(n + 1 for n in frames)}  # + each frame's mass slot
    off, mean = runs[("off", True)], runs[("mean", True)]
    for name in off:
        np.testing.assert_allclose(mean[name], off[name], rtol=1e-4, atol=1e-6, err_msg=name)
    assert any(not np.allclose(runs[("off", False)][n], runs[("mean", False)][n], rtol=1e-4, atol=1e-6)
               for n in off)
