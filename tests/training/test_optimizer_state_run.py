"""``--average-optimizer-state`` in real runs: exact resume, SGD unchanged, the bytes it adds (issue 12).

Every run is a 2-rank run (what is averaged is the ranks' optimizer state), made by the module's fixture
in two launches (tests/training/run_sequence.py: one start-up of the ranks for several runs): the
uninterrupted Adam run, its stopped twin and the four SGD runs, then the resume of the stopped one and
the refused resume (never in the launch that stopped it).
"""

from pathlib import Path

import numpy as np
import pytest

from flodl_mpi.outputs.checkpoint import latest_checkpoint, read_checkpoint
from flodl_mpi.errors import EXIT_STOPPED
from flodl_mpi.outputs.metrics import read_table
from tests.training.run_sequence import run_sequence

pytestmark = pytest.mark.slow

ADAM = ("train", "--epochs", "3", "--optimizer", "adam", "--average-optimizer-state", "corrected")
SGD = ("train", "--epochs", "2", "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9")


def _final(run_dir: Path):
    ckpt = read_checkpoint(latest_checkpoint(run_dir / "checkpoints"))
    return ckpt, {**ckpt.params, **ckpt.buffers}


def _rank_state(ckpt, rank: int, key: str) -> dict[str, np.ndarray]:
    arrays, _ = ckpt.ranks[rank]
    return {k: v for k, v in arrays.items() if k.startswith("optimizer/state/") and k.endswith("/" + key)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The module's runs, by name: ``(run dir, finished process)``; ``mid`` is the stopped run's checkpoint,
    read before ``resumed`` continues it in the second launch (then ``other``, the refused resume)."""
    base = tmp_path_factory.mktemp("optstate")
    plan = {"straight": ((), ADAM),
            # 23 rounds an epoch at 2 ranks: round 30 is in epoch 2
            "stopped": (("--stop-at-round", "30"), ADAM)}
    for drop in (True, False):
        for mode in ("off", "mean"):
            plan[f"{mode}-{drop}"] = ((), (*SGD, *(("--drop-last",) if drop else ()), "--average-optimizer-state",
                                           mode))
    first = run_sequence(2, [(hooks, (*args, "--run-dir", str(base / name))) for name, (hooks, args) in plan.items()],
                         base)
    out = {name: (base / name, proc) for name, proc in zip(plan, first)}
    out["mid"] = _final(base / "stopped")[0]
    stopped = str(base / "stopped")
    resumed, other = run_sequence(2, [((), (*ADAM, "--run-dir", stopped, "--resume")),
                                      ((), ("train", "--epochs", "4", "--optimizer", "adam",
                                            "--average-optimizer-state", "off", "--run-dir", stopped, "--resume"))],
                                  base)
    out["resumed"], out["other"] = (base / "stopped", resumed), (base / "stopped", other)
    return out


def test_a_run_stopped_mid_epoch_and_resumed_equals_the_uninterrupted_one(runs):
    """Adam, ``corrected``: weights and every rank's optimizer state bit-identical after a resume."""
    (straight, proc), (stopped, first) = runs["straight"], runs["stopped"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert first.returncode == EXIT_STOPPED, first.stderr[-3000:]
    mid = runs["mid"]
    assert not mid.meta["epoch_complete"] and 0 < mid.meta["cursor"] < 45  # the stop was mid-epoch
    # The saved state is the consensus: the same on both ranks (the step counters too, here).
    for key in ("exp_avg", "exp_avg_sq"):
        s0, s1 = _rank_state(mid, 0, key), _rank_state(mid, 1, key)
        assert s0 and s0.keys() == s1.keys()
        for k in s0:
            np.testing.assert_array_equal(s0[k], s1[k], err_msg=k)
    resumed = runs["resumed"][1]
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
    other = runs["other"][1]
    assert other.returncode == 2
    assert "--average-optimizer-state 'off' (was 'corrected')" in other.stderr


def test_sgd_momentum_averaged_or_not_gives_the_same_parameters_when_every_rank_trains_every_round(runs):
    """SGD's update is linear: with equal masses, averaging the momentum buffers changes nothing.

    Equal masses: ``--drop-last`` leaves 44 batches, so at 2 ranks every round has both
    ranks training one batch. Then the mean of the ranks' buffers is what the mean of
    their parameters already implies, and the parameters agree up to float32 rounding
    (the buffers' mean is taken in float32 on the wire), asserted to 1e-4 relative per
    tensor, not bitwise. Without ``--drop-last`` the 45th batch leaves rank 1 idle at
    each epoch's end; its own buffer is then stale under ``off``, and the runs differ.
    """
    params_of = {}
    for drop in (True, False):
        for mode in ("off", "mean"):
            d, proc = runs[f"{mode}-{drop}"]
            assert proc.returncode == 0, proc.stderr[-3000:]
            params_of[(mode, drop)] = _final(d)[1]
            rounds = read_table(d / "metrics.h5", "rounds")
            if drop:  # every round: both ranks one step
                assert np.all(rounds["steps"] == 1)
            ckpt = _final(d)[0]
            params = sum(v.size for v in ckpt.params.values())
            buffers = sum(v.size for v in ckpt.buffers.values() if v.dtype.kind == "f")
            # The momentum buffers travel in a frame of their own: the parameters' bytes again.
            frames = (params, buffers) + ((params,) if mode == "mean" else ())
            assert set(rounds["bytes"].tolist()) == {4 * sum(n + 1 for n in frames)}  # + each frame's mass slot
    off, mean = params_of[("off", True)], params_of[("mean", True)]
    for name in off:
        np.testing.assert_allclose(mean[name], off[name], rtol=1e-4, atol=1e-6, err_msg=name)
    assert any(not np.allclose(params_of[("off", False)][n], params_of[("mean", False)][n], rtol=1e-4, atol=1e-6)
               for n in off)
