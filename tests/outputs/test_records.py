"""What runs of the Python API record: the epoch aggregate's accuracy, an own loop's samples and loss,
config.json as built (issue 7). The runs are a world of 1 in a fork of this process (``fork_python`` /
``fork_flodl``: torch loaded; were ``python`` processes and, for the CLI's check, launches at 1 and 2 ranks),
but `FIT_LR`'s: ``scale_lr`` scales by the world, so it is launched at 2 ranks."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from flodl_mpi.outputs.metrics import read_table
from flodl_mpi.protocol.epoch_report import EPOCH_FIELDS, aggregate_epoch
from tests.conftest import fork_flodl, fork_python, launch_env


def _matrix(**cols) -> np.ndarray:
    """A gathered (W, k) epoch matrix: the named columns given, the rest 0."""
    W = len(next(iter(cols.values())))
    m = np.zeros((W, len(EPOCH_FIELDS)))
    for name, values in cols.items():
        m[:, EPOCH_FIELDS.index(name)] = values
    return m


def test_no_accuracy_measured_is_nan_not_zero():
    # a regression: both ranks evaluated 50 samples, neither measured a correct count
    s = aggregate_epoch(_matrix(test_loss_sum=[10.0, 30.0], test_count=[50, 50], test_correct=[np.nan, np.nan],
                                batches=[2, 2]), 0, 4)
    assert np.isnan(s.test_accuracy) and s.test_loss == 0.4
    # classification: 45 + 40 correct of 100; a rank with no test samples says nothing either way
    s = aggregate_epoch(_matrix(test_loss_sum=[1.0, 1.0, 0.0], test_count=[50, 50, 0], test_correct=[45, 40, np.nan],
                                batches=[2, 2, 2]), 0, 4)
    assert s.test_accuracy == 0.85


def test_unrecorded_samples_give_nan_throughput_not_zero():
    s = aggregate_epoch(_matrix(samples=[-1, 64], compute_ms=[500.0, 500.0], batches=[2, 2]), 0, 4)
    assert np.isnan(s.per_rank_throughput[0]) and s.per_rank_throughput[1] == 128.0
    assert s.per_rank_samples.tolist() == [-1, 64]


#: Runs one world-of-1 script after another in one process (a fork of this one: torch loaded, not imported
#: again for each): each in its own folder (``argv.txt``: the script and its arguments), ``== <folder>`` printed
#: before it; a script that raises leaves its traceback in ``error.txt`` and the next one runs.
DRIVER = """
import os, runpy, sys, traceback
for folder in sys.argv[1:]:
    os.chdir(folder)
    sys.argv = open("argv.txt").read().split()
    print(f"== {folder}", flush=True)
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except BaseException:
        with open("error.txt", "w") as fh:
            traceback.print_exc(file=fh)
    sys.stdout.flush()
"""


class SharedRuns:
    """The module's world-of-1 runs that several tests read, made once in one process (`DRIVER`, in a fork)."""

    def __init__(self, root, runs: dict[str, tuple[str, tuple[str, ...]]]):
        self.root = root
        for name, (code, args) in runs.items():
            (root / name).mkdir()
            (root / name / "script.py").write_text(textwrap.dedent(code))
            (root / name / "argv.txt").write_text(" ".join(("script.py", *args)))
        (root / "driver.py").write_text(DRIVER)
        proc = fork_python(root / "driver.py", *(str(root / n) for n in runs), timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        self.stdout = {n: proc.stdout.split(f"== {root / n}\n", 1)[1].split("\n== ", 1)[0] for n in runs}

    def folder(self, name: str):
        """The folder the run ``name`` ran in (its run dirs inside), after checking it ran without error."""
        error = self.root / name / "error.txt"
        assert not error.exists(), error.read_text()[-3000:]
        return self.root / name

    def copy(self, name: str, dest):
        """A copy of the folder of run ``name`` at ``dest``, for a test that resumes or changes it."""
        import shutil

        shutil.copytree(self.folder(name), dest, dirs_exist_ok=True)
        return dest


@pytest.fixture(scope="module")
def shared_runs(tmp_path_factory):
    """OWN_LOOP, FIT, CLOSE_ROUND, CLOSE_MID_EPOCH and FIT_OPT's first runs (1 epoch, each optimizer): one process,
    a fork of this one (was: a ``python`` process; before it, one process per test, OWN_LOOP and two of
    FIT_OPT's first runs made twice)."""
    return SharedRuns(tmp_path_factory.mktemp("records"), {
        "own_loop": (OWN_LOOP, ()), "fit": (FIT, ()), "close_round": (CLOSE_ROUND, ()),
        "close_mid_epoch": (CLOSE_MID_EPOCH, ()),
        **{f"fit_opt_{opt}": (FIT_OPT, (opt, "1", "new")) for opt in ("sgd", "rmsprop", "adam")}})


OWN_LOOP = """
import torch, flodl_mpi
from torch import nn
torch.manual_seed(0)
x = torch.randn(60, 4); y = x.sum(1, keepdim=True)
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5, weight_decay=1e-4)
with flodl_mpi.Averager(model, optimizer=opt, policy="window", window=2, run_dir="own") as avg:
    for epoch in range(2):
        for i in range(0, 60, 20):
            opt.zero_grad(); loss = nn.functional.mse_loss(model(x[i:i+20]), y[i:i+20]); loss.backward(); opt.step()
            avg.step(loss, samples=20) if epoch == 0 else avg.step()
        with torch.no_grad():
            err = ((model(x) - y) ** 2).sum()
        avg.end_epoch({"mse": (err, 60)})
"""


@pytest.mark.slow
def test_an_own_loop_records_what_it_measured(shared_runs):
    """An Averager run's records say what it measured. OWN_LOOP runs in the module's shared process
    (`shared_runs`; was: its own). Issue 20 item 4: train.log's policy words are the registry's one
    wording, the report's (``2 step() calls per rank per round``, where train.log said ``a round after
    every 2 step() calls``)."""
    run = shared_runs.folder("own_loop") / "own"
    ep = read_table(run / "metrics.h5", "epochs")
    # epoch 1: 3 steps of 20 samples each; epoch 2: step() was given neither samples nor loss
    assert ep["per_rank_samples"].tolist() == [[60], [-1]]
    assert np.isfinite(ep["per_rank_throughput"][0, 0]) and np.isnan(ep["per_rank_throughput"][1, 0])
    assert np.isfinite(ep["avg_loss"][0]) and np.isnan(ep["avg_loss"][1])
    assert np.isnan(ep["test_accuracy"]).all()                      # "mse" only: no accuracy, not 0
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["api"] == "Averager" and cfg["loss"] == "loss given to step()"
    assert cfg["model"] == {"class": "torch.nn.modules.linear:Linear", "parameters": 5}
    assert cfg["optimizer"] == {"class": "torch.optim.sgd:SGD", "param_groups": [
        {"params": 2, "lr": 0.05, "momentum": 0.5, "dampening": 0, "nesterov": False, "weight_decay": 1e-4}]}
    assert (cfg["policy"], cfg["window"]) == ("window", 2)
    for name in ("epochs", "batch_size", "lr", "seed", "device", "threads", "momentum"):
        assert name not in cfg and name in cfg["not_applicable"]
    from flodl_mpi.cli.report import format_summary
    from flodl_mpi.outputs.run_reader import load_run

    r = load_run(run)
    assert r.config == cfg and r.attrs["loss"] == "loss given to step()"   # metrics.h5 holds the same record
    text = format_summary(r)
    assert "epochs        2 (end_epoch() calls" in text and "of 10" not in text
    assert "test metrics  mse" in text and "accuracy" not in text.split("\n", 1)[1]
    log = (run / "train.log").read_text().splitlines()  # as the CLI's: a header, a line per epoch, a last line
    # issue 20 item 4: the registry's one wording, the report's (it said "a round after every 2 step() calls")
    assert "your own loop (flodl_mpi.Averager), policy window (2 step() calls per rank per round)" in log[0]
    assert [line.split()[1:3] for line in log[1:3]] == [["epoch", "1"], ["epoch", "2"]] and "test_mse" in log[2]
    # 3 step() calls an epoch at window 2: a round after the 2nd, and end_epoch() closes the 3rd's window
    assert log[-1].split(" ", 1)[1].startswith("done: 2 epoch(s) of your loop, 4 rounds")


FIT = """
import numpy as np, torch, flodl_mpi
from torch import nn
rng = np.random.default_rng(0)
x = rng.normal(size=(80, 3)).astype(np.float32); y = (x @ np.array([[1.0], [2.0], [-1.0]], np.float32))
data = {"train": (x[:60], y[:60]), "test": (x[60:], y[60:])}
for run_dir in ("fit", "again"):  # two runs in one process: each its own train.log
    run = flodl_mpi.fit(lambda input_shape, target_shape: nn.Linear(input_shape[0], target_shape[0]),
                        lambda p: torch.optim.AdamW(p, lr=0.02, betas=(0.8, 0.9), weight_decay=0.05),
                        data=data, batch_size=16, epochs=2, run_dir=run_dir)
    run.wait()
for epoch in flodl_mpi.fit(lambda input_shape, target_shape: nn.Linear(input_shape[0], target_shape[0]), "sgd",
                           data=data, batch_size=16, epochs=3, run_dir="left"):
    break  # the loop leaves after epoch 1: not done
"""


@pytest.mark.slow
def test_a_fit_regression_records_its_model_optimizer_and_loss(shared_runs):
    """FIT runs in the module's shared process (`shared_runs`; was: its own)."""
    tmp_path = shared_runs.folder("fit")
    run = tmp_path / "fit"
    ep = read_table(run / "metrics.h5", "epochs")
    assert np.isnan(ep["test_accuracy"]).all() and np.isfinite(ep["test_loss"]).all()
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["api"] == "fit" and cfg["loss"] == "mean squared error" and cfg["epochs"] == 2
    assert cfg["model"] == {"class": "torch.nn.modules.linear:Linear", "parameters": 4}
    group = cfg["optimizer"]["param_groups"][0]
    assert cfg["optimizer"]["class"] == "torch.optim.adamw:AdamW"
    assert (group["lr"], group["betas"], group["weight_decay"]) == (0.02, [0.8, 0.9], 0.05)
    for name in ("lr", "momentum", "weight_decay", "train_x", "anchor"):
        assert name not in cfg and name in cfg["not_applicable"]
    log = (run / "train.log").read_text().splitlines()
    assert "test_acc" not in "\n".join(log)
    assert any("flodl-mpi" in line and "1 rank" in line and "4 params" in line for line in log)  # the header
    assert "done:" in log[-1] and "accuracy" not in log[-1]
    again = (tmp_path / "again" / "train.log").read_text().splitlines()
    assert sum("done:" in line for line in log) == 1 and "done:" in again[-1] and "run dir again" in again[1]
    left = (tmp_path / "left" / "train.log").read_text().splitlines()
    assert left[-1].endswith("stopped, not done (3 epochs asked); to go on, call fit() again with resume=True, "
                             "run_dir='left'")


FIT_LR = """
import numpy as np, torch, flodl_mpi
from torch import nn
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 3)).astype(np.float32); y = x.sum(1, keepdims=True)
for run_dir, scale in (("scaled", True), ("given", False)):
    flodl_mpi.fit(lambda input_shape, target_shape: nn.Linear(input_shape[0], target_shape[0]),
                  lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.5, weight_decay=1e-4),
                  data=((x, y), (x, y)), batch_size=8, epochs=1, scale_lr=scale, run_dir=run_dir).wait()
"""


CLOSE_ROUND = """
import numpy as np, torch, flodl_mpi
from torch import nn
torch.manual_seed(0)
x = torch.randn(60, 4); y = x.sum(1, keepdim=True)
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
with flodl_mpi.Averager(model, optimizer=opt, policy="window", window=2, run_dir="own") as avg:
    for i in range(0, 60, 20):  # 3 step() calls: a round after the 2nd; the 3rd's window end_epoch() closes
        opt.zero_grad(); loss = nn.functional.mse_loss(model(x[i:i+20]), y[i:i+20]); loss.backward(); opt.step()
        avg.step(loss)
    with torch.no_grad():
        err = ((model(x) - y) ** 2).sum()
    # float64 from the model's own values: the test loss the checkpoints must hold
    w, b = model.weight.detach().double().numpy(), model.bias.detach().double().numpy()
    print(f"expected {float((((x.double().numpy() @ w.T + b) - y.double().numpy()) ** 2).sum() / 60)!r}", flush=True)
    avg.end_epoch({"loss": (err, 60)})
"""


@pytest.mark.slow
def test_a_fit_run_logs_and_saves_the_factorys_learning_rate(tmp_path):
    """Issue 7: train.log and the checkpoint told the CLI's default lr 0.001 and 'adam', not the factory's SGD.
    Launched at 2 ranks: ``scale_lr`` multiplies the factory's lr by the world (x 2), which a world of 1 leaves as is."""
    from flodl_mpi.outputs.checkpoint import latest_checkpoint, read_checkpoint
    from tests.conftest import launch_argv

    (tmp_path / "script.py").write_text(textwrap.dedent(FIT_LR))
    proc = subprocess.run(launch_argv(2, sys.executable, "script.py"), cwd=tmp_path, capture_output=True, text=True,
                          env=launch_env(), timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    scaled = (tmp_path / "scaled" / "train.log").read_text()
    assert "; scale_lr=True: lr 0.01 x 2 = 0.02" in scaled and "--scale-lr" not in scaled
    b = read_table(tmp_path / "scaled" / "metrics.h5", "batches")
    np.testing.assert_allclose(b["lr"], 0.02, rtol=1e-12)  # the rate used is the one the log tells
    given = (tmp_path / "given" / "train.log").read_text()
    assert "lr 0.01 as given" in given and "raise lr toward 0.02 or set scale_lr=True)" in given
    assert "--lr" not in given and "--scale-lr" not in given
    for run in ("scaled", "given"):
        saved = read_checkpoint(latest_checkpoint(tmp_path / run / "checkpoints")).meta["config"]
        assert (saved["optimizer"], saved["lr"], saved["momentum"], saved["weight_decay"]) == ("sgd", 0.01, 0.5, 1e-4)


@pytest.mark.slow
def test_inspect_shows_an_api_runs_record_not_the_cli_defaults(shared_runs, capsys):
    """Issue 7: an Averager run (SGD, lr 0.05)'s checkpoint read 'adam', lr 0.001, epochs 10, train_x 'train/x'.
    OWN_LOOP's run is the module's shared one (`shared_runs`; was: made again here)."""
    from flodl_mpi.outputs.checkpoint import latest_checkpoint, read_checkpoint
    from flodl_mpi.cli.inspect_cmd import main

    tmp_path = shared_runs.folder("own_loop")
    path = latest_checkpoint(tmp_path / "own" / "checkpoints")
    meta = read_checkpoint(path).meta
    assert meta["run_record"] == json.loads((tmp_path / "own" / "config.json").read_text())
    assert meta["config"]["lr"] == 0.001  # the resume config stays whole: the resume checks read it
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    record = out.split("  run record", 1)[1].split("  state dict", 1)[0]
    assert "torch.optim.sgd:SGD: lr 0.05, momentum 0.5, dampening 0, nesterov false, weight_decay 0.0001 (2 tensors)" \
        in record and "Averager" in record
    for cli_default in ("adam", '"lr": 0.001', "train/x", '"epochs": 10', "    batch_size ", "    seed "):
        assert cli_default not in out.split("  state dict", 1)[0], cli_default
    assert "    not_applicable " in record  # the fields the run did not use are named, not filled


@pytest.mark.slow
def test_the_last_round_and_the_test_figures_reach_the_records(shared_runs):
    """The round that closes the epoch's last window has its metrics.h5 row, and the checkpoint after it the
    epoch's test figures (were: lost, NaN). Since issue 26 item 2 end_epoch() runs that round (was: close()),
    so the epoch's checkpoint is the one after it and close() has nothing left to save. CLOSE_ROUND runs in
    the module's shared process (`shared_runs`; was: its own)."""
    from flodl_mpi.outputs.checkpoint import list_checkpoints, read_checkpoint

    run = shared_runs.folder("close_round") / "own"
    expected = float(shared_runs.stdout["close_round"].split("expected ")[1].split()[0])
    np.testing.assert_array_equal(read_table(run / "metrics.h5", "rounds")["round"], [0, 1])
    saved = list_checkpoints(run / "checkpoints")
    assert [p.name for p in saved] == ["ckpt-e000001-r000002.h5"]
    for path in saved:  # the epoch's checkpoint, after the pending window's round
        meta = read_checkpoint(path).meta
        assert (meta["epoch"], meta["epoch_complete"], meta["test_count"]) == (1, True, 60)
        np.testing.assert_allclose(meta["test_loss"], expected, rtol=1e-5)
        assert np.isnan(meta["test_accuracy"])  # none measured
        assert meta["metrics_rows"]["rounds"] == meta["round"]
    log = (run / "train.log").read_text().splitlines()
    assert "1 epoch(s) of your loop, 2 rounds" in log[-1]


# ---- the optimizer a resume checks: what the checkpoint holds, recorded as built ---------------------------------

FIT_OPT = """
import os, sys, time, numpy as np, torch, flodl_mpi
from torch import nn
os.chdir(os.path.dirname(os.path.abspath(__file__)))  # its run dir "run" beside it (a fork has pytest's cwd)
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 3)).astype(np.float32); y = x.sum(1, keepdims=True)
make = {"sgd": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.5),
        "rmsprop": lambda p: torch.optim.RMSprop(p, lr=2e-3, momentum=0.1, weight_decay=1e-4),
        "adam": lambda p: torch.optim.Adam(p, lr=1e-3)}[sys.argv[1]]
t0 = time.monotonic()
try:
    run = flodl_mpi.fit(lambda input_shape, target_shape: nn.Linear(input_shape[0], target_shape[0]), make,
                        data=((x, y), (x, y)), batch_size=8, epochs=int(sys.argv[2]), run_dir="run",
                        resume=sys.argv[3] == "resume")
finally:
    print(f"setup took {time.monotonic() - t0:.1f} s", flush=True)
print(f"epochs {[r.epoch for r in run.wait()]}", flush=True)
"""


def _fit_opt(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """``python fit_opt.py ARGS`` (FIT_OPT) in ``tmp_path``: a world of 1 in a fork (was a ``python`` process)."""
    (tmp_path / "fit_opt.py").write_text(textwrap.dedent(FIT_OPT))
    return fork_python(tmp_path / "fit_opt.py", *args, timeout=300)


def _as_the_previous_release_wrote_it(path) -> None:
    """The checkpoint's config as ``fit`` wrote it before it recorded the factory's optimizer (deb12d2^):
    ``optimizer`` 'adam' for any factory, the CLI's lr, momentum and weight decay (checked once by running
    that release: an SGD factory at lr 0.01, momentum 0.5 saved 'adam', 0.001, 0.9, 0.0; its state SGD's)."""
    import h5py

    with h5py.File(path, "r+") as f:
        cfg = json.loads(f.attrs["config"])
        cfg.update(optimizer="adam", lr=1e-3, momentum=0.9, weight_decay=0.0)
        f.attrs["config"] = json.dumps(cfg)


@pytest.mark.slow
def test_a_checkpoint_of_the_previous_fit_with_an_sgd_factory_resumes(tmp_path, shared_runs):
    """Issue 7 left: the previous release recorded 'adam' for any factory; resuming its SGD run was refused.
    The first run (sgd, 1 epoch) is a copy of the module's shared one (`shared_runs`; was: made here)."""
    from flodl_mpi.outputs.checkpoint import latest_checkpoint, read_checkpoint, read_rank_state

    shared_runs.copy("fit_opt_sgd", tmp_path)
    path = latest_checkpoint(tmp_path / "run" / "checkpoints")
    _as_the_previous_release_wrote_it(path)
    assert read_checkpoint(path).meta["config"]["optimizer"] == "adam"
    assert read_rank_state(path, 0)[1]["optimizer_class"] == "SGD"  # what the checkpoint holds
    resumed = _fit_opt(tmp_path, "sgd", "2", "resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]  # was 2: "started with other options: optimizer='sgd'"
    assert "epochs [2]" in resumed.stdout
    log = (tmp_path / "run" / "train.log").read_text()
    assert f"note: {path.name}'s config records optimizer 'adam', but its state is SGD's" in log  # the path taken
    saved = read_checkpoint(latest_checkpoint(tmp_path / "run" / "checkpoints")).meta["config"]
    assert (saved["optimizer"], saved["lr"], saved["momentum"]) == ("sgd", 0.01, 0.5)  # the record is true again


@pytest.mark.slow
@pytest.mark.parametrize("first, then, held, uses", [("sgd", "adam", "SGD", "Adam"),
                                                     ("rmsprop", "adam", "RMSprop", "Adam"),
                                                     ("adam", "rmsprop", "Adam", "RMSprop")])
def test_a_resume_with_another_optimizer_is_refused_in_one_line(tmp_path, shared_runs, first, then, held, uses):
    """The first run (``first``, 1 epoch) is a copy of the module's shared one (`shared_runs`; was: made here)."""
    from flodl_mpi.outputs.checkpoint import latest_checkpoint

    shared_runs.copy(f"fit_opt_{first}", tmp_path)
    path = latest_checkpoint(tmp_path / "run" / "checkpoints")
    if first == "sgd":
        _as_the_previous_release_wrote_it(path)  # an old record ('adam') does not let Adam resume SGD's state
    before = path.read_bytes()
    refused = _fit_opt(tmp_path, then, "2", "resume")
    assert refused.returncode == 2, refused.stderr[-3000:]
    took = float(refused.stdout.split("setup took ")[1].split()[0])
    assert took < 120
    name = {"Adam": "'adam'", "RMSprop": "'torch.optim.rmsprop:RMSprop'"}[uses]
    line = (f"flodl-mpi: error: resume=True: run/checkpoints/{path.name} holds the optimizer state of {held}, this run builds {uses} "
            f"(optimizer={name}); resume with the optimizer the run was started with")
    assert refused.stderr.count(line) == 1, refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr
    assert path.read_bytes() == before and latest_checkpoint(tmp_path / "run" / "checkpoints") == path


@pytest.mark.slow
def test_an_rmsprop_factory_is_recorded_inspected_and_resumed(tmp_path, shared_runs, capsys):
    """Issue 7 left: an RMSprop factory's run recorded 'adam' in its resume config (and so checked 'adam').
    The first run (1 epoch) is a copy of the module's shared one (`shared_runs`; was: made here)."""
    from flodl_mpi.outputs.checkpoint import latest_checkpoint, read_checkpoint
    from flodl_mpi.cli.inspect_cmd import main

    shared_runs.copy("fit_opt_rmsprop", tmp_path)
    path = latest_checkpoint(tmp_path / "run" / "checkpoints")
    saved = read_checkpoint(path).meta["config"]
    assert (saved["optimizer"], saved["lr"], saved["momentum"], saved["weight_decay"]) == \
        ("torch.optim.rmsprop:RMSprop", 2e-3, 0.1, 1e-4)
    record = json.loads((tmp_path / "run" / "config.json").read_text())["optimizer"]
    assert record["class"] == "torch.optim.rmsprop:RMSprop"
    assert {k: record["param_groups"][0][k] for k in ("lr", "momentum", "weight_decay", "alpha", "centered")} == \
        {"lr": 2e-3, "momentum": 0.1, "weight_decay": 1e-4, "alpha": 0.99, "centered": False}
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert ("    optimizer                torch.optim.rmsprop:RMSprop: lr 0.002, momentum 0.1, weight_decay 0.0001, "
            "eps 1e-08, alpha 0.99, centered false (2 tensors)\n") in out  # whole, not cut at 100 characters
    resumed = _fit_opt(tmp_path, "rmsprop", "2", "resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "epochs [2]" in resumed.stdout and "note:" not in (tmp_path / "run" / "train.log").read_text()


CLOSE_MID_EPOCH = """
import torch, flodl_mpi
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with flodl_mpi.Averager(model, optimizer=opt, run_dir="own") as avg:
    for epoch in range(2):
        for i in range(5 if epoch == 0 else 3):
            opt.zero_grad(); loss = model(torch.ones(4, 2)).pow(2).mean(); loss.backward(); opt.step()
            avg.step(loss, samples=4)
        if epoch == 0:
            avg.end_epoch()
    # the loop leaves epoch 2 after 3 steps without end_epoch(): close() ends the run
"""


@pytest.mark.slow
def test_an_own_loop_closed_mid_epoch_records_every_batch(shared_runs):
    """Issue 7 left: the steps after the last end_epoch() had rounds in metrics.h5 but no batch rows.
    CLOSE_MID_EPOCH runs in the module's shared process (`shared_runs`; was: its own)."""
    from flodl_mpi.outputs.checkpoint import latest_checkpoint, read_checkpoint

    tmp_path = shared_runs.folder("close_mid_epoch")
    b = read_table(tmp_path / "own" / "metrics.h5", "batches")
    assert b["step"].tolist() == list(range(1, 9)) and b["epoch"].tolist() == [1] * 5 + [2] * 3
    assert np.isfinite(b["loss"]).all() and (b["rank"] == 0).all()
    assert len(read_table(tmp_path / "own" / "metrics.h5", "epochs")["epoch"]) == 1  # epoch 2 did not end
    meta = read_checkpoint(latest_checkpoint(tmp_path / "own" / "checkpoints")).meta
    assert not meta["epoch_complete"] and meta["metrics_rows"]["batches"] == 8  # a resume keeps all eight


@pytest.fixture(scope="module")
def _cli_run(tmp_path_factory):
    """A finished 1-epoch CLI run at a world of 1 (a fork; the defaults: Adam)."""
    run_dir = tmp_path_factory.mktemp("records-cli") / "run"
    proc = fork_flodl("train", "--epochs", "1", "--run-dir", str(run_dir), "-q", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.mark.slow
def test_the_cli_checks_the_optimizer_against_the_saved_state(tmp_path, _cli_run):
    """The CLI's resume check reads the same fact (the rank state's class): one line naming both, exit 2.
    The finished run is a copy of the module's 1-epoch CLI run (`_cli_run`; was the session's run A, 5 epochs
    at 2 ranks); the resume and the bad config are refused in forks at 1 rank (were launches at 2 and 1)."""
    import time

    from flodl_mpi.outputs.checkpoint import latest_checkpoint, read_checkpoint

    run = str(shutil.copytree(_cli_run, tmp_path / "run"))  # a finished run with Adam (its own copy)
    path = latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert read_checkpoint(path).meta["config"]["optimizer"] == "adam"
    t0 = time.monotonic()
    again = fork_flodl("train", "--optimizer", "sgd", "--epochs", "2", "--run-dir", run, "--resume", timeout=400)
    assert time.monotonic() - t0 < 300  # refused in setup, not after training (generous: a loaded machine)
    assert again.returncode == 2, again.stderr[-2000:]
    assert again.stderr.count(f"flodl-mpi: error: --resume: {path} holds the optimizer state of Adam, this run builds "
                              "SGD (--optimizer 'sgd'); resume with the optimizer the run was started with") == 1
    assert latest_checkpoint(tmp_path / "run" / "checkpoints") == path
    config = tmp_path / "opt.toml"
    config.write_text('optimizer = "torch.optim.rmsprop:RMSprop"\n')  # an API run's record is not a CLI choice
    bad = fork_flodl("train", "--config", str(config), "--epochs", "1", "--run-dir", str(tmp_path / "new"))
    assert bad.returncode == 2
    assert bad.stderr.count(f"flodl-mpi: error: --config {str(config)!r}: key 'optimizer': "
                            "'torch.optim.rmsprop:RMSprop': must be one of sgd, adam, adamw") == 1, bad.stderr[-2000:]
