"""A checkpoint's contents (flodl_mpi.outputs.checkpoint_contents): the fields, the file they make, and the
compatibility rules by which a checkpoint of an earlier flodl-mpi reads into them; checked on the
checkpoints the landed version before the sub-packages wrote (tests/data/runs_ea0275a)."""

from __future__ import annotations

import json
import math

import h5py
import numpy as np
import pytest

from flodl_mpi.outputs.checkpoint import (
    SCHEMA_VERSION,
    list_checkpoints,
    load_state_dict,
    read_checkpoint,
    write_checkpoint,
)
from flodl_mpi.outputs.checkpoint_contents import META_KEYS, CheckpointContents, read_contents
from tests import _old_runs


def _raw(path, group: str) -> dict[str, np.ndarray]:
    with h5py.File(path, "r") as f:
        return {k: v[()] for k, v in f[group].items()}


def _root_attrs(path) -> dict:
    """Every root attribute as stored (JSON ones as their text): what the format holds, not what it means."""
    with h5py.File(path, "r") as f:
        return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in f.attrs.items()}


def _old_checkpoints(tmp_path_factory):
    root = _old_runs.unpacked(tmp_path_factory)
    return [p for name in _old_runs.RUNS for p in list_checkpoints(root / name / "checkpoints")]


def test_the_old_runs_hold_what_the_tests_resume(tmp_path_factory):
    """The data is what README.md says: the newest checkpoint of each run, by its name and meta."""
    root = _old_runs.unpacked(tmp_path_factory)
    newest = {name: list_checkpoints(root / name / "checkpoints")[-1] for name in _old_runs.RUNS}
    assert {k: p.name for k, p in newest.items()} == {"cli_done": "ckpt-e000002-r000046.h5",
                                                    "cli_stopped": "ckpt-e000002-r000030.h5",
                                                    "averager_cut": "ckpt-e000003-r000010.h5"}
    done, stopped, cut = (read_contents(newest[k], ranks=None) for k in _old_runs.RUNS)
    assert (done.epoch, done.epoch_complete, done.cursor, done.round, done.world_size) == (2, True, 0, 46, 2)
    # 1437 samples, batch 32: 45 batches an epoch, 23 rounds at 2 ranks; round 30 is the 7th of epoch 2
    assert (stopped.epoch, stopped.epoch_complete, stopped.cursor, stopped.round) == (1, False, 14, 30)
    assert stopped.reason == "graceful_shutdown" and len(stopped.epoch_reports) == 2
    assert sum(r["batches"] for r in stopped.epoch_reports) == 14
    # an own loop: 2 epochs of 8 step() calls at window 2 (4 rounds each), 3 calls into the third (2 rounds)
    assert (cut.epoch, cut.epoch_complete, cut.round, cut.api, cut.policy) == (2, False, 10, "Averager", None)
    assert cut.epoch_progress["step"] == 3 and len(cut.epoch_progress["ranks"]) == 2
    assert sorted(cut.ranks) == [0, 1] and all(s[1]["optimizer_class"] == "SGD" for s in cut.ranks.values())
    for c in (done, stopped, cut):
        assert c.schema_version == SCHEMA_VERSION == 2


def test_old_checkpoints_read_into_fields_and_write_back_the_same_file_contents(tmp_path_factory, tmp_path):
    """Read by the contents and written again, an old checkpoint holds the same datasets (bit for bit),
    the same root attributes (names and stored values; ``json_keys``, the list of those stored as JSON, in
    the fields' order) and the same per-rank state: the format did not change."""
    for path in _old_checkpoints(tmp_path_factory):
        contents = read_contents(path, ranks=None)
        assert contents.path == path and contents.name == path.name  # named by the epoch saved and the round
        assert not contents.extra, f"{path}: meta keys without a field: {sorted(contents.extra)}"
        again = contents.write(tmp_path / path.name)
        for group in ("params", "buffers"):
            a, b = _raw(path, group), _raw(again, group)
            assert a.keys() == b.keys()
            for k in a:
                assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), (path, group, k)
        before, after = _root_attrs(path), _root_attrs(again)
        assert before.keys() == after.keys(), (path, set(before) ^ set(after))
        for k in before:
            if k == "json_keys":  # which keys are JSON, listed in the meta's order (the Averager's was another)
                assert sorted(json.loads(before[k])) == sorted(json.loads(after[k])), path
                continue
            same = before[k] == after[k] or (isinstance(before[k], float) and math.isnan(before[k])
                                              and math.isnan(after[k]))
            assert same, (path, k, before[k], after[k])
        old, new = read_checkpoint(path), read_checkpoint(again)
        assert old.ranks.keys() == new.ranks.keys()
        for r in old.ranks:
            assert old.ranks[r][1] == new.ranks[r][1]
            assert {k: v.tobytes() for k, v in old.ranks[r][0].items()} == \
                   {k: v.tobytes() for k, v in new.ranks[r][0].items()}


def test_an_old_checkpoints_params_load_bit_for_bit(tmp_path_factory):
    """load_state_dict of an old checkpoint gives exactly the stored float32 values (read with h5py alone)."""
    for path in _old_checkpoints(tmp_path_factory):
        state = load_state_dict(path)
        stored = {**_raw(path, "params"), **_raw(path, "buffers")}
        assert list(state) == json.loads(h5py.File(path, "r").attrs["order"])
        for k, v in state.items():
            assert v.numpy().dtype == stored[k].dtype and v.numpy().tobytes() == stored[k].tobytes(), (path, k)


def _contents(**kw) -> CheckpointContents:
    base = dict(params={"w": np.arange(3, dtype=np.float32)}, buffers={"n": np.array(4, np.int64)}, order=["w", "n"],
                epoch=1, round=5, reason="checkpoint", world_size=2, config={"lr": 0.1, "drop_last": False},
                guard={"g": 1}, ranks={0: ({"a": np.zeros(2)}, {"global_step": 3}),
                                       1: ({"a": np.ones(2)}, {"global_step": 4})})
    base.update(kw)
    return CheckpointContents(**base)


def test_meta_holds_every_field_set_in_the_written_order(tmp_path):
    c = _contents(policy={"name": "sync", "guard": {"g": 1}}, epoch_progress={"step": 2, "ranks": []},
                  epoch_complete=False, extra={"later_key": 7}, test_accuracy=0.25, test_loss=1.5)
    meta = c.meta
    assert list(meta) == [k for k in META_KEYS if k in meta] + ["later_key"]
    assert "batches_done" not in meta and "epoch_reports" not in meta and "api" not in meta  # unset: not written
    assert c.name == "ckpt-e000002-r000005.h5"  # the epoch cut short (epoch 1 done) is named for epoch 2
    back = read_contents(c.write(tmp_path / c.name), ranks=None)
    assert back.meta == meta and back.extra == {"later_key": 7}
    assert back.ranks[1][1] == {"global_step": 4} and back.ranks[1][0]["a"].tolist() == [1.0, 1.0]
    assert back.stored_bytes() == c.stored_bytes() == 3 * 4 + 8 + 2 * 16


def test_ranks_must_be_every_rank_to_write(tmp_path):
    with pytest.raises(ValueError, match="ranks must be 0..0"):
        _contents(ranks={1: ({}, {})}).write(tmp_path / "x.h5")


def test_compatibility_rules_fill_what_an_older_writer_left_out(tmp_path):
    """Each rule of the module docstring, on a file written without the key it is about."""
    path = write_checkpoint(tmp_path / "old.h5", {"w": np.zeros(2, np.float32)}, {}, {
        "epoch": 3, "round": 9, "world_size": 1, "config": {"lr": 0.5}, "guard": {"state": "guard's"},
        "metrics_rows": {"rounds": 9, "epochs": 3}}, ["w"], [({}, {"global_step": 1})])
    c = read_contents(path)
    assert (c.epoch_complete, c.cursor, c.policy, c.model) == (True, 0, None, None)
    # the guard alone when the policy's state is not there, or is another policy's
    assert c.policy_state("cadence") == ("guard", {"state": "guard's"})
    c.policy = {"name": "window", "guard": {}}
    assert c.policy_state("cadence")[0] == "guard" and c.policy_state("window") == ("policy", c.policy)
    # options added since: their defaults; average_optimizer_state: off (each rank kept its own)
    saved = c.saved_config()
    assert saved["lr"] == 0.5 and saved["average_optimizer_state"] == "off" and saved["batch_size"] == 32
    # no drop_last: the old batch plan, refused only where it differs (a lone sample left over)
    assert c.batch_plan_refusal(65, 32) is not None and "older flodl-mpi whose batch plan" in c.batch_plan_refusal(65, 32)
    assert c.batch_plan_refusal(64, 32) is None and c.batch_plan_refusal(1, 32) is None
    assert _contents().batch_plan_refusal(65, 32) is None  # a config with drop_last: today's plan


def test_schema_1_stopped_reports_are_read_from_each_ranks_state(tmp_path):
    """A stop mid-epoch of schema 1 kept each rank's report in /ranks/<r> (attribute epoch_report), not the root."""
    reports = [{"loss_sum": 1.5 + r, "batches": 3 + r} for r in range(3)]
    path = write_checkpoint(tmp_path / "s1.h5", {"w": np.zeros(2, np.float32)}, {}, {
        "epoch": 1, "round": 7, "world_size": 3, "config": {}, "guard": {}, "cursor": 4, "epoch_complete": False},
        ["w"], [({}, {"epoch_report": rep}) for rep in reports])
    c = read_contents(path, ranks=[])
    assert c.reports_in_ranks and c.ranks == {}
    assert c.stopped_reports() == dict(enumerate(reports))
    assert c.stopped_reports([2]) == {2: reports[2]} and c.ranks == {}  # read, not kept
    c.ranks = {1: ({}, {"epoch_report": {"held": True}})}  # the state a resuming rank read: taken from there
    assert c.stopped_reports([1]) == {1: {"held": True}}
    c.epoch_reports = reports
    assert not c.reports_in_ranks and c.stopped_reports([1]) == {1: reports[1]}
