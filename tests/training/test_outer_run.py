"""Outer optimizers end to end through the command (SPEC §7): resume exactness, the inner reset."""

import numpy as np
import pytest

from flodl_mpi.outputs.checkpoint import latest_checkpoint, read_checkpoint, read_cohort_state
from flodl_mpi.errors import EXIT_INPUT
from flodl_mpi.outputs.metrics import read_table
from tests.conftest import run_flodl
from tests.training.test_resume import STOPPED, run_hooked

pytestmark = pytest.mark.slow

# 1437 digits samples, batch 32: 45 batches an epoch; 2 ranks x window 4: 6 rounds an epoch.
COMMON = ("train", "--epochs", "2", "--window", "4", "--outer", "nesterov")


def _final(run_dir):
    ckpt = read_checkpoint(latest_checkpoint(run_dir / "checkpoints"))
    return ckpt, {**ckpt.params, **ckpt.buffers}, read_cohort_state(ckpt.path)


def test_a_nesterov_run_stopped_and_resumed_equals_the_uninterrupted_one(tmp_path):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert run_flodl(2, *COMMON, "--run-dir", str(straight), timeout=300).returncode == 0
    first = run_hooked(2, "--stop-at-round", "8", "--", *COMMON, "--run-dir", str(stopped))
    assert first.returncode in STOPPED, first.stderr[-3000:]
    meta = read_checkpoint(latest_checkpoint(stopped / "checkpoints")).meta
    assert (meta["epoch"], meta["round"]) == (1, 8) and meta["cursor"] > 0  # mid-epoch 2
    resumed = run_flodl(2, *COMMON, "--run-dir", str(stopped), "--resume", timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    a_ckpt, a, (a_outer, a_attrs) = _final(straight)
    b_ckpt, b, (b_outer, b_attrs) = _final(stopped)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].tobytes() == b[name].tobytes(), name
    for name in ("prev", "velocity"):  # the outer state carried over exactly
        assert a_outer[name].tobytes() == b_outer[name].tobytes(), name
    assert a_attrs == b_attrs and a_attrs["kind"] == "nesterov" and a_attrs["steps"] == 12
    # the final weights are the outer optimizer's global parameters
    flat = np.concatenate([a[k].ravel() for k in a_ckpt.order if k in a_ckpt.params])
    np.testing.assert_array_equal(flat, a_outer["prev"])
    rounds = read_table(straight / "metrics.h5", "rounds")
    assert rounds["outer_ms"].shape == (12, 2) and np.all(rounds["outer_ms"][1:] > 0)


@pytest.mark.parametrize("reset", [False, True])
def test_outer_reset_inner_clears_every_ranks_optimizer_state(tmp_path, reset):
    run_dir = tmp_path / "r"
    extra = ("--outer-reset-inner",) if reset else ()
    proc = run_flodl(2, "train", "--epochs", "1", "--window", "4", "--outer", "slowmo", *extra,
                     "--run-dir", str(run_dir), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "outer slowmo (lr 1, momentum 0.9)" in proc.stdout
    ckpt = read_checkpoint(latest_checkpoint(run_dir / "checkpoints"))
    for r in (0, 1):  # the last round stepped, then every rank cleared (or kept) its Adam state
        arrays, _ = ckpt.ranks[r]
        held = [k for k in arrays if k.startswith("optimizer/state/")]
        assert (held == []) == reset, f"rank {r}: {held[:3]}"


def test_outer_options_are_refused_without_an_outer_optimizer(tmp_path):
    proc = run_flodl(2, "train", "--outer-lr", "0.5", "--run-dir", str(tmp_path / "r"), timeout=300)
    assert proc.returncode == EXIT_INPUT
    assert ("flodl-mpi: error: --outer-lr, --outer-momentum and --outer-reset-inner take effect with --outer "
            "slowmo or nesterov; --outer avg adopts the consensus as it is") in proc.stderr
    assert not (tmp_path / "r").exists()
