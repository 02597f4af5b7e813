"""metrics.h5 tables (SWMR) and rank 0's writer thread."""

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from flodl_mpi.outputs import checkpoint
from flodl_mpi.outputs.checkpoint import checkpoint_name, latest_checkpoint, read_checkpoint
from flodl_mpi.outputs.metrics import (
    GUARD_VERDICTS,
    MetricsFile,
    MetricsWriter,
    WriterError,
    read_table,
    table_schema,
)

W = 3


def batch_rows(start, k):
    """k rows of the batches table with values that identify their row."""
    i = np.arange(start, start + k)
    return {"rank": i % W, "epoch": i // 10, "step": i, "batch_ms": i * 1.5, "data_ms": i * 0.25,
            "loss": 1.0 / (1 + i), "lr": np.full(k, 0.1), "param_norm": np.where(i % 10 == 0, i * 2.0, np.nan)}


def round_rows(start, k):
    i = np.arange(start, start + k)
    per_rank = i[:, None] * 10.0 + np.arange(W)  # (k, W)
    return {"round": i, "version": i + 100, "time_s": i * 0.5, "skipped": i % 2 == 1,
            "steps": per_rank.astype(np.int64), "mass": per_rank, "quarantined": per_rank % 3 == 0,
            "divergence": per_rank / 7,
            "pre_norm": per_rank + 1, "post_norm": i * 3.0, "pack_ms": per_rank, "allreduce_ms": per_rank,
            "unpack_ms": per_rank, "outer_ms": per_rank / 2, "bytes": i * 4096, "window": per_rank.astype(np.int64) + 1,
            "anchor": np.full(k, 3), "guard": (i % 3).astype(np.int8), "quota": per_rank.astype(np.int64) + 2,
            "batch_ms": per_rank / 3, "round_ms": per_rank * 2, "wait_ms": per_rank / 5,
            "bridge_ms": per_rank * 3, "control_ms": per_rank / 7, "snapshot_ms": per_rank / 11,
            "adopt_ms": per_rank / 13, "link_bytes": i * 8, "link_ranks": np.full(k, 2), "link_ms": per_rank / 17,
            "busbw_gbs": per_rank / 19}


def expected(rows_list):
    return {c: np.concatenate([r[c] for r in rows_list]) for c in rows_list[0]}


def assert_table_equal(got, want):
    assert set(got) == set(want)
    for c in want:
        np.testing.assert_array_equal(got[c], want[c], err_msg=c)


def test_schema_shapes():
    schema = table_schema(4)
    assert schema["rounds"]["mass"] == (np.dtype(np.float64), (4,))
    assert schema["batches"]["rank"] == (np.dtype(np.int32), ())
    assert h5py.check_enum_dtype(schema["rounds"]["guard"][0]) == GUARD_VERDICTS
    assert schema["rounds"]["quarantined"] == (np.dtype(np.bool_), (4,))
    assert schema["rounds"]["outer_ms"] == (np.dtype(np.float64), (4,))
    assert schema["rounds"]["quota"] == (np.dtype(np.int64), (4,))
    # where the round's time went (issues 6, 9; the training thread's copies: issue 26 item 8)
    for name in ("control_ms", "round_ms", "bridge_ms", "wait_ms", "snapshot_ms", "adopt_ms"):
        assert schema["rounds"][name] == (np.dtype(np.float64), (4,))
    assert schema["epochs"]["nonfinite_batches"] == (np.dtype(np.int64), ())
    # the params reduce against its link (issue 25 item 4): payload and ranks of the cohort, time and busbw per rank
    assert schema["rounds"]["link_bytes"] == schema["rounds"]["link_ranks"] == (np.dtype(np.int64), ())
    assert schema["rounds"]["link_ms"] == schema["rounds"]["busbw_gbs"] == (np.dtype(np.float64), (4,))
    assert len(schema["rounds"]) == 30 and len(schema["epochs"]) == 20 and len(schema["batches"]) == 8
    with pytest.raises(ValueError, match="world_size must be an int >= 1, got 0"):
        table_schema(0)


def test_appends_in_batches_read_back(tmp_path):
    path = tmp_path / "metrics.h5"
    attrs = {"config": {"lr": 0.1, "policy": "cadence"}, "hosts": ["a", "b", "a"], "version": "0.1.0"}
    parts = [batch_rows(0, 4), batch_rows(4, 1), batch_rows(5, 7)]
    rparts = [round_rows(0, 2), round_rows(2, 3)]
    with MetricsFile(path, W, attrs) as m:
        for p in parts:
            m.append("batches", p)
        for p in rparts:
            m.append("rounds", p)
    assert_table_equal(read_table(path, "batches"), expected(parts))
    assert_table_equal(read_table(path, "rounds"), expected(rparts))
    assert read_table(path, "epochs")["epoch"].shape == (0,)
    with h5py.File(path, "r") as f:
        assert f.attrs["world_size"] == W and f.attrs["version"] == "0.1.0"
        assert json.loads(f.attrs["config"]) == attrs["config"]
        assert set(json.loads(f.attrs["json_attrs"])) == {"config", "hosts", "world_size_history"}
        assert f["rounds/mass"].shape == (5, W) and f["rounds/mass"].maxshape == (None, W)


def test_swmr_reader_sees_rows_while_the_writer_is_open(tmp_path):
    path = tmp_path / "metrics.h5"
    with MetricsFile(path, W, {}) as m:
        m.append("batches", batch_rows(0, 2))
        with h5py.File(path, "r", libver="latest", swmr=True) as r:
            step = r["batches/step"]
            assert step[()].tolist() == [0, 1]
            m.append("batches", batch_rows(2, 3))
            step.refresh()
            assert step[()].tolist() == [0, 1, 2, 3, 4]
            assert read_table(path, "batches")["loss"].shape == (5,)  # a second reader, meanwhile


def test_bad_rows_raise_value_error(tmp_path):
    with MetricsFile(tmp_path / "metrics.h5", W, {}) as m:
        rows = round_rows(0, 2)
        rows["mass"] = np.zeros((2, W + 1))
        with pytest.raises(ValueError,
                           match=r"table 'rounds' column 'mass': expected shape \(k>=1, \*\(3,\)\), got \(2, 4\)"):
            m.append("rounds", rows)
        rows = batch_rows(0, 2)
        del rows["lr"]
        with pytest.raises(ValueError, match=r"missing columns \['lr'\]"):
            m.append("batches", rows)
        with pytest.raises(ValueError, match="unknown table 'steps'"):
            m.append("steps", batch_rows(0, 1))
        rows = round_rows(0, 1)
        rows["guard"] = np.array([7], np.int8)
        with pytest.raises(ValueError, match="codes must be in"):
            m.append("rounds", rows)
        rows = batch_rows(0, 2)
        rows["step"] = np.array([0.5, 1.5])
        with pytest.raises(TypeError, match="cannot store float64 as int64"):
            m.append("batches", rows)
    assert read_table(tmp_path / "metrics.h5", "rounds")["round"].shape == (0,)  # nothing half-written


def test_existing_file_is_not_overwritten(tmp_path):
    (tmp_path / "metrics.h5").write_bytes(b"an earlier run")
    with pytest.raises(FileExistsError):
        MetricsFile(tmp_path / "metrics.h5", W, {})
    assert (tmp_path / "metrics.h5").read_bytes() == b"an earlier run"


def state(seed):
    rng = np.random.default_rng(seed)
    params = {"0.weight": rng.standard_normal((4, 3)).astype(np.float32), "0.bias": np.zeros(4, np.float32)}
    buffers = {"1.num_batches_tracked": np.array(seed, np.int64)}
    return params, buffers, ["0.weight", "0.bias", "1.num_batches_tracked"]


def test_writer_writes_metrics_and_checkpoints(tmp_path):
    ckdir = tmp_path / "checkpoints"
    writer = MetricsWriter(tmp_path, W, {"world_size": W}, checkpoint_dir=ckdir, keep_checkpoints=2)
    writer.start()
    parts = [batch_rows(i, 1) for i in range(50)]  # many small appends, coalesced by the thread
    for p in parts[:25]:
        writer.append("batches", p)
    for r in range(1, 4):
        params, buffers, order = state(r)
        writer.save_checkpoint(checkpoint_name(0, r), params, buffers, {"round": r, "epoch": 0}, order)
    assert writer.flush_wait(timeout=30)
    assert_table_equal(read_table(tmp_path / "metrics.h5", "batches"), expected(parts[:25]))
    for p in parts[25:]:
        writer.append("batches", p)
    writer.append("rounds", round_rows(0, 4))
    writer.close()
    writer.close()  # idempotent

    assert_table_equal(read_table(tmp_path / "metrics.h5", "batches"), expected(parts))
    assert_table_equal(read_table(tmp_path / "metrics.h5", "rounds"), round_rows(0, 4))
    assert sorted(p.name for p in ckdir.iterdir()) == [checkpoint_name(0, 2), checkpoint_name(0, 3)]
    ckpt = read_checkpoint(latest_checkpoint(ckdir))
    params, buffers, order = state(3)
    assert ckpt.order == order and ckpt.meta == {"round": 3, "epoch": 0}
    np.testing.assert_array_equal(ckpt.params["0.weight"], params["0.weight"])
    assert int(ckpt.buffers["1.num_batches_tracked"]) == 3


def test_writer_validates_rows_in_the_callers_thread(tmp_path):
    writer = MetricsWriter(tmp_path, W, {})
    writer.start()
    rows = batch_rows(0, 2)
    rows["loss"] = np.zeros((2, 1))
    with pytest.raises(ValueError, match="column 'loss'"):
        writer.append("batches", rows)
    with pytest.raises(ValueError, match="checkpoint_dir=None"):
        writer.save_checkpoint("a.h5", *state(0)[:2], {}, state(0)[2])
    writer.close()  # the bad rows never reached the thread: no error


def test_writer_failure_surfaces_as_writer_error(tmp_path, monkeypatch):
    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "write_checkpoint", disk_full)
    writer = MetricsWriter(tmp_path, W, {}, checkpoint_dir=tmp_path / "ck")
    writer.start()
    writer.append("batches", batch_rows(0, 3))
    params, buffers, order = state(1)
    writer.save_checkpoint("ckpt.h5", params, buffers, {}, order)
    with pytest.raises(WriterError, match="No space left") as info:
        writer.flush_wait(timeout=30)  # returns promptly: the failure releases the wait
    assert isinstance(info.value.__cause__, OSError)
    with pytest.raises(WriterError):
        writer.check()
    with pytest.raises(WriterError):
        writer.append("batches", batch_rows(3, 1))  # no more work accepted
    with pytest.raises(WriterError):
        writer.close(timeout=30)
    # Rows appended before the failure are kept, and the file was closed cleanly.
    assert read_table(tmp_path / "metrics.h5", "batches")["step"].tolist() == [0, 1, 2]


def test_writer_start_fails_when_metrics_exists(tmp_path):
    (tmp_path / "metrics.h5").write_bytes(b"")
    writer = MetricsWriter(tmp_path, W, {})
    with pytest.raises(WriterError) as info:
        writer.start()
    assert isinstance(info.value.__cause__, FileExistsError)


def test_resume_salvages_a_file_a_killed_run_left_open(tmp_path):
    """A run killed mid-write leaves metrics.h5 flagged open; resume keeps the rows a checkpoint saw."""
    import subprocess
    import sys
    import textwrap

    path = tmp_path / "metrics.h5"
    script = textwrap.dedent(f"""
        import os, numpy as np
        from flodl_mpi.outputs.metrics import MetricsFile, table_schema
        f = MetricsFile({str(path)!r}, 2, {{"config": {{"lr": 0.1}}}})
        for i in range(5):
            f.append("batches", {{c: np.full((1, *s), i, dtype=d) for c, (d, s) in table_schema(2)["batches"].items()}})
        os._exit(0)  # like kill -9: the file is never closed
    """)
    subprocess.run([sys.executable, "-c", script], check=True, cwd=str(Path(__file__).parents[2]))
    with pytest.raises(OSError):  # a plain open refuses the flagged file
        h5py.File(path, "r").close()

    with MetricsFile(path, 2, {"config": {"lr": 0.2}}, keep_rows={"batches": 3}) as f:
        f.append("batches", {c: np.full((1, *s), 9, dtype=d) for c, (d, s) in table_schema(2)["batches"].items()})
    rows = read_table(path, "batches")
    np.testing.assert_array_equal(rows["step"], [0, 1, 2, 9])
    assert len(read_table(path, "rounds")["round"]) == 0
    with h5py.File(path, "r") as f:  # closed cleanly this time
        assert json.loads(f.attrs["config"]) == {"lr": 0.2}
    assert not (tmp_path / "metrics.h5.before-resume").exists()


def test_resume_refuses_fewer_rows_than_the_checkpoint_saw(tmp_path):
    path = tmp_path / "metrics.h5"
    MetricsFile(path, 1, {}).close()
    with pytest.raises(ValueError, match="table 'rounds' has 0 rows, the checkpoint saw 4"):
        MetricsFile(path, 1, {}, keep_rows={"rounds": 4})
    assert path.exists()  # nothing lost


# ---------------------------------------------------------------- a resume killed while it rebuilds metrics.h5


def _history(path, rounds, world_size=W):
    """A closed metrics.h5 holding ``rounds`` rows in the rounds table and as many batches."""
    with MetricsFile(path, world_size, {"config": {"lr": 0.1}}) as f:
        f.append("rounds", _rounds(world_size, 0, rounds))
        f.append("batches", batch_rows(0, rounds))


def _rounds(world_size, start, k):
    rows = round_rows(start, k)
    return {c: (a[:, :world_size] if a.ndim == 2 else a) for c, a in rows.items()}


KEEP = {"rounds": 6, "batches": 6, "epochs": 0}


def _assert_resumed_history(path, rounds=6):
    got = read_table(path, "rounds")
    np.testing.assert_array_equal(got["round"], np.arange(rounds))
    np.testing.assert_array_equal(got["steps"], _rounds(W, 0, rounds)["steps"])
    np.testing.assert_array_equal(read_table(path, "batches")["step"], np.arange(KEEP["batches"]))
    leftovers = sorted(p.name for p in path.parent.iterdir() if p.name != path.name)
    assert leftovers == [], leftovers


@pytest.mark.parametrize("point", ["salvaged", "temp partial", "temp written", "writer open", "replaced"])
def test_a_resume_killed_at_any_step_loses_nothing(tmp_path, point):
    """kill -9 (os._exit) at each step of the rebuild, then resume again: every kept row is there."""
    import subprocess
    import sys
    import textwrap

    path = tmp_path / "metrics.h5"
    _history(path, 10)
    script = textwrap.dedent(f"""
        import os
        from flodl_mpi.outputs import metrics
        metrics._step = lambda step: os._exit(9) if step == {point!r} else None
        metrics.MetricsFile({str(path)!r}, {W}, {{}}, keep_rows={KEEP!r})
        os._exit(0)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=str(Path(__file__).parents[2]), check=False)
    assert proc.returncode == 9  # it died at the step named, not before or after

    with MetricsFile(path, W, {}, keep_rows=KEEP) as f:  # the next resume
        f.append("rounds", _rounds(W, 6, 2))
    _assert_resumed_history(path, rounds=8)


@pytest.mark.parametrize("resume", [False, True])
def test_a_reader_opening_the_file_as_soon_as_it_is_named_does_not_lock_the_writer_out(tmp_path, monkeypatch,
                                                                                     resume):
    """``flodl-mpi inspect`` while a run starts: a SWMR reader that opens metrics.h5 the moment it is
    renamed into place (and keeps it open) must not make the writer's open fail ("unable to lock
    file", the run's rank 0 then failed with exit 1)."""
    from flodl_mpi.outputs import metrics

    path = tmp_path / "metrics.h5"
    if resume:
        _history(path, 10)
    readers = []

    def open_a_reader(step):
        if step == "replaced":  # the file has its name: a reader opens it at once
            readers.append(h5py.File(path, "r", libver="latest", swmr=True))

    monkeypatch.setattr(metrics, "_step", open_a_reader)
    try:
        f = MetricsFile(path, W, {}, keep_rows=KEEP if resume else None)
        assert readers, "the hook did not run: the test proves nothing"
        with f:
            f.append("rounds", _rounds(W, 6 if resume else 0, 2))
        readers[0]["rounds/round"].refresh()
        assert readers[0]["rounds/round"].shape[0] == (8 if resume else 2)  # it reads the live file
    finally:
        for r in readers:
            r.close()
    np.testing.assert_array_equal(read_table(path, "rounds")["round"], np.arange(8 if resume else 2))


@pytest.mark.parametrize("left", ["48 bytes", "partial", "complete", "nothing"])
def test_a_resume_repairs_what_an_older_killed_resume_left(tmp_path, left):
    """The old rebuild renamed the history to metrics.h5.before-resume first; a kill then left
    metrics.h5 as 48 bytes, a partial or a complete new file, or none: the history is restored."""
    path = tmp_path / "metrics.h5"
    _history(path, 10)
    before = tmp_path / "metrics.h5.before-resume"
    path.rename(before)
    if left == "48 bytes":
        path.write_bytes(before.read_bytes()[:48])
    elif left == "partial":
        path.write_bytes(before.read_bytes()[:4000])
    elif left == "complete":
        _history(path, 6)
    f = MetricsFile(path, W, {}, keep_rows=KEEP)
    f.close()
    assert f.recovered and "history restored from metrics.h5.before-resume" in f.recovered[0]
    _assert_resumed_history(path)


def test_a_stale_temporary_is_removed_and_said(tmp_path):
    path = tmp_path / "metrics.h5"
    _history(path, 10)
    (tmp_path / "metrics.h5.resume-tmp").write_bytes(b"\x89HDF\r\n\x1a\n half")
    f = MetricsFile(path, W, {}, keep_rows=KEEP)
    f.close()
    assert "unfinished copy removed" in f.recovered[0]
    _assert_resumed_history(path)


# ---------------------------------------------------------------- another world size


@pytest.mark.parametrize("old, new", [(2, 3), (3, 2)])
def test_a_resume_at_another_world_size_reads_as_one_run(tmp_path, old, new):
    path = tmp_path / "metrics.h5"
    _history(path, 10, world_size=old)
    with MetricsFile(path, new, {}, keep_rows=KEEP) as f:
        f.append("rounds", _rounds(new, 6, 3))
        f.append("rounds", _rounds(new, 9, 1))
    width = max(old, new)
    got = read_table(path, "rounds")
    np.testing.assert_array_equal(got["round"], np.arange(10))
    assert got["steps"].shape == got["mass"].shape == (10, width)

    def widened(rows, w):
        steps, mass = np.full((len(rows["round"]), width), -1), np.full((len(rows["round"]), width), np.nan)
        steps[:, :w], mass[:, :w] = rows["steps"], rows["mass"]
        return steps, mass

    want_old, want_new = widened(_rounds(old, 0, 6), old), widened(_rounds(new, 6, 4), new)
    np.testing.assert_array_equal(got["steps"], np.concatenate([want_old[0], want_new[0]]))
    np.testing.assert_array_equal(got["mass"], np.concatenate([want_old[1], want_new[1]]))
    with h5py.File(path, "r") as f:
        assert json.loads(f.attrs["world_size_history"]) == [[0, old], [6, new]]
        assert int(f.attrs["world_size"]) == new

    # a later resume from before the change forgets the change, keeps the width
    with MetricsFile(path, old, {}, keep_rows={"rounds": 4, "batches": 4, "epochs": 0}):
        pass
    with h5py.File(path, "r") as f:
        assert json.loads(f.attrs["world_size_history"]) == [[0, old]]
        assert f["rounds/steps"].shape == (4, width)


# ---------------------------------------------------------------- HDF5 1.10 readers


def _written_files(tmp_path):
    """metrics.h5 and a checkpoint as the writer thread writes them (all tables, SWMR, closed)."""
    writer = MetricsWriter(tmp_path, W, {"config": {"lr": 0.1}, "hosts": ["a", "b", "c"]},
                           checkpoint_dir=tmp_path / "checkpoints")
    writer.start()
    writer.append("rounds", round_rows(0, 4))
    writer.append("batches", batch_rows(0, 4))
    writer.save_checkpoint(checkpoint_name(1, 4), {"0.weight": np.ones((3, 2), np.float32)},
                           {"1.num_batches_tracked": np.int64(3)}, {"round": 4, "config": {"x": 1}},
                           ["0.weight", "1.num_batches_tracked"])
    writer.close()
    return tmp_path / "metrics.h5", latest_checkpoint(tmp_path / "checkpoints")


def test_written_files_stay_within_hdf5_1_10_formats(tmp_path):
    """Copying every object into a file capped at v110 fails on any newer object version
    (what made Debian's h5dump 1.10 reject metrics.h5)."""
    from tests.outputs.test_checkpoint import assert_readable_by_hdf5_1_10

    for path in _written_files(tmp_path):
        assert_readable_by_hdf5_1_10(path)


def test_written_files_open_in_h5dump(tmp_path):
    import shutil
    import subprocess

    h5dump = shutil.which("h5dump")
    if h5dump is None:
        pytest.skip("h5dump not installed (Debian: apt-get install hdf5-tools); the v110 copy test still runs")
    for path in _written_files(tmp_path):
        proc = subprocess.run([h5dump, "-H", str(path)], capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "rounds" in proc.stdout or "params" in proc.stdout


def test_a_kill_between_two_columns_of_an_append_keeps_every_earlier_row(tmp_path):
    """Issue 26 item 10: an append writes each column with one extent change, one write and one flush; a
    kill -9 half-way through one leaves the rows of every earlier append readable, exactly, and a resume
    goes on from them."""
    import subprocess
    import sys
    import textwrap

    path = tmp_path / "metrics.h5"
    script = textwrap.dedent(f"""
        import os
        import tests.outputs.test_metrics as t
        from flodl_mpi.outputs import metrics
        f = metrics.MetricsFile({str(path)!r}, {W}, {{}})
        f.append("rounds", t.round_rows(0, 2))
        f.append("rounds", t.round_rows(2, 3))
        real, calls = metrics._pad, []
        def pad(arr, width):  # the per-rank columns of the next append: die before the fourth is written
            calls.append(1)
            if len(calls) == 4:
                os._exit(9)
            return real(arr, width)
        metrics._pad = pad
        f.append("rounds", t.round_rows(5, 4))
        os._exit(0)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=str(Path(__file__).parents[2]), check=False)
    assert proc.returncode == 9  # killed inside the third append
    with h5py.File(path, "r", swmr=True) as f:  # the kill came between columns: some are one append longer
        lengths = {name: f["rounds"][name].shape[0] for name in f["rounds"]}
    assert set(lengths.values()) == {5, 9}, lengths
    assert_table_equal(read_table(path, "rounds"), expected([round_rows(0, 2), round_rows(2, 3)]))
    with MetricsFile(path, W, {}, keep_rows={"rounds": 5}) as f:  # a resume from the checkpoint that saw 5 rows
        f.append("rounds", round_rows(5, 1))
    assert_table_equal(read_table(path, "rounds"), expected([round_rows(0, 5), round_rows(5, 1)]))


def test_row_counts_kept_by_the_writer_follow_every_append(tmp_path):
    """The writer keeps each column's length itself (no HDF5 query per append): after appends of
    1, 256 and 3 rows to every table (a chunk boundary crossed), every column holds exactly the rows
    given, and a reader that opens the file between appends sees each append whole."""
    path = tmp_path / "metrics.h5"
    schema = table_schema(W)
    rng = np.random.default_rng(1)

    def rows(table, k):
        out = {}
        for name, (dtype, shape) in schema[table].items():
            if h5py.check_enum_dtype(dtype) is not None:
                out[name] = rng.integers(0, len(GUARD_VERDICTS), (k, *shape)).astype(dtype)
            elif dtype.kind == "S":
                out[name] = np.array([f"s{v}".encode() for v in rng.integers(0, 1000, k)], dtype=dtype)
            elif dtype.kind == "b":
                out[name] = rng.integers(0, 2, (k, *shape)).astype(bool)
            else:
                out[name] = (rng.standard_normal((k, *shape)) * 1000).astype(dtype)
        return out

    given = {t: [] for t in schema}
    with MetricsFile(path, W, {}) as m:
        for k in (1, 256, 3):
            for table in schema:
                given[table].append(rows(table, k))
                m.append(table, given[table][-1])
                assert_table_equal(read_table(path, table), expected(given[table]))
    for table in schema:
        assert_table_equal(read_table(path, table), expected(given[table]))
