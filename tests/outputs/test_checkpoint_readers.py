"""Readers of a run's checkpoints while the run trains and prunes them (issue 26 item 4).

The races are reproduced deterministically: a wrapper removes the file a reader chose at
the step named (after the listing, after the open), as the writer's prune would; one
stress test polls while a writer process saves and prunes, and counts failures.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from flodl_mpi.outputs import checkpoint
from flodl_mpi.outputs.checkpoint import (
    RELISTS,
    CheckpointError,
    CheckpointMissing,
    checkpoint_name,
    latest_checkpoint,
    load_state_dict,
    read_newest,
    write_checkpoint,
)
from flodl_mpi.cli.export import export_state_dict
from flodl_mpi.cli.export import main as export_main


def _save(directory: Path, i: int) -> Path:
    """Save ``i``: every value is ``i`` (float32 weights, int64 buffer), so a read tells which save it got."""
    params = {"w": np.full((4, 3), i, np.float32), "b": np.full(4, i, np.float32)}
    buffers = {"n": np.array(i, np.int64)}
    ranks = [({"optimizer/state/0/exp_avg": np.full(3, i, np.float64)}, {"step": i})]
    return write_checkpoint(directory / checkpoint_name(i, 10 * i), params, buffers,
                            {"epoch": i, "round": 10 * i}, ["w", "b", "n"], ranks)


def _run_dir(tmp_path: Path, saves=(1, 2, 3)) -> Path:
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    for i in saves:
        _save(run / "checkpoints", i)
    return run


def _remove_newest_after_listing(monkeypatch, times: int = 1) -> list[Path]:
    """Wrap `list_checkpoints`: on its first ``times`` calls, the newest file it listed is removed
    before the caller gets the list (the writer's prune between a reader's listing and its open)."""
    real, removed = checkpoint.list_checkpoints, []

    def listing(directory):
        found = real(directory)
        if found and len(removed) < times:
            found[-1].unlink()
            removed.append(found[-1])
        return found

    monkeypatch.setattr(checkpoint, "list_checkpoints", listing)
    return removed


def _remove_all_after_listing(monkeypatch, then_save: bool = False) -> list[int]:
    """Wrap `list_checkpoints`: every file each listing names is removed before the caller gets
    the list, and with ``then_save`` a newer save lands (a writer that outruns every listing).
    Returns how many files each listing named (appended to)."""
    real, calls = checkpoint.list_checkpoints, []

    def listing(directory):
        found = real(directory)
        calls.append(len(found))
        for p in found:
            p.unlink()
        if then_save:
            _save(Path(directory), len(calls) + 1)
        return found

    monkeypatch.setattr(checkpoint, "list_checkpoints", listing)
    return calls


def _remove_once_opened(monkeypatch, target: Path, at: int) -> list[int]:
    """Wrap `h5py.File`: when ``target`` is opened the ``at``-th time, it is removed just after that
    open succeeds (the writer's prune while the reader holds it open). Returns the list of opens
    of ``target`` (appended to)."""
    real, opens = h5py.File, []

    def file(name, *args, **kwargs):
        f = real(name, *args, **kwargs)
        if isinstance(name, (str, os.PathLike)) and Path(name) == target:
            opens.append(1)
            if len(opens) == at:
                target.unlink()
        return f

    monkeypatch.setattr(h5py, "File", file)
    return opens


def _damage_weights(path: Path) -> None:
    """Overwrite 8 bytes of ``params/w``'s stored data: its Fletcher-32 checksum fails on read."""
    with h5py.File(path, "r") as f:
        offset = f["params/w"].id.get_chunk_info(0).byte_offset
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(b"\xff" * 8)


def _values(state) -> set[float]:
    return {float(v) for t in state.values() for v in t.flatten().tolist()}


def test_load_state_dict_of_a_dir_gets_the_next_newest_when_the_chosen_one_is_pruned(tmp_path, monkeypatch):
    """issue 26 item 4: the file a listing chose is removed before the open: the next newest is read, no error."""
    run = _run_dir(tmp_path)
    removed = _remove_newest_after_listing(monkeypatch)
    state = load_state_dict(run)
    assert [p.name for p in removed] == [checkpoint_name(3, 30)]   # the wrapper did remove the newest
    assert list(state) == ["w", "b", "n"]
    assert torch.equal(state["w"], torch.full((4, 3), 2.0)) and torch.equal(state["b"], torch.full((4,), 2.0))
    assert state["n"].dtype == torch.int64 and int(state["n"]) == 2
    # the checkpoints directory itself works alike, and without a prune gives the newest (now save 2)
    monkeypatch.undo()
    assert _values(load_state_dict(run / "checkpoints")) == {2.0}


def test_read_newest_passes_over_a_pruned_file_without_calling_it_damaged(tmp_path, monkeypatch):
    """issue 26 item 4: a vanished file is not damage; a damaged one still is, and is named."""
    run = _run_dir(tmp_path, saves=(1, 2, 3, 4))
    ckpts = run / "checkpoints"
    _damage_weights(ckpts / checkpoint_name(3, 30))
    _remove_newest_after_listing(monkeypatch)                   # save 4 pruned after the listing
    ckpt, damaged = read_newest(ckpts, verify=True)
    assert ckpt.path.name == checkpoint_name(2, 20) and int(ckpt.params["w"][0, 0]) == 2
    assert [(p.name, why.split(" (")[0]) for p, why in damaged] == [
        (checkpoint_name(3, 30), "unreadable data in 'params/w'")]


def test_load_state_dict_of_a_dir_passes_over_a_damaged_newest_with_a_warning(tmp_path):
    """issue 26 item 4: the directory form follows resume's rule: a newest whose weights fail their
    checksum is passed over for the next newest, and named (never silently)."""
    run = _run_dir(tmp_path)
    newest = run / "checkpoints" / checkpoint_name(3, 30)
    _damage_weights(newest)
    with pytest.warns(UserWarning, match=f"checkpoint {newest} is damaged \\(unreadable data .*; loaded "
                                         f"{checkpoint_name(2, 20)}, the newest that reads back"):
        state = load_state_dict(run)
    assert _values(state) == {2.0}
    with pytest.raises(CheckpointError, match="unreadable data"):   # the file itself: refused
        load_state_dict(newest)


def test_export_of_a_run_survives_the_prune_of_the_checkpoint_it_chose(tmp_path, monkeypatch):
    """issue 26 item 4: `flodl-mpi export RUN` while the run trains failed 16 of 16 (exit 2, "no such file").

    It chose the newest (verifying it), then imported torch (seconds) and opened the file again to
    read it: the run had saved and pruned meanwhile. The chosen file is removed here once it is open
    past the listing (the listing's header check is the first open; the second is where the old
    export verified it, and the new one reads it): the export must still write that save, read in
    that one open, and say nothing about damage."""
    run = _run_dir(tmp_path)
    newest = run / "checkpoints" / checkpoint_name(3, 30)
    opens = _remove_once_opened(monkeypatch, newest, at=2)
    used, n, passed_over = export_state_dict(run, tmp_path / "model.pt")
    assert len(opens) == 2 and not newest.exists()              # removed after its second open, never opened again
    assert (used, n, passed_over) == (newest, 3, [])
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert list(state) == ["w", "b", "n"] and _values(state) == {3.0}


def test_export_cli_of_a_run_whose_chosen_checkpoint_is_pruned_exits_0(tmp_path, monkeypatch, capsys):
    """issue 26 item 4: the CLI's path: the listing's newest removed before the open: exit 0, the next
    newest exported, and stderr quiet (a removed file is not a damaged one)."""
    run = _run_dir(tmp_path)
    _remove_newest_after_listing(monkeypatch)
    assert export_main([str(run), str(tmp_path / "model.pt")]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert f"exported 3 tensors from {run / 'checkpoints' / checkpoint_name(2, 20)}" in captured.out
    assert _values(torch.load(tmp_path / "model.pt", weights_only=True)) == {2.0}


def test_a_checkpoint_saved_during_the_listing_is_not_called_damaged(tmp_path, monkeypatch, capsys):
    """issue 26 item 4: a save renamed in between a reader's two looks at the directory is a new
    checkpoint, not "damaged (not a complete checkpoint)" (export warned so, falsely)."""
    run = _run_dir(tmp_path)
    real = checkpoint.list_checkpoints

    def listing(directory):
        found = real(directory)
        if not (Path(directory) / checkpoint_name(4, 40)).exists():
            _save(Path(directory), 4)                            # the writer's next save lands now
        return found

    monkeypatch.setattr(checkpoint, "list_checkpoints", listing)
    assert export_main([str(run), str(tmp_path / "model.pt")]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert _values(torch.load(tmp_path / "model.pt", weights_only=True)) == {3.0}   # what the listing saw


def test_a_dir_whose_every_checkpoint_vanishes_is_one_checkpoint_error(tmp_path, monkeypatch):
    """issue 26 item 4: every listed file removed before it could be opened: CheckpointError naming the
    directory and why, after listing again (the writer's newer saves), never a hang."""
    run = _run_dir(tmp_path)
    ckpts = run / "checkpoints"
    calls = _remove_all_after_listing(monkeypatch)
    start = time.monotonic()
    with pytest.raises(CheckpointError) as info:
        load_state_dict(run)
    assert time.monotonic() - start < 10.0
    assert type(info.value) is CheckpointError and info.value.path == ckpts
    assert str(info.value) == (f"checkpoint {ckpts}: no complete checkpoint left: the 3 listed were each removed "
                               "before they could be opened (pruned by the run writing here?)")
    assert calls == [3, 0]                                      # listed again once: nothing newer came
    monkeypatch.undo()
    for what, directory in (("no complete checkpoint in this directory", ckpts),
                            ("no such directory", tmp_path / "absent")):
        with pytest.raises(CheckpointError, match=what):
            read_newest(directory)


def test_a_dir_whose_writer_outruns_every_listing_stops_after_relists(tmp_path, monkeypatch):
    """issue 26 item 4: a writer that prunes every file listed, and saves a newer one, each time: the
    reader lists at most `RELISTS` times and then says so (never loops for ever)."""
    run = _run_dir(tmp_path, saves=(1,))
    ckpts = run / "checkpoints"
    calls = _remove_all_after_listing(monkeypatch, then_save=True)
    with pytest.raises(CheckpointError, match=f"the {RELISTS} listed were each removed"):
        read_newest(ckpts)
    assert calls == [1] * RELISTS


def test_a_file_removed_between_the_check_and_the_open_is_a_checkpoint_error(tmp_path, monkeypatch):
    """issue 26 item 4: `load_state_dict(latest_checkpoint(dir))` once raised h5py's raw FileNotFoundError:
    the prune came after the reader's existence check, before HDF5 opened the file."""
    run = _run_dir(tmp_path)
    path = latest_checkpoint(run / "checkpoints")
    real = h5py.File

    def file(name, *args, **kwargs):
        if Path(name) == path and path.exists():
            path.unlink()                                       # pruned now, just before HDF5's open
        return real(name, *args, **kwargs)

    monkeypatch.setattr(h5py, "File", file)
    with pytest.raises(CheckpointError) as info:
        load_state_dict(path)
    assert isinstance(info.value, CheckpointMissing) and not path.exists()
    assert str(info.value) == f"checkpoint {path}: no such file (removed while being opened)"
    assert not isinstance(info.value, FileNotFoundError)


def test_latest_checkpoint_is_none_only_when_there_is_none(tmp_path, monkeypatch):
    """issue 26 item 4: `latest_checkpoint` gave None while the run had checkpoints (the documented
    pattern then failed with a TypeError): its listing met only files the writer pruned before they were
    opened, while the writer saved a newer one. A listing that finds none while the directory changed
    is taken again."""
    run = _run_dir(tmp_path, saves=(1, 2))
    ckpts = run / "checkpoints"
    real, calls = checkpoint.list_checkpoints, []

    def listing(directory):
        calls.append(1)
        if len(calls) == 1:             # the writer prunes what this listing opens, and saves save 3
            for p in real(directory):
                p.unlink()
            _save(ckpts, 3)
            return []
        return real(directory)

    monkeypatch.setattr(checkpoint, "list_checkpoints", listing)
    assert latest_checkpoint(ckpts) == ckpts / checkpoint_name(3, 30)
    assert len(calls) == 2
    for p in ckpts.iterdir():
        p.unlink()
    assert latest_checkpoint(ckpts) is None and len(calls) == 3   # empty and unchanged: one look


@pytest.mark.parametrize("error", [RuntimeError("Can't deserialize object header prefix"), KeyError("bad link"),
                                   TypeError("bad type"), OSError("Can't read data (wrong B-tree signature)")])
def test_any_error_h5py_raises_inside_a_read_is_a_checkpoint_error(tmp_path, monkeypatch, error):
    """issue 26 item 4: what h5py raises on a damaged file (its five kinds) comes out of every reader as
    CheckpointError naming the file and the cause, never raw."""
    path = _save(tmp_path, 1)
    monkeypatch.setattr(checkpoint, "read_attrs", lambda *a, **k: (_ for _ in ()).throw(error))
    cause = str(error).splitlines()[0]
    for read in (load_state_dict, checkpoint.read_checkpoint,
                 lambda p: checkpoint.read_rank_state(p, 0), lambda p: export_state_dict(p, tmp_path / "m.pt")):
        with pytest.raises(CheckpointError) as info:
            read(path)
        assert info.value.path == path and cause in str(info.value), str(info.value)
    assert not (tmp_path / "m.pt").exists()


WRITER = r"""
import sys, time
from pathlib import Path
import numpy as np
from flodl_mpi.outputs.checkpoint import checkpoint_name, prune_checkpoints, write_checkpoint
directory, stop = Path(sys.argv[1]), Path(sys.argv[2])
i = 1
while not stop.exists() and i < 100000:
    params = {"w": np.full((64, 8), i, np.float32), "b": np.full(8, i, np.float32)}
    ranks = [({"optimizer/state/0/exp_avg": np.full(8, i, np.float64)}, {"step": i})]
    write_checkpoint(directory / checkpoint_name(i, i), params, {"n": np.array(i, np.int64)},
                     {"epoch": i, "round": i}, ["w", "b", "n"], ranks)
    prune_checkpoints(directory, 1)  # keep 1: the newest a reader listed is pruned at the next save
    (directory.parent / "saves").write_text(str(i))
    i += 1
"""


def test_polling_while_a_writer_saves_and_prunes_never_fails(tmp_path):
    """issue 26 item 4: the documented reader, `load_state_dict(run_dir)`, and export, polled while a
    writer process saves and prunes (keep 1): zero failures over every poll; each read is one whole save.

    Bounded by polls, not time: the loop ends after 150 polls or once 100 saves went by."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    stop = tmp_path / "stop"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(run / "checkpoints"), str(stop)],
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    failures, got = [], []
    try:
        deadline = time.monotonic() + 120
        while not (run / "saves").exists():                    # the first save is in
            assert writer.poll() is None and time.monotonic() < deadline, "the writer did not start"
            time.sleep(0.01)
        polls = 0
        while polls < 150 and (not got or got[-1] - got[0] < 100):
            polls += 1
            try:
                if polls % 50 == 0:
                    _, _, passed_over = export_state_dict(run, tmp_path / f"m{polls}.pt")
                    state = torch.load(tmp_path / f"m{polls}.pt", weights_only=True)
                    assert passed_over == [], passed_over
                else:
                    state = load_state_dict(run)
            except Exception as exc:  # noqa: BLE001 - counted: the assertion below names them
                failures.append(f"{type(exc).__name__}: {exc}")
                continue
            values = _values(state)
            assert len(values) == 1, values                    # one save, whole: never a mix
            got.append(values.pop())
    finally:
        stop.touch()
        writer.wait(timeout=60)
    assert failures == [], f"{len(failures)} of {polls} polls failed: {failures[:3]}"
    assert writer.returncode == 0
    assert got == sorted(got)                                  # never an older save after a newer one
    assert len(got) == polls
