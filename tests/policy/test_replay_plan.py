"""``--replay-plan``: a cadence run replays another run's recorded quotas and anchors exactly (issue 26 item 11).

Cadence and async take their quotas from measured speeds, so the same command gives other
windows on a loaded machine; a replay follows the plans ``metrics.h5`` recorded per round.
"""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

from flodl_mpi.policy.cadence import fit_quotas
from flodl_mpi.outputs.checkpoint import latest_checkpoint, read_checkpoint
from flodl_mpi.config import ConfigError, TrainConfig
from flodl_mpi.errors import EXIT_INPUT
from flodl_mpi.outputs.metrics import read_table
from flodl_mpi.policy.replay import RecordedPlan, ReplayError, read_recorded_plan
from tests.training.run_sequence import run_sequence


def _plan(quotas, n_batches, world_size=2, policy="cadence", samples=1437) -> RecordedPlan:
    """A record whose windows are what the quotas give epoch after epoch at ``n_batches`` (as a run writes them)."""
    windows, cursor = [], 0
    for q in quotas:
        counts = fit_quotas(q, n_batches - cursor)
        windows.append(counts)
        cursor = (cursor + sum(counts)) % n_batches
    return RecordedPlan(path="m.h5", world_size=world_size, policy=policy, quotas=np.array(quotas),
                        anchors=np.array([min(q) for q in quotas]), windows=np.array(windows), samples=samples)


def test_the_checks_refuse_another_world_policy_or_data_size_and_a_run_longer_than_the_record():
    """issue 26 item 11. Hand-worked: 10 batches an epoch at quotas (3, 1) run (3, 1), (3, 1), then the 2 left
    as (1, 1): 3 rounds an epoch, so 6 rounds cover 2 epochs."""
    rec = _plan([[3, 1]] * 6, n_batches=10)
    np.testing.assert_array_equal(rec.windows, [[3, 1], [3, 1], [1, 1]] * 2)
    assert rec.epochs_covered(10) == 2
    assert rec.plan(2) == ((3, 1), 1)
    assert rec.refusal(2, "cadence", 10, 1437, 2) is None
    assert rec.refusal(3, "cadence", 10, 1437, 2) == (
        "--replay-plan 'm.h5' was recorded at 2 ranks, this run has 3: a plan gives each rank its quota; "
        "launch 2 ranks to replay it")
    assert rec.refusal(2, "async", 10, 1437, 2).startswith(
        "--replay-plan 'm.h5' was recorded under --policy cadence, this run is --policy async")
    assert rec.refusal(2, "cadence", 10, 1000, 2).startswith(
        "--replay-plan 'm.h5' was recorded on 1437 training samples an epoch, this run has 1000")
    # 12 batches an epoch: round 2's quotas (3, 1) with 4 batches left give (3, 1), not the recorded (1, 1)
    assert rec.refusal(2, "cadence", 12, 1437, 2) == (
        "--replay-plan 'm.h5': round 2 ran windows [1, 1] of its quotas [3, 1], not what they give at 12 batches "
        "an epoch ([3, 1]): the plan was recorded for another data size, --batch-size or --drop-last; replay it "
        "with the recorded run's data and batch size")
    assert rec.refusal(2, "cadence", 10, 1437, 3) == (
        "--replay-plan 'm.h5' holds the plans of 2 complete epoch(s) (6 rounds), this run asks for --epochs 3; "
        "replay at most 2 epoch(s)")
    with pytest.raises(ReplayError, match="no plan recorded for round 6"):
        rec.plan(6)


def _write_metrics(path, policy="cadence", history=((0, 2),), rounds=2):
    with h5py.File(path, "w") as f:
        f.attrs.update(world_size=2, policy=policy, world_size_history=json.dumps([list(h) for h in history]),
                       json_attrs=json.dumps(["world_size_history"]))
        f["rounds/quota"] = np.full((rounds, 2), 4, np.int64)
        f["rounds/anchor"] = np.full(rounds, 4, np.int64)
        f["rounds/window"] = np.full((rounds, 2), 4, np.int64)
        f["epochs/per_rank_samples"] = np.array([[700, 737]], np.int64)


def test_reading_a_record_refuses_what_holds_no_plan_to_follow(tmp_path):
    """issue 26 item 11: a missing file, a fixed policy's run, a world-size change, no rounds: one line each."""
    with pytest.raises(ReplayError, match=r"^--replay-plan '.*nothing\.h5': no such file; give a finished run's"):
        read_recorded_plan(tmp_path / "nothing.h5")
    _write_metrics(tmp_path / "w.h5", policy="window")
    with pytest.raises(ReplayError, match="recorded under --policy window, whose plan is fixed"):
        read_recorded_plan(tmp_path / "w.h5")
    _write_metrics(tmp_path / "g.h5", history=((0, 2), (5, 3)))
    with pytest.raises(ReplayError, match=r"changed its world size \(\[\[0, 2\], \[5, 3\]\]\)"):
        read_recorded_plan(tmp_path / "g.h5")
    _write_metrics(tmp_path / "e.h5", rounds=0)
    with pytest.raises(ReplayError, match="has no rounds; nothing to replay"):
        read_recorded_plan(tmp_path / "e.h5")
    _write_metrics(tmp_path / "ok.h5")
    rec = read_recorded_plan(tmp_path / "ok.h5")
    assert (rec.world_size, rec.policy, rec.samples, len(rec)) == (2, "cadence", 1437, 2)
    with pytest.raises(ConfigError, match=r"--replay-plan take\(s\) effect with --policy cadence or async"):
        TrainConfig(policy="window", window=4, replay_plan="m.h5")


@pytest.mark.slow
def test_a_cadence_run_and_its_replay_give_bit_identical_final_parameters(tmp_path):
    """issue 26 item 11: the original's speeds are scripted 1:3 (quotas 12 and 4, the anchor growing on a
    scripted 40 ms round); the replay measures this machine's own (about equal) speeds, so only following the
    record gives its windows, and with them its parameters, bit for bit.

    The three runs (the original, its replay, the refused replay) are one 2-rank launch
    (tests/training/run_sequence.py: one start-up of the ranks, then the CLI's entry point once per run):
    the original's scripted speeds are put back before the replay starts, so the replay measures its own.
    The refusal's time is its own run's (``seconds``: the wall time of its entry point)."""
    common = ("train", "--policy", "cadence", "--anchor", "4", "--epochs", "2")
    original, replay = tmp_path / "original", tmp_path / "replay"
    first, second, refused = run_sequence(2, [
        (("--script-speeds", "1,3", "--script-round-ms", "40"), (*common, "--run-dir", str(original))),
        ((), (*common, "--run-dir", str(replay), "--replay-plan", str(original / "metrics.h5"))),
        # The same record at another batch size: one line, exit 2, before any run dir is made.
        ((), (*common, "--batch-size", "16", "--run-dir", str(tmp_path / "other"),
              "--replay-plan", str(original / "metrics.h5")))], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert second.returncode == 0, second.stderr[-3000:]
    ra, rb = (read_table(d / "metrics.h5", "rounds") for d in (original, replay))
    assert len({tuple(q) for q in ra["quota"].tolist()}) > 2 and ra["quota"][1].tolist() == [12, 4]
    for col in ("quota", "anchor", "window", "steps"):
        np.testing.assert_array_equal(ra[col], rb[col], err_msg=col)
    a, b = (read_checkpoint(latest_checkpoint(d / "checkpoints")) for d in (original, replay))
    assert a.params.keys() == b.params.keys()
    for name in a.params:
        assert a.params[name].tobytes() == b.params[name].tobytes(), name
    for name in a.buffers:
        assert a.buffers[name].tobytes() == b.buffers[name].tobytes(), name

    assert refused.returncode == EXIT_INPUT, refused.stderr[-3000:]
    assert "flodl-mpi: error: --replay-plan" in refused.stderr
    assert "not what they give at 90 batches an epoch" in refused.stderr
    assert "recorded for another data size, --batch-size or --drop-last" in refused.stderr
    assert not (tmp_path / "other").exists()
    assert refused.seconds < 200
