"""flodl-mpi report: the summary's numbers, the A/B comparison, the plots, SWMR reading."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from flodl_mpi.cli.report import differing_options, format_comparison, format_summary, main, summarize
from flodl_mpi.outputs.run_reader import RunError, load_run
from tests._runs import RUN_A_EPOCHS, session_run_a, session_run_b, synthetic_rows, write_synthetic

plots = pytest.importorskip("flodl_mpi.cli.plots", reason="plots need matplotlib (the plot extra)")


@pytest.fixture(autouse=True)
def _sigpipe_kept():
    """The CLI's entry for the tools (`flodl_mpi.cli.main.main`, ``report`` included) makes SIGPIPE kill the
    process (`flodl_mpi.cli.main.unix_pipe`), as a tool should; called in this process, that would stay for the rest of the session (pytest, and the children
    it forks, then die of a closed pipe instead of raising): the handler is put back after each test."""
    before = signal.getsignal(signal.SIGPIPE)
    yield
    signal.signal(signal.SIGPIPE, before)


def _write_raw(run_dir: Path, tables: dict, attrs: dict) -> Path:
    """A metrics.h5 written by hand (another writer's version): any columns, any attrs."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with h5py.File(run_dir / "metrics.h5", "w", libver="latest") as f:
        for key, value in attrs.items():
            f.attrs[key] = value
        for table, cols in tables.items():
            for name, arr in cols.items():
                f.create_dataset(f"{table}/{name}", data=arr)
    return run_dir


# ---------------------------------------------------------------- summary numbers


def test_summary_numbers_match_the_hand_computed_values(tmp_path):
    run = load_run(write_synthetic(tmp_path / "r", world_size=2, rounds=20, epochs=3))
    s = summarize(run)
    # 20 rounds per rank of snapshot 1 + bridge 60 (control 2, pack 10, allreduce 30, unpack 10,
    # the rest 8) + hand-off 61 - 60 + adoption 1.5 = 63.5 ms: 1.27 s in 20 * 0.5 = 10 s of run.
    np.testing.assert_allclose(s["averaging_pct"], [12.7, 12.7])
    assert s["elapsed_s"] == 10.0
    assert s["bytes_per_rank"] == 20 * 1000
    assert s["rounds"] == 20 and s["skipped_rounds"] == 4           # rounds 4, 9, 14, 19
    np.testing.assert_allclose(s["batch_share"], [1 / 3, 2 / 3])    # 2 and 4 batches per epoch
    np.testing.assert_allclose(s["throughput"], [100.0, 200.0])
    assert (s["best_test_accuracy"], s["best_epoch"], s["test_accuracy"]) == (0.9, 2, 0.8)
    assert s["train_loss"] == pytest.approx(1 / 3) and s["test_loss"] == pytest.approx(0.5)
    assert s["guard"] == {"suppress_growth": 1}
    assert (s["epochs"], s["epochs_planned"]) == (3, 3)
    text = format_summary(run)
    assert "best 0.9000 at epoch 2" in text and "20.0 KB on the wire per rank" in text
    assert "r0 12.7  r1 12.7 % of wall time" in text and "suppress_growth 1" in text




def test_absent_and_extra_columns_are_tolerated(tmp_path):
    rows = synthetic_rows(2, 10, 2, skip=("rounds/anchor", "rounds/window", "rounds/pack_ms", "epochs/test_loss"))
    rows["rounds"]["quarantined"] = np.zeros((10, 2), bool)  # a column a later writer adds
    rows["rounds"]["quarantined"][[2, 5, 7], 1] = True
    run = load_run(_write_raw(tmp_path / "r", rows, {"world_size": 2, "config": json.dumps({"epochs": 2}),
                                                      "json_attrs": json.dumps(["config"])}))
    s = summarize(run)
    assert np.isnan(s["test_loss"])
    # without pack_ms the bridge's round is control 2 + allreduce 30 + unpack 10 + the rest 18:
    # 10 rounds of (1 + 60 + 1 + 1.5) ms / 5 s
    np.testing.assert_allclose(s["averaging_pct"], [12.7, 12.7])
    assert plots.cadence_figure([run]) is None
    assert len(plots.training_figure([run]).axes[0].get_lines()) == 1   # train loss only
    assert len(plots.round_times_figure([run]).axes[0].get_lines()) == 2
    assert "test -" in format_summary(run)
    assert s["quarantined"] == {1: 3} and "quarantined   rank 1 in 3 round(s)" in format_summary(run)


def test_newer_schema_is_refused_with_a_clear_message(tmp_path, capsys):
    run_dir = _write_raw(tmp_path / "r", synthetic_rows(2, 4, 1), {"world_size": 2, "schema_version": 99})
    with pytest.raises(RunError, match=r"schema_version 99 is newer than this flodl-mpi reads \(1\); upgrade"):
        load_run(run_dir)
    assert main([str(run_dir), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flodl-mpi report: error:") and "schema_version 99" in err and err.count("\n") == 1


def test_not_a_run_is_one_line(tmp_path, capsys):
    assert main([str(tmp_path), "--no-plots"]) == 2
    assert "no metrics.h5" in capsys.readouterr().err
    (tmp_path / "metrics.h5").write_text("not hdf5")
    assert main([str(tmp_path), "--no-plots"]) == 2
    assert "not an HDF5 file" in capsys.readouterr().err


def test_metrics_file_records_its_schema_version(tmp_path):
    from flodl_mpi.outputs.metrics import SCHEMA_VERSION

    run_dir = write_synthetic(tmp_path / "r")
    with h5py.File(run_dir / "metrics.h5", "r") as f:
        assert int(f.attrs["schema_version"]) == SCHEMA_VERSION == 1


# ---------------------------------------------------------------- comparison


def test_comparison_names_exactly_the_differing_options(tmp_path):
    a = load_run(write_synthetic(tmp_path / "A", config={"window": 1, "policy": "sync"}))
    b = load_run(write_synthetic(tmp_path / "B", config={"window": 4, "policy": "window"}, world_size=3))
    differ = differing_options([a, b])
    assert differ == {"policy": ["sync", "window"], "window": [1, 4], "world size (mpiexec -n)": [2, 3]}
    text = format_comparison([a, b])
    first = text.splitlines()[0]
    assert first.startswith("options that differ:")
    assert "--policy 'sync' vs 'window'" in first and "--window 1 vs 4" in first and "run-dir" not in first
    same = load_run(write_synthetic(tmp_path / "C", config={"window": 1, "policy": "sync"}))
    assert differing_options([a, same]) == {}
    assert "none" in format_comparison([a, same]).splitlines()[0]


def test_legends_name_the_differing_options(tmp_path):
    from flodl_mpi.cli.report import _with_option_labels

    a = load_run(write_synthetic(tmp_path / "A", config={"window": 1, "policy": "sync"}))
    b = load_run(write_synthetic(tmp_path / "B", config={"window": 4, "policy": "window"}))
    fig = plots.training_figure(_with_option_labels([a, b]))
    labels = [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
    assert labels == ["A [policy sync, window 1]: test accuracy", "B [policy window, window 4]: test accuracy"]


def test_stops_and_resumes_are_counted(tmp_path):
    run_dir = write_synthetic(tmp_path / "r")
    (run_dir / "train.log").write_text("10:00:00 epoch 1/3  loss 1\n"
                                        "10:00:01 stopped on request in epoch 2 at round 9; checkpoint saved\n"
                                        "10:05:00 resuming from ckpt-e000001-r000009.h5\n")
    (run_dir / "config-resume-r000009.json").write_text("{}")
    s = summarize(load_run(run_dir))
    assert (s["stops"], s["resumes"]) == (1, 1)
    assert s["last_log"].endswith("resuming from ckpt-e000001-r000009.h5")


# ---------------------------------------------------------------- plots


def _lines(fig) -> list[int]:
    return [len(ax.get_lines()) for ax in fig.axes if ax.get_label() != "<colorbar>"]


@pytest.mark.parametrize("n_runs", [1, 2])
def test_figures_draw_the_expected_series(tmp_path, n_runs):
    W = 3
    runs = [load_run(write_synthetic(tmp_path / f"r{i}", world_size=W)) for i in range(n_runs)]
    assert _lines(plots.training_figure(runs)) == [2 * n_runs, n_runs]       # train+test loss | accuracy
    assert _lines(plots.ranks_figure(runs)) == [W * n_runs, 2 * W * n_runs]  # throughput | done + allocation
    # ranks + guard markers + the 3 epochs' last rounds (vertical lines)
    assert _lines(plots.divergence_figure(runs)) == [(W + 1 + 3) * n_runs]
    # pack, allreduce, unpack | rank 0's bus bandwidth on its own axis
    assert _lines(plots.round_times_figure(runs)) == [3 * n_runs, n_runs]
    assert plots.cadence_figure(runs) is None                                # sync plans no quotas
    cadence = [load_run(write_synthetic(tmp_path / f"c{i}", world_size=W, config={"policy": "cadence"}))
               for i in range(n_runs)]
    assert _lines(plots.cadence_figure(cadence)) == [(1 + W) * n_runs]       # anchor + windows
    bars = plots.time_figure(runs).axes[0].containers
    # every part but the outer step and async's wait (0 in a sync run without --outer)
    assert [len(c) for c in bars] == [W * n_runs] * 12
    for fig in (plots.training_figure(runs), plots.divergence_figure(runs)):
        for ax in fig.axes:
            assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel()
            assert ax.get_legend() is not None


def test_write_plots_gives_valid_pngs(tmp_path):
    import matplotlib.image

    runs = [load_run(write_synthetic(tmp_path / "r"))]
    written = plots.write_plots(runs, tmp_path / "out")
    assert [p.name for p in written] == [f"{name}.png" for name in plots.FIGURES if name != "cadence"]
    assert plots.not_drawn(runs) == ["cadence.png: not drawn: policy sync plans no quotas per rank (only cadence "
                                     "and async do; a fixed policy's window is its --window option)"]
    for p in written:
        img = matplotlib.image.imread(p)
        # figsize (11, 4.5) inches at 100 dpi; the time bars (13 in wide): 1.2 in + 0.45 in per bar, at
        # least 2.5 in, + 0.22 in per part defined under the axes (12 parts)
        assert img.shape[:2] == ((514, 1300) if p.stem == "time" else (450, 1100)), p
        assert img.std() > 0                  # not blank
    assert not list((tmp_path / "out").glob(".*tmp*"))


# ---------------------------------------------------------------- real runs (mpiexec)


@pytest.fixture(scope="session")
def run_a(tmp_path_factory):
    return session_run_a(tmp_path_factory)


@pytest.fixture(scope="session")
def run_b(tmp_path_factory):
    return session_run_b(tmp_path_factory)


@pytest.mark.slow
def test_plots_label_epochs_as_the_log_does(run_a):
    # metrics.h5 counts epochs from 1 (as train.log): the per-epoch plots use that count as it is.
    run = load_run(run_a)
    epochs = list(range(1, RUN_A_EPOCHS + 1))
    assert run.column("epochs", "epoch").tolist() == epochs
    for fig in (plots.training_figure([run]), plots.ranks_figure([run])):
        for line in fig.axes[0].get_lines():
            assert list(line.get_xdata()) == epochs


def _report(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``flodl-mpi report`` through the CLI entry, in a fresh process that must not load MPI."""
    code = ("import sys; from flodl_mpi.cli.report import main; rc = main(sys.argv[1:]); "
            "assert 'mpi4py.MPI' not in sys.modules, 'report loaded MPI'; sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=False,
                          timeout=timeout)


def test_the_cli_entry_starts_no_mpi_for_report(tmp_path):
    run_dir = write_synthetic(tmp_path / "r")
    code = ("import sys; from flodl_mpi.cli.main import main; rc = main(['report', sys.argv[1], '--no-plots']); "
            "assert 'mpi4py.MPI' not in sys.modules, 'flodl-mpi report loaded MPI'; sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, str(run_dir)], capture_output=True, text=True, check=False,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_report_on_a_finished_run(run_a):
    proc = _report(str(run_a))
    assert proc.returncode == 0, proc.stderr
    assert f"epochs        {RUN_A_EPOCHS} of {RUN_A_EPOCHS} (finished)" in proc.stdout
    ep = json.loads((run_a / "config.json").read_text())
    assert ep["epochs"] == RUN_A_EPOCHS
    from flodl_mpi.outputs.metrics import read_table

    acc = read_table(run_a / "metrics.h5", "epochs")["test_accuracy"]
    assert f"test accuracy {acc[-1]:.4f} (last)" in proc.stdout
    assert sorted(p.name for p in (run_a / "plots").iterdir()) == sorted(f"{n}.png" for n in plots.FIGURES
                                                                        if n != "cadence")  # a sync run
    assert "plots: cadence.png: not drawn: policy sync plans no quotas per rank" in proc.stdout


@pytest.mark.slow
def test_report_compares_two_runs_through_the_cli(run_a, run_b, tmp_path, capsys):
    """``flodl-mpi report A B --out DIR`` through the CLI's entry (`flodl_mpi.cli.main.main`, as the script
    calls it), in this process (was a fresh ``python -m flodl_mpi``: that one loads no MPI is
    test_the_cli_entry_starts_no_mpi_for_report's, and test_report_on_a_finished_run's with plots)."""
    from flodl_mpi.cli.main import main as cli_main

    out = tmp_path / "ab"
    assert cli_main(["report", str(run_a), str(run_b), "--out", str(out)]) == 0  # (SIGPIPE: `_sigpipe_kept`)
    stdout = capsys.readouterr().out
    assert ("options that differ: --epochs 5 vs 3; --gamma 1.0 vs 0.5; --policy 'sync' vs 'window'; --window 1 vs 4"
            in stdout)
    header = next(line for line in stdout.splitlines() if line.split() == ["A", "B"])
    assert header
    assert len(list(out.glob("*.png"))) == len(plots.FIGURES) - 1  # sync and window: no cadence figure


def _child_pids() -> set[int]:
    """The pids of this process's children (from /proc: their parent pid)."""
    me, found = os.getpid(), set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                found.add(int(entry.name))
    return found


def _epochs_written(path: Path) -> int:
    """The rows of a metrics.h5's epochs table, 0 while the file or the table is not there yet."""
    from flodl_mpi.outputs.metrics import read_table

    try:
        return len(read_table(path, "epochs")["epoch"])
    except (OSError, KeyError):
        return 0


@pytest.mark.slow
def test_report_while_the_run_writes(tmp_path):
    """Reader and writer in two processes: report reads a run that is still training.

    The writer is a world of 1 in a forked child (``fork_flodl``, in a thread of this process; was a 2-rank
    launch): what is read while it writes (SWMR, the run's lock held: "running") is rank 0's metrics.h5,
    whatever the world size. Its model is the built-in one with a 50 ms sleep in each training forward, so the
    run spends the time the report takes sleeping rather than training (an epoch of 45 batches: about 2.5 s;
    200 of them outlast any report); it is killed once read."""
    import threading

    from tests.conftest import fork_flodl

    run_dir = tmp_path / "live"
    module = tmp_path / "sleepy.py"
    module.write_text(
        "import time, torch\n"
        "from flodl_mpi.training.models import digits_mlp\n"
        "class Sleepy(torch.nn.Module):\n"
        "    def __init__(self, inner):\n"
        "        super().__init__()\n"
        "        self.inner = inner\n"
        "    def forward(self, x):\n"
        "        if self.training:\n"
        "            time.sleep(0.05)\n"
        "        return self.inner(x)\n"
        "def make(input_shape, num_classes):\n"
        "    return Sleepy(digits_mlp(input_shape, num_classes))\n")
    before, result = _child_pids(), {}

    def train() -> None:
        try:
            result["proc"] = fork_flodl("train", "--run-dir", str(run_dir), "--epochs", "200",
                                        "--model", f"{module}:make", timeout=600)
        except BaseException as exc:  # noqa: BLE001  (re-raised by the test below)
            result["error"] = exc

    writer = threading.Thread(target=train, daemon=True)
    writer.start()
    pid = None
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and writer.is_alive():
            if pid is None:
                pid = next(iter(_child_pids() - before), None)
            if _epochs_written(run_dir / "metrics.h5"):  # an epoch is done: its row is written
                break
            time.sleep(0.2)
        assert writer.is_alive(), f"the run ended before the test could read it: {result}"
        proc = _report(str(run_dir), "--out", str(tmp_path / "plots"))
        still_running = writer.is_alive()
        assert proc.returncode == 0, proc.stderr
        epochs = int(proc.stdout.split("epochs", 1)[1].split()[0])
        assert 1 <= epochs < 200 and "of 200 (running)" in proc.stdout  # its lock is held
        assert still_running, "the run must still be writing while the report reads"
        assert len(list((tmp_path / "plots").glob("*.png"))) == len(plots.FIGURES) - 1  # sync: no cadence
    finally:
        if pid is None:
            pid = next(iter(_child_pids() - before), None)
        if pid is not None and writer.is_alive():
            os.kill(pid, signal.SIGKILL)
        writer.join(timeout=60)
    assert "error" not in result, result
    assert result["proc"].returncode == -signal.SIGKILL, result["proc"].stderr[-3000:]  # running until killed


# ---------------------------------------------------------------- what a run measured (issue 7)


def test_a_run_without_accuracy_shows_its_own_metrics_and_no_accuracy(tmp_path):
    """A regression: test_accuracy NaN in every row; the report names the user's metrics and the loss."""
    rows = synthetic_rows(2, 10, 3)
    rows["epochs"]["test_accuracy"] = np.full(3, np.nan)
    rows["epochs"]["test_loss"] = np.array([0.9, np.nan, 0.5])   # epoch 2 not evaluated
    rows["scalars"] = {"epoch": np.array([1, 1, 3, 3, 1, 2, 3]),
                       "name": np.array([b"eval/loss", b"eval/mae", b"eval/loss", b"eval/mae", b"mae", b"mae",
                                         b"mae"]),
                       "value": np.array([0.9, 0.7, 0.5, 0.4, 0.8, 0.6, 0.45]), "count": np.full(7, 100),
                       "per_rank_mean": np.ones((7, 2)), "per_rank_count": np.full((7, 2), 50)}
    run = load_run(_write_raw(tmp_path / "r", rows, {
        "world_size": 2, "loss": "mean squared error", "policy": "sync",
        "config": json.dumps({"epochs": 3, "policy": "sync", "api": "fit"}), "json_attrs": json.dumps(["config"])}))
    s = summarize(run)
    assert np.isnan(s["test_accuracy"]) and np.isnan(s["best_test_accuracy"]) and s["best_epoch"] is None
    assert s["test_loss"] == 0.5                                    # the last evaluated, not epoch 3's NaN
    assert (s["test_metrics"], s["test_metrics_epoch"]) == ({"loss": 0.5, "mae": 0.4}, 3)
    assert (s["scalars"], s["scalars_epoch"]) == ({"mae": 0.45}, 3)
    text = format_summary(run)
    assert "accuracy" not in text.split("\n", 1)[1]                 # (the header names the run's directory)
    assert "test metrics  mae 0.4 (epoch 3)" in text and "scalars       mae 0.45 (train, epoch 3)" in text
    assert "[mean squared error]" in text and "cross-entropy" not in text
    fig = plots.training_figure([run])
    assert fig.axes[0].get_ylabel() == "mean squared error"
    mae = fig.axes[1].get_lines()
    assert [ln.get_label() for ln in mae] == ["test mae"]
    np.testing.assert_array_equal(mae[0].get_xdata(), [1, 3])
    np.testing.assert_array_equal(mae[0].get_ydata(), [0.7, 0.4])


def test_the_loss_axis_names_the_recorded_loss(tmp_path):
    cli = load_run(write_synthetic(tmp_path / "cli", attrs={"loss": "cross-entropy"}))
    old = load_run(write_synthetic(tmp_path / "old"))                # a file from before the attribute
    assert plots.training_figure([cli]).axes[0].get_ylabel() == "cross-entropy loss (nats)"
    assert plots.training_figure([old]).axes[0].get_ylabel() == "loss"
    assert "[cross-entropy]" in format_summary(cli) and "[loss]" in format_summary(old)


def test_an_own_loop_plans_no_epochs_and_unrecorded_samples_are_not_zero(tmp_path):
    rows = synthetic_rows(2, 10, 3)
    rows["epochs"]["per_rank_samples"] = np.full((3, 2), -1)
    rows["epochs"]["per_rank_throughput"] = np.full((3, 2), np.nan)
    # an older own-loop file: no "api" key, its data names the loop, its epochs the TrainConfig default
    run = load_run(_write_raw(tmp_path / "r", rows, {
        "world_size": 2, "policy": "window",
        "config": json.dumps({"epochs": 10, "policy": "window", "window": 4, "data": "(your training loop)"}),
        "json_attrs": json.dumps(["config"])}))
    s = summarize(run)
    assert s["own_loop"] and s["epochs_planned"] is None and s["epochs"] == 3
    text = format_summary(run)
    assert "of 10" not in text and "epochs        3 (end_epoch() calls" in text
    assert "throughput    not recorded" in text and "samples/s" not in text
    assert "policy window (4 step() calls per rank per round)" in text


def test_sync_shows_no_anchor_or_hidden_share_and_cadence_no_window(tmp_path):
    # synthetic rounds: wait 61 ms > bridge 60 ms, so 1 - wait/bridge < 0
    sync = load_run(write_synthetic(tmp_path / "s", config={"policy": "sync", "window": 1}))
    s = summarize(sync)
    assert s["anchor"] is None and s["overlap"] is None
    body = format_summary(sync).split("\n", 1)[1]                     # (the header names the directory)
    assert "anchor" not in body and "hidden" not in body
    assert "policy sync (a round after every batch)" in format_summary(sync).splitlines()[0]
    cad = load_run(write_synthetic(tmp_path / "c", config={"policy": "cadence", "window": 1, "anchor": 8}))
    head = format_summary(cad).splitlines()[0]
    # issue 20 item 4: the registry's one wording, train.log's too (the overhead target and the guard added)
    assert "window" not in head and ("policy cadence (ElChe quotas per rank, anchor 8 to 1000, overhead target 0.05, "
                                     "divergence guard on)") in head
    assert summarize(cad)["anchor"] == (1, 1, 1) and summarize(cad)["overlap"] is None
    asy = load_run(write_synthetic(tmp_path / "a", config={"policy": "async", "window": 1}))
    assert summarize(asy)["overlap"] == 0.0                         # never negative
    assert "0 % of the round time hidden behind compute" in format_summary(asy)


def _hide_matplotlib(tmp_path) -> dict:
    """An environment whose ``import matplotlib`` fails, as after the README's quick start."""
    stub = tmp_path / "nompl"
    (stub / "matplotlib").mkdir(parents=True)
    (stub / "matplotlib" / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(stub), *sys.path])}


def test_report_without_matplotlib_is_a_summary_and_exit_0(tmp_path):
    run_dir = write_synthetic(tmp_path / "r")
    env = _hide_matplotlib(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "flodl_mpi", "report", str(run_dir)], capture_output=True,
                          text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"run {run_dir}") and "test accuracy" in proc.stdout
    assert proc.stdout.splitlines()[-1] == ("plots: not drawn: they need matplotlib (pip install 'flodl-mpi[plot]'); "
                                            "--no-plots skips them")
    assert proc.stderr == "" and not (run_dir / "plots").exists()
    asked = subprocess.run([sys.executable, "-m", "flodl_mpi", "report", str(run_dir), "--out", str(tmp_path / "p")],
                           capture_output=True, text=True, env=env, timeout=120, check=False)
    assert asked.returncode == 2 and "--out" in asked.stderr and "pip install 'flodl-mpi[plot]'" in asked.stderr


def test_comparison_of_api_records_shows_classes_and_not_applicable(tmp_path):
    fit = {"api": "fit", "epochs": 3, "lr": 0.001, "loss": "mean squared error",
           "model": {"class": "torch.nn.modules.linear:Linear", "parameters": 5},
           "optimizer": {"class": "torch.optim.adamw:AdamW", "param_groups": [{"params": 2, "lr": 0.02}]},
           "not_applicable": ["momentum"]}
    own = {"api": "Averager", "loss": "loss given to step()",
           "model": {"class": "torch.nn.modules.linear:Linear", "parameters": 5},
           "optimizer": {"class": "torch.optim.sgd:SGD", "param_groups": [{"params": 2, "lr": 0.05}]},
           "not_applicable": ["epochs", "lr", "momentum"]}
    a = load_run(write_synthetic(tmp_path / "A", config=fit))
    b = load_run(write_synthetic(tmp_path / "B", config=own))
    differ = differing_options([a, b])
    assert differ["optimizer"] == ["AdamW (lr 0.02)", "SGD (lr 0.05)"]
    assert differ["epochs"] == [3, "n/a"] and differ["lr"] == [0.001, "n/a"] and "model" not in differ
    first = format_comparison([a, b]).splitlines()[0]
    assert "--optimizer 'AdamW (lr 0.02)' vs 'SGD (lr 0.05)'" in first and ": api 'fit' vs 'Averager';" in first
    assert "not_applicable" not in first and "momentum" not in first


def test_the_summary_tells_the_wall_clock_rate_beside_the_compute_throughput(tmp_path):
    """Issue 7: "throughput" was samples / (compute + data wait) unlabelled: two ranks of the same wall time
    read 2x apart. Per rank and epoch: 320 samples in 1000 ms of wall time = 320 samples/s."""
    run = load_run(write_synthetic(tmp_path / "r", world_size=2, rounds=20, epochs=3))
    s = summarize(run)
    np.testing.assert_allclose(s["wall_throughput"], [320.0, 320.0])
    np.testing.assert_allclose(s["throughput"], [100.0, 200.0])
    text = format_summary(run)
    assert ("throughput    r0 320  r1 320 samples/s of epoch wall time; compute r0 100  r1 200 samples/s of "
            "compute + data wait (means over epochs)") in text


def test_the_comparison_sums_both_throughputs_by_name(tmp_path):
    from flodl_mpi.cli.report import format_comparison

    runs = [load_run(write_synthetic(tmp_path / name, world_size=2, rounds=20, epochs=3)) for name in ("a", "b")]
    lines = format_comparison(runs).splitlines()
    wall = next(line for line in lines if line.startswith("throughput (samples/s of wall time, sum)"))
    compute = next(line for line in lines if line.startswith("compute throughput (samples/s of compute + data wait"))
    assert wall.split()[-2:] == ["640", "640"] and compute.split()[-2:] == ["300", "300"]  # 2 x 320; 100 + 200
