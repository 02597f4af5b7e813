"""flodl-mpi export never destroys work: a run's own files, other files without --force,
a missing output directory; a damaged newest checkpoint is passed over aloud (trial6 F3)."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from flodl_mpi.outputs.checkpoint import checkpoint_name, load_state_dict, write_checkpoint
from flodl_mpi.cli.export import main


def _run_dir(tmp_path, epochs=2):
    """A run directory as training leaves it: config.json, train.log, metrics.h5, ranks.json, one checkpoint per epoch."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text('{"epochs": 2}')
    (run / "train.log").write_text("epoch 1\nepoch 2\n")
    (run / "metrics.h5").write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 32)
    (run / "config-resume-r000023.json").write_text("{}")
    (run / "ranks.json").write_text('{"ranks": []}')
    paths = []
    for e in range(1, epochs + 1):
        params = {"w": np.full((2, 3), float(e), np.float32)}
        paths.append(write_checkpoint(run / "checkpoints" / checkpoint_name(e, 23 * e), params, {},
                                      {"epoch": e, "round": 23 * e}, ["w"]))
    return run, paths


def _snapshot(run):
    return {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("target", ["checkpoints/ckpt-e000002-r000046.h5", "checkpoints/ckpt-e000001-r000023.h5",
                                    "checkpoints/new.pt", "metrics.h5", "train.log", "config.json",
                                    "config-resume-r000023.json", "ranks.json"])
@pytest.mark.parametrize("force", [False, True])
def test_a_runs_own_files_are_never_replaced(tmp_path, capsys, target, force):
    run, _ = _run_dir(tmp_path)
    before = _snapshot(run)
    out = run / target
    assert main([str(run), str(out), *(["--force"] if force else [])]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"flodl-mpi export: error: {out} ")
    assert ("checkpoints of run" in err) if target.startswith("checkpoints/") else ("is a file of run" in err)
    assert _snapshot(run) == before        # nothing written, nothing replaced, no temporary left


def test_the_run_dir_given_through_a_symlink_is_recognised(tmp_path, capsys):
    run, _ = _run_dir(tmp_path)
    (tmp_path / "link").symlink_to(run)
    before = _snapshot(run)
    assert main([str(run), str(tmp_path / "link" / "metrics.h5"), "--force"]) == 2
    assert "is a file of run" in capsys.readouterr().err and _snapshot(run) == before


def test_the_source_checkpoint_itself_is_refused_even_outside_a_run(tmp_path, capsys):
    path = write_checkpoint(tmp_path / "ckpt-e000001-r000001.h5", {"w": np.ones(2, np.float32)}, {},
                            {"epoch": 1, "round": 1}, ["w"])
    before = path.read_bytes()
    assert main([str(path), str(path), "--force"]) == 2
    assert "is the checkpoint being exported" in capsys.readouterr().err
    assert path.read_bytes() == before


def test_an_existing_file_is_replaced_only_with_force(tmp_path, capsys):
    run, paths = _run_dir(tmp_path)
    out = tmp_path / "existing.pt"
    out.write_bytes(b"someone's file")
    assert main([str(run), str(out)]) == 2
    err = capsys.readouterr().err
    assert err == f"flodl-mpi export: error: {out} exists; not replaced (pass --force to replace it)\n"
    assert out.read_bytes() == b"someone's file"
    assert main([str(run), str(out), "--force"]) == 0
    got = torch.load(out, weights_only=True)
    assert torch.equal(got["w"], load_state_dict(paths[-1])["w"]) and float(got["w"][0, 0]) == 2.0
    assert not list(tmp_path.glob(".existing.pt*"))


def test_a_missing_output_directory_is_one_line_exit_2_in_time(tmp_path):
    run, _ = _run_dir(tmp_path)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "flodl_mpi", "export", str(run), str(tmp_path / "nodir" / "m.pt")],
                          capture_output=True, text=True, check=False, timeout=120)
    assert time.monotonic() - start < 60
    assert proc.returncode == 2
    assert proc.stderr == (f"flodl-mpi export: error: {tmp_path / 'nodir' / 'm.pt'}: the directory "
                           f"{tmp_path / 'nodir'} does not exist; create it first\n")
    assert not (tmp_path / "nodir").exists()


@pytest.mark.parametrize("damage", ["not_hdf5", "checksum"])
def test_a_damaged_newest_checkpoint_is_named_with_the_one_exported(tmp_path, capsys, damage):
    run, paths = _run_dir(tmp_path)
    newest = paths[-1]
    if damage == "not_hdf5":   # what a slipped export did to it before
        newest.write_bytes(b"PK\x03\x04" + b"\0" * 64)
    else:
        from tests.conftest import flip_data_byte
        flip_data_byte(newest, "params", "w")
    before = _snapshot(run)
    out = tmp_path / "model.pt"
    assert main([str(run), str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1
    assert captured.err.startswith("flodl-mpi export: warning: ckpt-e000002-r000046.h5 (epoch 2) is damaged (")
    assert captured.err.rstrip().endswith("not exported: exported ckpt-e000001-r000023.h5 (epoch 1), "
                                          "the newest checkpoint that reads back")
    assert f"from {paths[0]} " in captured.out
    assert float(torch.load(out, weights_only=True)["w"][0, 0]) == 1.0     # epoch 1's weights
    assert _snapshot(run) == before         # read only: nothing renamed (resume sets aside, export does not)


def test_a_sound_newest_checkpoint_is_exported_without_a_warning(tmp_path, capsys):
    run, paths = _run_dir(tmp_path)
    assert main([str(run), str(tmp_path / "m.pt")]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and f"from {paths[-1]} " in captured.out
