"""issue 26 item 9: data, model and run-dir mistakes are refused before MPI and torch start
(they came after 8-20 s of MPI and torch start-up), with the lines the ranks give later."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import h5py
import numpy as np

from flodl_mpi.training.data import DataError, load_dataset
from flodl_mpi.errors import EXIT_INPUT
from tests.conftest import launch_env

#: Each case through cli.main in one process with no launcher; then the proof that neither
#: MPI nor torch was loaded for any of them (so every refusal came before they start).
SCRIPT = """
import contextlib, io, json, sys, time
from flodl_mpi.cli import main as cli
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    t0 = time.monotonic()
    with contextlib.redirect_stderr(err):
        rc = cli.main(["train", *argv])
    out.append([rc, err.getvalue(), time.monotonic() - t0])
out.append(sorted(m for m in ("mpi4py.MPI", "torch") if m in sys.modules))
print(json.dumps(out))
"""


def _h5(path, y_dtype=np.int64):
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        for split, n in (("train", 12), ("test", 4)):
            f[f"{split}/x"] = rng.random((n, 3), dtype=np.float32)
            f[f"{split}/y"] = (np.arange(n) % 2).astype(y_dtype)
    return str(path)


def _with_val(path, x_shape, y=True):
    """`_h5`'s file with a ``val`` group: ``val/x`` of ``x_shape``, ``val/y`` (class labels) unless ``y`` is False."""
    _h5(path)
    with h5py.File(path, "a") as f:
        f["val/x"] = np.zeros(x_shape, np.float32)
        if y:
            f["val/y"] = np.zeros(x_shape[0], np.int64)
    return str(path)


def test_input_mistakes_are_refused_before_mpi_and_torch_start(tmp_path):
    good, floats = _h5(tmp_path / "good.h5"), _h5(tmp_path / "floats.h5", np.float64)
    no_val_y, wide_val = _with_val(tmp_path / "no_val_y.h5", (3, 3), y=False), _with_val(tmp_path / "wide.h5", (3, 4))
    (tmp_path / "afile").write_text("")
    cases = {
        ("--data", str(tmp_path / "nope.h5")): f"--data {str(tmp_path / 'nope.h5')!r}: no such file",
        ("--data", good, "--train-y", "labels"):
            f"dataset 'labels' not found in {good!r} (has: test/x, test/y, train/x, train/y)",
        ("--data", floats): f"'train/y' in {floats!r} must be 1-D integer class labels, got float64 (12,) "
                               "(or per-position labels: integers of shape (N, T), T >= 2)",
        ("--data", no_val_y): f"dataset 'val/y' not found in {no_val_y!r} (has: test/x, test/y, train/x, train/y, "
                              "val/x)",
        ("--data", wide_val): f"'val/x' has feature shape (4,) but the training set has (3,) in {wide_val!r}",
        ("--model", "no_such_module_26:make"): "--model 'no_such_module_26:make': cannot import module "
                                               "'no_such_module_26': ModuleNotFoundError: No module named "
                                               "'no_such_module_26'",
        ("--model", "net.py"): "--model 'net.py': expected 'module:factory' or 'path/to/file.py:factory'",
        ("--wire", "int8-delta", "--node-reduce", "shm"): "--wire int8-delta travels over MPI (an Allgather of the "
                                                         "quantised deltas over the world); it does not run with "
                                                         "--node-reduce shm: use --node-reduce mpi or auto",
        ("--model", str(tmp_path / "gone.py") + ":make"):
            f"--model {str(tmp_path / 'gone.py') + ':make'!r}: no such file {str(tmp_path / 'gone.py')!r}",
        ("--run-dir", str(tmp_path / "afile")): f"--run-dir {str(tmp_path / 'afile')!r}: exists and is not a "
                                                "directory",
        ("--run-dir", str(tmp_path / "afile" / "run")):
            f"--run-dir {str(tmp_path / 'afile' / 'run')!r}: cannot create it: Not a directory "
            f"({tmp_path / 'afile'})",
    }
    # the same words as the ranks' later checks (where the check is the same one)
    for argv in list(cases)[:3]:
        try:
            load_dataset(argv[1], {"train_y": argv[3]} if len(argv) > 2 else {"train_y": "train/y"})
        except DataError as exc:
            assert str(exc) == cases[argv]
    for path in (no_val_y, wide_val):  # the val group's: as the load says it
        try:
            load_dataset(path)
        except DataError as exc:
            assert str(exc) == cases[("--data", path)]
        else:
            raise AssertionError(f"{path} loaded")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps([list(a) for a in cases])], cwd=tmp_path,
                          env=launch_env(), capture_output=True, text=True, timeout=300, check=False)
    assert time.monotonic() - start < 120  # a bound for a loaded machine, not a measurement
    assert proc.returncode == 0, proc.stderr
    *results, loaded = json.loads(proc.stdout)
    assert loaded == []                                   # no MPI, no torch: every refusal came before them
    for (rc, err, _), want in zip(results, cases.values()):
        assert rc == EXIT_INPUT and err == f"flodl-mpi: error: {want}\n", (err, want)
    assert not (tmp_path / "afile" / "run").exists()      # nothing created


def test_what_the_file_system_says_is_checked_early_only_on_one_host(tmp_path):
    """A refusal before MPI is each rank's own: on several hosts (node-local data may differ) only the
    spec's form is judged there, and the rest is left to the ranks' gathered check after MPI starts."""
    from flodl_mpi.config import TrainConfig
    from flodl_mpi.cli.precheck import input_problem, one_host

    hydra = {"PMI_RANK": "0", "PMI_SIZE": "4", "HYDI_CONTROL_FD": "5"}
    assert one_host({}) and one_host({**hydra, "MPI_LOCALNRANKS": "4"})
    assert not one_host({**hydra, "MPI_LOCALNRANKS": "2"}) and not one_host(hydra)
    ompi = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "1"}
    assert one_host({**ompi, "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}) and not one_host({**ompi,
                                                                                    "OMPI_COMM_WORLD_LOCAL_SIZE": "1"})
    srun = {"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "PMI_RANK": "0"}
    assert one_host({**srun, "SLURM_STEP_NUM_NODES": "1"}) and not one_host({**srun, "SLURM_STEP_NUM_NODES": "2"})
    missing = TrainConfig(data=str(tmp_path / "nope.h5"), model=str(tmp_path / "gone.py") + ":make")
    assert input_problem(missing, {**hydra, "MPI_LOCALNRANKS": "4"}) == f"--data {missing.data!r}: no such file"
    assert input_problem(missing, {**hydra, "MPI_LOCALNRANKS": "2"}) is None
    assert input_problem(TrainConfig(model="net.py"), hydra) == \
        "--model 'net.py': expected 'module:factory' or 'path/to/file.py:factory'"
