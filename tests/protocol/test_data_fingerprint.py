"""A resume refuses data that changed since the run was stopped (shapes, dtypes, labels, sampled rows).

The runs are a world of 1 in a fork of this process (``fork_flodl`` / ``fork_python``: torch loaded, about
half a CPU second each; were 2-rank launches and ``python -c`` scripts): the data's fingerprint is rank 0's
record, checked through the same agreement as every setup refusal, whose "every rank exits 2, one line"
tests/cli/test_cli.py's launched refusals prove.
"""

import hashlib
import json
import time

import h5py
import numpy as np
import pytest

from flodl_mpi.training.data import dataset_from_arrays
from flodl_mpi.protocol.data_fingerprint import SAMPLED_ROWS, differences, fingerprint
from flodl_mpi.errors import EXIT_INPUT
from tests.conftest import fork_flodl, fork_python


def _data(n=200, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.random((n, 8), dtype=np.float32)
    y = rng.integers(0, 3, n).astype(np.int64)
    return x, y


_TX, _TY = _data(n=20, seed=1)


def _ds(x, y):
    return dataset_from_arrays((x, y), (_TX, _TY))


def test_the_fingerprint_sees_relabelled_reversed_and_reshaped_data():
    x, y = _data()
    base = fingerprint(_ds(x, y))
    assert differences(base, fingerprint(_ds(x.copy(), y.copy()))) == []
    assert differences(base, fingerprint(_ds(x, (y + 1) % 3))) == ["train data content (labels or sampled rows of x)"]
    assert differences(base, fingerprint(_ds(x[::-1].copy(), y))) == \
        ["train data content (labels or sampled rows of x)"]
    x2, y2 = _data(n=201)
    assert "train x shape (201, 8) (was (200, 8))" in differences(base, fingerprint(_ds(x2, y2)))


def test_the_fingerprint_reads_a_bounded_number_of_rows():
    """Rows between the sampled ones are not hashed: the time is bounded by SAMPLED_ROWS, not N."""
    n = 3 * SAMPLED_ROWS
    x, y = np.zeros((n, 8), np.float32), np.zeros(n, np.int64)
    base = fingerprint(_ds(x, y))
    x2 = x.copy()
    x2[1, 0] = 1.0  # row 1 lies between sampled rows 0 and 3
    assert differences(base, fingerprint(_ds(x2, y))) == []
    x2[0, 0] = 1.0  # row 0 is sampled
    assert differences(base, fingerprint(_ds(x2, y))) != []
    h = hashlib.sha256(y.tobytes())
    h.update(x[np.unique(np.linspace(0, n - 1, SAMPLED_ROWS).round().astype(np.int64))].tobytes())
    assert base["train sha256"] == h.hexdigest()  # independent recomputation of the definition


def _write(path, x, y):
    with h5py.File(path, "w") as f:
        f["train/x"], f["train/y"] = x, y
        f["test/x"], f["test/y"] = _TX, _TY


def _snapshot(run_dir):
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name != ".lock"}


@pytest.mark.slow
def test_a_resume_on_changed_data_is_refused_and_an_old_run_resumes_with_a_note(tmp_path):
    """Every run a world of 1 in a fork (were 2-rank launches; see the module's docstring)."""
    x, y = _data()
    data, run_dir = tmp_path / "d.h5", tmp_path / "r"
    _write(data, x, y)
    common = ("--data", str(data), "--run-dir", str(run_dir), "--batch-size", "16")
    first = fork_flodl("train", "--epochs", "1", *common, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "data_fingerprint" in json.loads((run_dir / "config.json").read_text())
    before = _snapshot(run_dir)
    for changed_x, changed_y in (((x, (y + 1) % 3)), (x[::-1].copy(), y)):  # the trial's two changes
        _write(data, changed_x, changed_y)
        t0 = time.monotonic()
        proc = fork_flodl("train", "--epochs", "2", "--resume", *common, timeout=120)
        assert time.monotonic() - t0 < 120
        assert proc.returncode == EXIT_INPUT, proc.stderr[-2000:]
        assert proc.stderr.count(f"--resume: the data differ from the run's in {run_dir}: train data content "
                                 "(labels or sampled rows of x)") == 1
        assert _snapshot(run_dir) == before  # nothing touched, train.log included
    # A run recorded before fingerprints: resumes, with a note.
    _write(data, x, y)
    record = json.loads((run_dir / "config.json").read_text())
    del record["data_fingerprint"]
    (run_dir / "config.json").write_text(json.dumps(record))
    old = fork_flodl("train", "--epochs", "2", "--resume", *common, timeout=300)
    assert old.returncode == 0, old.stderr[-2000:]
    assert "config.json holds no data fingerprint" in (run_dir / "train.log").read_text()
    again = fork_flodl("train", "--epochs", "3", "--resume", *common, timeout=300)  # the resume's record has one
    assert again.returncode == 0, again.stderr[-2000:]


_FIT = """
import sys
import torch
from torch import nn
import flodl_mpi
from flodl_mpi.errors import InputError

run_dir, relabel, epochs = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
g = torch.Generator().manual_seed(0)
x, y = torch.rand(64, 4, generator=g), torch.randint(0, 3, (64,), generator=g)
if relabel:
    y = (y + 1) % 3
try:
    flodl_mpi.fit(lambda: nn.Linear(4, 3), data={"train": (x, y), "test": (x[:16], y[:16])}, epochs=epochs,
                  batch_size=8, run_dir=run_dir, resume="auto").wait()  # the first call starts the run
except InputError as exc:
    print("REFUSED", exc)
    sys.exit(2)
print("RAN")
"""


@pytest.mark.slow
def test_fit_with_tensors_refuses_changed_tensors_on_resume(tmp_path):
    """Each ``fit`` call a world of 1 in a fork (was ``python -c``: the same world, a torch import each)."""
    run_dir = tmp_path / "r"
    script = tmp_path / "fit.py"
    script.write_text(_FIT)

    def fit(relabel, epochs):
        return fork_python(script, str(run_dir), "1" if relabel else "0", str(epochs), timeout=300)

    first = fit(False, 1)
    assert first.returncode == 0 and "RAN" in first.stdout, first.stdout + first.stderr[-2000:]
    before = _snapshot(run_dir)
    changed = fit(True, 2)
    assert changed.returncode == 2, changed.stdout + changed.stderr[-2000:]
    assert "the data differ from the run's in" in changed.stdout and "train data content" in changed.stdout
    assert _snapshot(run_dir) == before
    same = fit(False, 2)
    assert same.returncode == 0 and "RAN" in same.stdout, same.stdout + same.stderr[-2000:]


def test_the_fingerprint_sees_the_validation_set():
    from flodl_mpi.training.data import with_val

    x, y = _data()
    plain = fingerprint(_ds(x, y))
    val = fingerprint(with_val(_ds(x, y), x[:30], y[:30]))
    assert "val sha256" not in plain and differences(plain, val) == []  # recorded before val keys: not compared
    relabelled = y[:30].copy()
    relabelled[0] = (relabelled[0] + 1) % 3
    assert differences(val, fingerprint(with_val(_ds(x, y), x[:30], relabelled))) == [
        "val data content (labels or sampled rows of x)"
    ]
    assert differences(val, fingerprint(with_val(_ds(x, y), x[:31], y[:31]))) == [
        "val x shape (31, 8) (was (30, 8))",
        "val y shape (31,) (was (30,))",
        "val data content (labels or sampled rows of x)",
    ]
