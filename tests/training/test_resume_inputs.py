"""--resume compares --model and --data by the file they name, not by their spelling (trial7 F6)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from flodl_mpi.training.data import ensure_digits
from flodl_mpi.errors import EXIT_INPUT
from flodl_mpi.training.resume_inputs import data_path_difference, file_sha256, model_file_record, model_spec_difference
from tests.conftest import fork_flodl

NET = """
import torch
from torch import nn


def make():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))
"""

#: The same structure (names, shapes), another file and another forward: what a resume must not take for the run's.
OTHER = NET.replace("nn.ReLU()", "nn.Tanh()").replace("import torch\n", "import torch  # another model\n")


def _real(path: Path) -> str:
    return os.path.realpath(path)


@pytest.fixture
def work(tmp_path, monkeypatch):
    d = tmp_path / "work"
    d.mkdir()
    (d / "net.py").write_text(NET)
    monkeypatch.chdir(d)
    return d


# ---------------------------------------------------------------- the rule, file by file


def test_the_same_text_is_the_same_model_whatever_the_record(work):
    assert model_spec_difference("net.py:make", "net.py:make", None) is None
    assert model_spec_difference("pkg.nets:make", "pkg.nets:make", None) is None
    assert model_spec_difference(None, None, None) is None


def test_another_spelling_of_the_recorded_file_is_the_same_model(work):
    record = model_file_record("net.py:make")
    assert record == {"path": _real(work / "net.py"), "sha256": file_sha256(work / "net.py")}
    for spelling in ("./net.py:make", f"{work}/net.py:make", f"{work}/../work/net.py:make"):
        assert model_spec_difference("net.py:make", spelling, record) is None, spelling
    (work / "sub").mkdir()
    os.chdir(work / "sub")
    assert model_spec_difference("net.py:make", "../net.py:make", record) is None


def test_a_moved_file_of_the_same_content_is_the_same_model(work, tmp_path):
    record = model_file_record("net.py:make")
    moved = tmp_path / "moved"
    shutil.move(work, moved)
    os.chdir(moved)
    assert model_spec_difference("net.py:make", "./net.py:make", record) is None
    assert not Path(record["path"]).exists()  # found by its content, not its path


def test_a_file_of_other_content_is_refused_naming_both(work):
    record = model_file_record("net.py:make")
    (work / "other.py").write_text(OTHER)
    why = model_spec_difference("net.py:make", "./other.py:make", record)
    assert why == (f"--model './other.py:make': ./other.py is not the run's model file {_real(work / 'net.py')} "
                   "(was 'net.py:make'): its content differs")
    (work / "elsewhere").mkdir()  # the run's file name, other content
    (work / "elsewhere" / "net.py").write_text(OTHER)
    assert model_spec_difference("net.py:make", "elsewhere/net.py:make", record) is not None


def test_another_factory_or_a_module_spec_is_compared_as_text(work):
    record = model_file_record("net.py:make")
    assert model_spec_difference("net.py:make", "./net.py:other", record) == \
        "--model './net.py:other' (was 'net.py:make')"
    assert model_spec_difference("pkg.nets:make", "pkg.other:make", None) == \
        "--model 'pkg.other:make' (was 'pkg.nets:make')"
    assert model_spec_difference(None, "./net.py:make", None) == "--model './net.py:make' (was None)"
    assert model_file_record("pkg.nets:make") is None and model_file_record(None) is None


def test_a_run_without_the_record_resumes_only_with_its_file_from_here(work, tmp_path):
    assert model_spec_difference("net.py:make", "./net.py:make", None) is None  # the same file, from here
    os.chdir(tmp_path)
    (tmp_path / "net.py").write_text(NET)  # same name and content, but nothing recorded says it is the run's
    why = model_spec_difference("work/net.py:make", "net.py:make", None)
    assert why.startswith("--model 'net.py:make' (was 'work/net.py:make'): the run recorded no content hash")


def test_data_spelling(work, tmp_path):
    (work / "d.h5").write_bytes(b"data")
    (tmp_path / "copy.h5").write_bytes(b"data")
    assert data_path_difference("d.h5", "./d.h5", fingerprinted=False) is None
    assert data_path_difference("d.h5", f"{work}/d.h5", fingerprinted=False) is None
    why = data_path_difference("d.h5", "../copy.h5", fingerprinted=False)
    assert why.startswith("--data '../copy.h5' (was 'd.h5'): the run recorded no data fingerprint")
    # With a fingerprint the content is compared on its own (check_resume_data): the copy is the run's data.
    assert data_path_difference("d.h5", "../copy.h5", fingerprinted=True) is None
    assert data_path_difference(None, "d.h5", fingerprinted=True) == "--data 'd.h5' (was None)"


# ---------------------------------------------------------------- the CLI, end to end (one rank)


def _train(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``flodl-mpi train -q --batch-size 128 ARGS`` run from ``cwd``, at a world of 1 in a forked child of pytest
    (tests/conftest.py's fork_flodl; was a 1-rank launch): the child inherits this process's working directory,
    set to ``cwd`` for the fork and set back after it. The spellings compared are the run's own, on any rank."""
    here = os.getcwd()
    os.chdir(cwd)
    try:
        return fork_flodl("train", "-q", "--batch-size", "128", *args, timeout=300)
    finally:
        os.chdir(here)


@pytest.mark.slow
def test_resume_of_a_moved_run_with_other_spellings_and_a_refused_other_file(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "net.py").write_text(NET)
    shutil.copy(ensure_digits(), work / "data.h5")
    first = _train(work, "--run-dir", "run", "--model", "net.py:make", "--data", "data.h5", "--epochs", "1")
    assert first.returncode == 0, first.stderr[-3000:]

    # Same working directory, the file spelled with ./ (trial7: refused, exit 2)
    again = _train(work, "--run-dir", "run", "--model", "./net.py:make", "--data", "./data.h5", "--epochs", "2",
                   "--resume")
    assert "started with other options" not in again.stderr
    assert again.returncode == 0, again.stderr[-3000:]
    record = json.loads((work / "run" / "config.json").read_text())["model_file"]
    assert record == {"path": _real(work / "net.py"), "sha256": file_sha256(work / "net.py")}

    # The whole directory moved, resumed from a subdirectory of the new place (trial7: refused, exit 2)
    moved = tmp_path / "moved"
    shutil.move(work, moved)
    (moved / "sub").mkdir()
    later = _train(moved / "sub", "--run-dir", "../run", "--model", "../net.py:make", "--data", "../data.h5",
                   "--epochs", "3", "--resume")
    assert later.returncode == 0, later.stderr[-3000:]
    newest = sorted((moved / "run").glob("config-resume-r*.json"))[-1]
    assert json.loads(newest.read_text())["model_file"]["path"] == _real(moved / "net.py")

    # Another file of the same structure: refused, naming both, nothing written
    (moved / "other.py").write_text(OTHER)
    before = sorted(p.name for p in (moved / "run").iterdir())
    start = time.monotonic()
    other = _train(moved / "sub", "--run-dir", "../run", "--model", "../other.py:make", "--data", "../data.h5",
                   "--epochs", "4", "--resume")
    assert time.monotonic() - start < 240
    assert other.returncode == EXIT_INPUT, other.stderr[-3000:]
    assert (f"flodl-mpi: error: --resume: the run in ../run was started with other options: --model "
            f"'../other.py:make': ../other.py is not the run's model file {_real(moved / 'net.py')} (was "
            "'../net.py:make'): its content differs") in other.stderr
    assert other.stderr.count("error:") == 1 and "Traceback" not in other.stderr
    assert sorted(p.name for p in (moved / "run").iterdir()) == before
