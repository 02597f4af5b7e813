"""The run directories the landed version before the sub-packages (ea0275a, flodl-mpi 0.1.0) wrote, kept as
test data (tests/data/runs_ea0275a: its README says how each was made), and what that version's own
resume of each gives.

What a resume gives is bit for bit only on the same floating-point arithmetic: the recorded
``reference/`` came from one machine, and another CPU's torch kernels (AVX-512 against AVX2, say)
round differently (an AMD EPYC with AVX-512 ended a bias 0.0044 away from it). So
:func:`reference` runs the old version's own resume here, on this machine, from the source of
commit ea0275a in this checkout's history (``git archive``, once a session), as make.sh made the
recorded one; only a checkout without that commit falls back to the recorded ``reference/``.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np

#: The folder: runs.tar.gz (cli_done, cli_stopped, averager_cut as written), reference/, the scripts.
DATA = Path(__file__).resolve().parent / "data" / "runs_ea0275a"
#: The CLI's model of those runs (``--model``; a resume finds it by its content hash).
TINY_MODEL = f"{DATA / 'tiny_model.py'}:model"
#: The CLI options every one of those runs was made with (make.sh's ``CLI``).
CLI = ("--model", TINY_MODEL, "--threads", "1", "--checkpoint-every", "1")
RUNS = ("cli_done", "cli_stopped", "averager_cut")


def unpacked(tmp_path_factory) -> Path:
    """The run dirs, unpacked once per session into a temporary folder: read them, never write there."""
    global _UNPACKED
    if _UNPACKED is None:
        dest = tmp_path_factory.mktemp("runs_ea0275a")
        with tarfile.open(DATA / "runs.tar.gz") as tar:
            tar.extractall(dest, filter="data")
        _UNPACKED = dest
    return _UNPACKED


_UNPACKED: Path | None = None


def copy_of(tmp_path_factory, name: str, dest: Path) -> Path:
    """A copy of run dir ``name`` at ``dest``, to resume or write into."""
    shutil.copytree(unpacked(tmp_path_factory) / name, dest)
    return dest


#: The commit whose code wrote the run dirs.
OLD_COMMIT = "ea0275a"
#: What the old version's resume of each run is (make.sh's reference commands): extra arguments after the copy.
_RESUMES = {"cli_done": ("--epochs", "3"), "cli_stopped": ("--epochs", "2")}


def old_source(tmp_path_factory) -> Path | None:
    """The old version's source tree (``git archive`` of `OLD_COMMIT`, once a session), or None where this
    checkout's history does not have it (a shallow clone, an sdist)."""
    global _OLD
    if _OLD is None:
        root = Path(__file__).resolve().parents[1]
        got = subprocess.run(["git", "-C", str(root), "archive", "--format=tar", OLD_COMMIT], capture_output=True,
                             check=False, timeout=120)
        if got.returncode != 0:
            _OLD = False
        else:
            dest = tmp_path_factory.mktemp(f"flodl_{OLD_COMMIT}")
            with tarfile.open(fileobj=io.BytesIO(got.stdout)) as tar:
                tar.extractall(dest, filter="data")
            _OLD = dest
    return _OLD or None


_OLD: Path | bool | None = None
_MADE: dict[str, tuple[dict[str, np.ndarray], object]] = {}


def _recorded(name: str) -> tuple[dict[str, np.ndarray], object]:
    with np.load(DATA / "reference" / f"{name}.npz") as npz:
        arrays = {k: npz[k] for k in npz.files}
    return arrays, json.loads((DATA / "reference" / f"{name}.json").read_text())


def _old_resume(tmp_path_factory, old: Path, name: str) -> tuple[dict[str, np.ndarray], object]:
    """make.sh's reference command for ``name``, run with the old version's code (``PYTHONPATH``) on a copy."""
    from flodl_mpi.outputs.checkpoint import latest_checkpoint, read_checkpoint
    from tests.conftest import launch_argv, launch_env

    work = tmp_path_factory.mktemp(f"old_resume_{name}")
    for script in ("tiny_model.py", "averager_loop.py"):
        shutil.copy(DATA / script, work / script)
    copy = copy_of(tmp_path_factory, name, work / f"ref_{name}")
    if name in _RESUMES:
        args = (sys.executable, "-m", "flodl_mpi", "train", "--model", "tiny_model.py:model", "--threads", "1",
                "--checkpoint-every", "1", "--run-dir", copy.name, *_RESUMES[name], "--resume")
    else:
        args = (sys.executable, "averager_loop.py", copy.name, "3", "0", "--resume", "--out", "final.npz")
    env = launch_env({"PYTHONPATH": str(old)})
    where = subprocess.run([sys.executable, "-c", "import flodl_mpi; print(flodl_mpi.__file__)"], env=env, cwd=work,
                           capture_output=True, text=True, timeout=120, check=True).stdout.strip()
    assert Path(where).is_relative_to(old), f"the old version's resume would import {where}, not {old}'s code"
    proc = subprocess.run(launch_argv(2, *args), cwd=work, capture_output=True, text=True, timeout=400, env=env,
                          check=False)
    assert proc.returncode == 0, f"the old version's resume of {name}: " + proc.stdout[-2000:] + proc.stderr[-3000:]
    if name not in _RESUMES:
        with np.load(work / "final.npz") as npz:
            arrays = {k: npz[k] for k in npz.files}
        return arrays, json.loads((work / "final.json").read_text())
    import h5py

    ck = read_checkpoint(latest_checkpoint(copy / "checkpoints"), ranks=[])
    with h5py.File(copy / "metrics.h5", "r") as f:
        rows = {"avg_loss": f["epochs/avg_loss"][()].tolist(), "test_accuracy": f["epochs/test_accuracy"][()].tolist(),
                "round": int(ck.meta["round"]), "epoch": int(ck.meta["epoch"]), "checkpoint": ck.path.name}
    return {**ck.params, **ck.buffers}, rows


def reference(name: str, tmp_path_factory) -> tuple[dict[str, np.ndarray], object]:
    """What the old version's resume of ``name`` ends with on this machine: its final params and buffers by
    state-dict name, and its JSON record (the CLI's: epochs' avg_loss and test_accuracy, last round and
    checkpoint; the own loop's: each epoch it ended). Run here by the old code (`old_source`), once a
    session; the recorded ``reference/`` where the old code is not in this checkout's history."""
    if name not in _MADE:
        old = old_source(tmp_path_factory)
        _MADE[name] = _recorded(name) if old is None else _old_resume(tmp_path_factory, old, name)
    return _MADE[name]
