"""Rank 0's metrics duty as an object (flodl_mpi.outputs.metrics): a MetricsWriter on rank 0 of a run with a
run dir, a NoMetricsWriter everywhere else, with the same caller side, so no caller tests for None."""

from __future__ import annotations

import inspect

import numpy as np

from flodl_mpi.outputs.metrics import MetricsWriter, NoMetricsWriter, read_table, writer_or_none
from flodl_mpi.outputs.recorder import NoRecorder, Recorder, recorder_for
from flodl_mpi.outputs.saver import NoSaver, Saver, saver_for


def _caller_side(cls) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(fn) for name, fn in vars(cls).items()
            if callable(fn) and not name.startswith("_")}


def test_the_no_writer_has_the_writers_caller_side_with_the_same_signatures():
    writer, none = _caller_side(MetricsWriter), _caller_side(NoMetricsWriter)
    # what the callers use (train/fit/averager/bridge/recorder); save/save_checkpoint only go through a Saver
    for name in ("start", "check", "append", "append_held", "flush_wait", "close"):
        assert none[name] == writer[name], name
    assert MetricsWriter.writes is True and NoMetricsWriter.writes is False
    assert NoMetricsWriter.recovered == () and NoMetricsWriter.last_save_s == 0.0


def test_the_no_writer_does_nothing_and_cannot_fail():
    w = NoMetricsWriter()
    w.start()
    w.append("epochs", {"epoch": np.arange(3)})
    w.append_held("rounds", {"round": 1})
    w.check()
    assert w.flush_wait(0.0) is True
    w.close(timeout=0.0)
    w.close()  # idempotent, as the writer's
    w.check()


def test_the_factories_choose_by_the_role_not_by_none(tmp_path):
    assert isinstance(writer_or_none(None), NoMetricsWriter)
    real = MetricsWriter(tmp_path, 2, {"policy": "sync"}, tmp_path / "checkpoints")
    assert writer_or_none(real) is real
    assert type(recorder_for(0, real)) is Recorder and type(saver_for(0, real)) is Saver
    for rank, w in ((1, real), (0, NoMetricsWriter()), (0, None)):
        assert type(recorder_for(rank, w)) is NoRecorder and type(saver_for(rank, w)) is NoSaver
    real.start()  # the writer was never a stub: it writes
    real.append("epochs", _one_epoch_row())
    real.close()
    assert read_table(tmp_path / "metrics.h5", "epochs")["epoch"].tolist() == [1]


def _one_epoch_row() -> dict:
    from tests._runs import synthetic_rows

    rows = synthetic_rows(2, 1, 1)["epochs"]
    return {k: v[:1] for k, v in rows.items()}
