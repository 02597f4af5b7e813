"""The run directories the landed version before the sub-packages (ea0275a, flodl-mpi 0.1.0) wrote, kept as
test data (tests/data/runs_ea0275a: its README says how each was made), and what that version's own
resume of each gave (``reference/``)."""

from __future__ import annotations

import json
import shutil
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


def reference(name: str) -> tuple[dict[str, np.ndarray], object]:
    """What the old version's resume of ``name`` ended with: its final params and buffers by state-dict
    name, and its JSON record (the CLI's: epochs' avg_loss and test_accuracy, last round and checkpoint;
    the own loop's: each epoch it ended)."""
    with np.load(DATA / "reference" / f"{name}.npz") as npz:
        arrays = {k: npz[k] for k in npz.files}
    return arrays, json.loads((DATA / "reference" / f"{name}.json").read_text())
