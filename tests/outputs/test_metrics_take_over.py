"""metrics.h5 taken over by the lowest survivor when rank 0 died (SPEC §9), in one process: every
flushed row once, the attributes kept, crash-safe at every step; the membership table across resumes."""

from __future__ import annotations

import json
import os

import h5py
import numpy as np
import pytest

from flodl_mpi.outputs import metrics
from flodl_mpi.outputs.metrics import MetricsFile, MetricsWriter, read_table, table_schema

W = 3


def _rows(table, start, k, width=W):
    """k rows of ``table`` whose every value says its row (``start`` + i)."""
    out = {}
    for name, (dtype, shape) in table_schema(width)[table].items():
        i = np.arange(start, start + k).reshape(-1, *([1] * len(shape)))
        v = np.broadcast_to(i, (k, *shape))
        out[name] = (
            (v % 2 == 1)
            if dtype.kind == "b"
            else (v % 3).astype(dtype)
            if dtype.kind == "i" and h5py.check_enum_dtype(dtype)
            else v.astype(dtype)
        )
    return out


def _membership(round_, left, world_size, width=W):
    left_mask = np.zeros((1, width), bool)
    left_mask[0, list(left)] = True
    rank = np.full((1, width), -1, np.int32)
    rank[0, [i for i in range(width) if i not in left][:world_size]] = np.arange(world_size)
    return {
        "round": [round_],
        "time_s": [round_ * 0.1],
        "left": left_mask,
        "joined": np.zeros((1, width), bool),
        "steps_lost": np.where(left_mask, 5, 0).astype(np.int64),
        "rank": rank,
        "world_size": [world_size],
        "detection_ms": [120.0],
        "recovery_ms": [40.0],
    }


def _in_child(fn) -> int:
    """Run ``fn`` in a forked child that ends with os._exit (as kill -9: no close, nothing flushed later)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            fn()
        except BaseException:  # noqa: BLE001
            code = 3
        os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _dead_writer(path):
    """Rank 0's file as a kill -9 leaves it: 7 rounds, 1 epoch, a membership row, and an append half done."""
    f = MetricsFile(path, W, {"config": {"lr": 0.1}, "policy": "cadence"})
    f.append("rounds", _rows("rounds", 0, 7))
    f.append("epochs", _rows("epochs", 0, 1))
    f.append("membership", _membership(4, [2], 2))
    ds = f._file["rounds"]["round"]  # the next append got as far as its first column
    ds.resize(8, axis=0)
    ds[7] = 7
    ds.flush()


def test_take_over_keeps_every_flushed_row_once_and_widens(tmp_path):
    path = tmp_path / "metrics.h5"
    assert _in_child(lambda: _dead_writer(path)) == 0
    with MetricsFile.take_over(path, width=4) as f:
        assert f.rows == {"rounds": 7, "epochs": 1, "batches": 0, "scalars": 0, "membership": 1}
        f.append("rounds", _rows("rounds", 7, 2, width=4))  # the new writer goes on from round 7
    rounds = read_table(path, "rounds")
    assert rounds["round"].tolist() == list(range(9)), "round 7 once: the half-done append was dropped"
    assert rounds["steps"].shape == (9, 4)
    np.testing.assert_array_equal(rounds["steps"][:7, :W], _rows("rounds", 0, 7)["steps"])
    assert (rounds["steps"][:7, 3] == -1).all() and np.isnan(rounds["mass"][:7, 3]).all()  # widened: padding
    members = read_table(path, "membership")
    assert members["left"].tolist() == [[False, False, True, False]] and members["world_size"].tolist() == [2]
    with h5py.File(path, "r") as f:  # closed cleanly; the attributes as the dead writer wrote them
        assert json.loads(f.attrs["config"]) == {"lr": 0.1} and f.attrs["policy"] == "cadence"
        assert f.attrs["world_size"] == W and json.loads(f.attrs["world_size_history"]) == [[0, W]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.h5"]


# The steps are a resume's (MetricsFile's rebuild; test_metrics.py kills a resume at each of them): here the
# three that bracket the rename, with the dead writer's file (flagged open, a half-done append) as the input.
@pytest.mark.parametrize("point", ["temp partial", "writer open", "replaced"])
def test_a_take_over_killed_at_any_step_loses_nothing(tmp_path, point):
    path = tmp_path / "metrics.h5"
    assert _in_child(lambda: _dead_writer(path)) == 0

    def killed():
        metrics._step = lambda step: os._exit(9) if step == point else None
        MetricsFile.take_over(path)

    assert _in_child(killed) == 9  # it died at the step named
    with MetricsFile.take_over(path) as f:  # the next survivor tries again
        assert f.rows["rounds"] == 7
        assert not point == "replaced" or f.recovered == [], f.recovered
    assert read_table(path, "rounds")["round"].tolist() == list(range(7))
    assert len(read_table(path, "membership")["round"]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.h5"]


def test_the_writer_thread_takes_over(tmp_path):
    assert _in_child(lambda: _dead_writer(tmp_path / "metrics.h5")) == 0
    writer = MetricsWriter.take_over(tmp_path, width=3)
    writer.start()
    assert writer.rows["rounds"] == 7
    writer.append("membership", _membership(7, [0, 2], 1))
    writer.close()
    assert read_table(tmp_path / "metrics.h5", "membership")["round"].tolist() == [4, 7]
    with pytest.raises(FileNotFoundError, match="no metrics.h5 to take over"):
        MetricsWriter.take_over(tmp_path / "nowhere")


def test_a_resume_keeps_the_changes_of_the_rounds_it_keeps(tmp_path):
    path = tmp_path / "metrics.h5"
    with MetricsFile(path, W, {}) as f:
        f.append("rounds", _rows("rounds", 0, 10))
        f.append("membership", _membership(4, [2], 2))
        f.append("membership", _membership(8, [1, 2], 1))
    with MetricsFile(path, 2, {}, keep_rows={"rounds": 6, "epochs": 0}):  # the checkpoint saw 6 rounds
        pass
    assert read_table(path, "membership")["round"].tolist() == [4]  # the change at round 8 is the future dropped
