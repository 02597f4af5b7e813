"""flodl-mpi report after a resume at another world size: the header gives the sizes, each rank's
figures come only from the rows whose world had it (the NaN / -1 padding of metrics.h5 left out),
and the plots and TensorBoard tags do the same.

The expected values are computed here from the file with h5py and numpy, by another route than
the report's: which ranks a row had comes from ``world_size_history`` (rounds by row index,
epochs by the round their ``rounds`` count ends on), not from the padding the report reads.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from flodl_mpi.outputs.metrics import MetricsFile, table_schema
from flodl_mpi.cli.report import format_comparison, format_summary, summarize
from flodl_mpi.outputs.run_reader import load_run
from tests.conftest import MPIEXEC

#: The bridge's named phases of a round (a blocking policy's; issue 26 item 8: averaging counts all of a round).
PHASES = ("control_ms", "pack_ms", "allreduce_ms", "unpack_ms", "outer_ms")


# ---------------------------------------------------------------- an independent reading of the file


def _expected(path: Path) -> dict:
    """The report's per-rank figures, from the file by loops over rows and stretches."""
    with h5py.File(path, "r") as f:
        history = json.loads(f.attrs["world_size_history"])
        rounds = {k: f["rounds"][k][()] for k in f["rounds"]}
        epochs = {k: f["epochs"][k][()] for k in f["epochs"]}
    width = max(w for _, w in history)

    def world_of_round(i: int) -> int:
        return [w for first, w in history if first <= i][-1]

    n_rounds, n_epochs = len(rounds["round"]), len(epochs["epoch"])
    w_round = [world_of_round(i) for i in range(n_rounds)]
    w_epoch = [world_of_round(max(int(epochs["rounds"][e]) - 1, 0)) for e in range(n_epochs)]
    # stretch boundaries: a resumed stretch starts at the latest time of the rows before it
    times = []
    for k, (first, _) in enumerate(history):
        if k == 0:
            times.append(0.0)
            continue
        before = [float(rounds["time_s"][i]) for i in range(first)]
        before += [float(epochs["time_s"][e]) for e in range(n_epochs) if epochs["rounds"][e] <= first]
        times.append(max(before, default=0.0))
    end = max(float(rounds["time_s"][-1]), float(epochs["time_s"][-1]))
    times.append(end)
    out = {"averaging_pct": [], "throughput": [], "wall_throughput": [], "batch_share": [], "width": width}
    total_batches = sum(int(epochs["per_rank_batches"][e, r]) for e in range(n_epochs) for r in range(w_epoch[e]))
    for r in range(width):
        spent = 0.0
        for i in (i for i in range(n_rounds) if r < w_round[i]):  # the rows whose world had the rank
            named = sum(float(rounds[p][i, r]) for p in PHASES)
            bridge, wait = float(rounds["bridge_ms"][i, r]), float(rounds["wait_ms"][i, r])
            spent += (float(rounds["snapshot_ms"][i, r]) + named + max(bridge - named, 0.0) + max(wait - bridge, 0.0)
                      + float(rounds["adopt_ms"][i, r]))
        spent /= 1e3
        in_run = sum(times[k + 1] - times[k] for k, (_, w) in enumerate(history) if r < w)
        out["averaging_pct"].append(100.0 * spent / in_run)
        mine = [e for e in range(n_epochs) if r < w_epoch[e]]
        out["throughput"].append(np.mean([epochs["per_rank_throughput"][e, r] for e in mine]))
        out["wall_throughput"].append(np.mean([1e3 * epochs["per_rank_samples"][e, r] / epochs["per_rank_epoch_ms"][e, r]
                                               for e in mine]))
        out["batch_share"].append(sum(int(epochs["per_rank_batches"][e, r]) for e in mine) / total_batches)
    out["throughput_total"] = np.mean([sum(epochs["per_rank_throughput"][e, :w_epoch[e]]) for e in range(n_epochs)])
    out["wall_throughput_total"] = np.mean([
        sum(1e3 * epochs["per_rank_samples"][e, r] / epochs["per_rank_epoch_ms"][e, r] for r in range(w_epoch[e]))
        for e in range(n_epochs)])
    out["w_round"], out["w_epoch"], out["history"] = w_round, w_epoch, history
    return out


def _check_summary(run_dir: Path, header: str) -> dict:
    run = load_run(run_dir)
    want = _expected(run_dir / "metrics.h5")
    s = summarize(run)
    for key in ("averaging_pct", "throughput", "wall_throughput", "batch_share"):
        assert s[key] is not None and len(s[key]) == want["width"], key
        np.testing.assert_allclose(s[key], want[key], rtol=1e-9, err_msg=key)
    for key in ("throughput_total", "wall_throughput_total"):
        assert s[key] == pytest.approx(want[key], rel=1e-9), key
    text = format_summary(run)
    assert f"({header}, policy" in text.splitlines()[0], text
    assert "not recorded" not in text and "1 ranks" not in text
    assert "averaging     " + "  ".join(f"r{r} {v:.1f}" for r, v in enumerate(want["averaging_pct"])) in text
    assert "throughput    " + "  ".join(f"r{r} {v:.0f}" for r, v in enumerate(want["wall_throughput"])) in text
    assert "compute " + "  ".join(f"r{r} {v:.0f}" for r, v in enumerate(want["throughput"])) in text
    return want


# ---------------------------------------------------------------- a file written by the project's own writer


def _rows(world: int, first_round: int, n_rounds: int, first_epoch: int, n_epochs: int, t0: float,
          rng: np.random.Generator) -> dict:
    """Every column of every table for one stretch: distinct random per-rank values."""
    schema = table_schema(world)
    R, E, W = n_rounds, n_epochs, world
    rows: dict[str, dict] = {"rounds": {}, "epochs": {}, "batches": {}}
    for name, (dtype, shape) in schema["rounds"].items():
        size = (R, *shape)
        rows["rounds"][name] = (rng.integers(0, 5, size) if dtype.kind in "iu" else
                                rng.random(size) < 0.2 if dtype.kind == "b" else rng.uniform(0.1, 9.0, size))
    rows["rounds"]["round"] = first_round + np.arange(R)
    rows["rounds"]["version"] = first_round + np.arange(R) + 1
    rows["rounds"]["time_s"] = t0 + 0.5 * (np.arange(R) + 1)
    rows["rounds"]["guard"] = np.zeros(R, np.int8)
    for name, (dtype, shape) in schema["epochs"].items():
        size = (E, *shape)
        rows["epochs"][name] = rng.integers(1, 60, size) if dtype.kind in "iu" else rng.uniform(1.0, 900.0, size)
    rows["epochs"]["epoch"] = first_epoch + np.arange(E) + 1
    ends = np.linspace(0, R, E + 1).astype(int)[1:]  # each epoch ends on a round of its stretch
    rows["epochs"]["rounds"] = first_round + ends
    rows["epochs"]["time_s"] = t0 + 0.5 * ends + 0.1  # evaluated just after its last round
    rows["epochs"]["test_accuracy"] = rng.uniform(0.5, 1.0, E)
    rows["batches"] = {c: np.zeros((1,), dtype=dt) for c, (dt, _) in table_schema(W)["batches"].items()}
    return rows


def _write_resumed(run_dir: Path, stretches: list[tuple[int, int, int]], seed: int = 0,
                   policy: str = "sync") -> Path:
    """metrics.h5 of a run at ``stretches`` = ``[(world size, rounds, epochs), ...]``, each one
    after the first written as ``--resume`` does (MetricsFile with ``keep_rows``: the real widening)."""
    rng = np.random.default_rng(seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = {"epochs": sum(e for _, _, e in stretches), "policy": policy, "window": 1, "gamma": 1.0}
    kept = {"rounds": 0, "epochs": 0, "batches": 0, "scalars": 0}
    t0 = 0.0
    for k, (world, n_rounds, n_epochs) in enumerate(stretches):
        rows = _rows(world, kept["rounds"], n_rounds, kept["epochs"], n_epochs, t0, rng)
        with MetricsFile(run_dir / "metrics.h5", world, {"config": cfg, "policy": policy},
                         keep_rows=dict(kept) if k else None) as m:
            for table, cols in rows.items():
                m.append(table, cols)
        kept = {"rounds": kept["rounds"] + n_rounds, "epochs": kept["epochs"] + n_epochs,
                "batches": kept["batches"] + 1, "scalars": 0}
        t0 = float(rows["rounds"]["time_s"][-1]) + 7.0  # the resumed job starts later, its clock where it left
    (run_dir / "config.json").write_text(json.dumps(cfg))
    return run_dir


@pytest.mark.parametrize("stretches, header", [
    ([(2, 10, 4), (1, 4, 2)], "2 ranks, then 1 from round 10 (resumed)"),
    ([(2, 9, 3), (3, 12, 2)], "2 ranks, then 3 from round 9 (resumed)"),
    ([(3, 6, 2), (1, 5, 2), (2, 8, 3)], "3 ranks, then 1 from round 6 (resumed), then 2 from round 11 (resumed)"),
])
def test_summary_reads_each_rank_from_the_rows_its_world_had(tmp_path, stretches, header):
    run_dir = _write_resumed(tmp_path / "r", stretches)
    want = _check_summary(run_dir, header)
    assert len(want["history"]) == len(stretches)  # the writer recorded each change
    # the padding is really there: the old code's means ran over it
    with h5py.File(run_dir / "metrics.h5", "r") as f:
        assert (f["epochs/per_rank_batches"][()] == -1).any() and np.isnan(f["rounds/pack_ms"][()]).any()


def test_one_world_reads_as_before_and_says_1_rank(tmp_path):
    run_dir = _write_resumed(tmp_path / "r", [(1, 6, 2)])
    want = _check_summary(run_dir, "1 rank")
    assert want["width"] == 1
    run_dir = _write_resumed(tmp_path / "r2", [(2, 6, 2), (2, 4, 1)])  # a resume at the same size: no change
    _check_summary(run_dir, "2 ranks")


def test_comparison_names_the_world_sizes_and_sums_each_epochs_ranks(tmp_path):
    a = _write_resumed(tmp_path / "a", [(2, 10, 4), (1, 4, 2)])
    b = _write_resumed(tmp_path / "b", [(2, 10, 4)], seed=1)
    runs = [load_run(a), load_run(b)]
    text = format_comparison(runs)
    assert "world size (mpiexec -n) 2 then 1 vs 2" in text
    want = _expected(a / "metrics.h5")
    row = next(line for line in text.splitlines() if line.startswith("compute throughput"))
    assert row.split()[-2] == f"{want['throughput_total']:.0f}"
    row = next(line for line in text.splitlines() if line.startswith("averaging (% wall"))
    assert row.split()[-2] == f"{np.mean(want['averaging_pct']):.1f}"


def test_plots_and_tensorboard_tags_leave_the_padding_out(tmp_path):
    plots = pytest.importorskip("flodl_mpi.cli.plots", reason="plots need matplotlib (the plot extra)")
    from flodl_mpi.cli.tensorboard_export import scalars

    run_dir = _write_resumed(tmp_path / "r", [(2, 9, 3), (3, 12, 2)], policy="cadence")  # a cadence figure
    run = load_run(run_dir)
    want = _expected(run_dir / "metrics.h5")
    with h5py.File(run_dir / "metrics.h5", "r") as f:
        pack, window = f["rounds/pack_ms"][()], f["rounds/window"][()]
        div = f["rounds/divergence"][()]
    mean_pack = [np.mean(pack[i, :w]) for i, w in enumerate(want["w_round"])]

    fig = plots.round_times_figure([run])  # 21 rounds: no smoothing
    pack_line = next(line for line in fig.axes[0].lines if line.get_label() == "pack")
    np.testing.assert_allclose(pack_line.get_ydata(), mean_pack, rtol=1e-12)  # the old mean: NaN from round 0 on

    fig = plots.divergence_figure([run])
    assert fig.axes[0].get_yscale() == "log"  # every divergence written is > 0; the padding is not a value
    fig = plots.cadence_figure([run])
    rank2 = next(line for line in fig.axes[0].lines if line.get_label() == "rank 2 window")
    y = np.asarray(rank2.get_ydata(), dtype=float)
    assert np.isnan(y[:9]).all() and np.array_equal(y[9:], window[9:, 2])  # a gap, not -1 batches

    tags = scalars(run)
    np.testing.assert_allclose(tags["round/pack_ms"][1], mean_pack, rtol=1e-12)
    steps, values = tags["round/divergence_rank2"]
    np.testing.assert_array_equal(steps, np.arange(9, 21))
    np.testing.assert_array_equal(values, div[9:, 2])
    assert all(np.isfinite(v).all() for _, v in (tags[f"epoch/throughput_rank{r}"] for r in range(3)))


# ---------------------------------------------------------------- a real run: 1 rank, then 3, then 1


HOOKED = str(Path(__file__).parents[1] / "hooked_flodl.py")


@pytest.mark.slow
def test_report_of_a_real_run_resumed_at_3_then_1_rank(tmp_path):
    """A real run widened and narrowed by resumes: 1 rank, then 3 (a real launch: the world-size change the
    report must read), then 1 again; the report's figures per rank are those of the rows whose world had it.

    Was 2 ranks, then 3, then 1, each a launch. The stretches at a world of 1 now run in a forked child
    (``fork_flodl``, its ``--stop-at-round`` hook installed there): a resume does not ask how the world of 1
    was started, and the file still widens (1 to 3) and narrows (3 to 1), so ranks 1 and 2 have rows in the
    middle stretch only. The rounds: 1437 samples in batches of 32 are 45 batches an epoch, one round each at
    a world of 1 (15 at 3 ranks): the first stretch stops in epoch 1 (round 30), the second after the rest of
    epoch 1 and part of epoch 2 (round 45), the third finishes epoch 3."""
    import subprocess

    from flodl_mpi.errors import EXIT_STOPPED
    from tests.conftest import fork_flodl, launch_argv, launch_env

    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    run_dir = tmp_path / "r"
    common = ("train", "--epochs", "3", "--run-dir", str(run_dir))

    first = fork_flodl(*common, hooks=("--stop-at-round", "30"), timeout=300)
    assert first.returncode == EXIT_STOPPED, first.stdout[-2000:] + first.stderr[-3000:]
    proc = subprocess.run(launch_argv(3, sys.executable, HOOKED, "--stop-at-round", "45", "--", *common, "--resume"),
                          env=launch_env(), capture_output=True, text=True, timeout=300, check=False,
                          cwd=str(Path(__file__).parents[2]))
    assert proc.returncode == EXIT_STOPPED, proc.stdout[-2000:] + proc.stderr[-3000:]
    done = fork_flodl(*common, "--resume", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    want = _check_summary(run_dir, "1 rank, then 3 from round 30 (resumed), then 1 from round 45 (resumed)")
    assert want["history"] == [[0, 1], [30, 3], [45, 1]]
    out = subprocess.run([sys.executable, "-m", "flodl_mpi", "report", "--no-plots", str(run_dir)],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0 and "not recorded" not in out.stdout and "throughput    -" not in out.stdout, out.stdout


def test_smoothed_round_times_survive_the_padding(tmp_path):
    plots = pytest.importorskip("flodl_mpi.cli.plots", reason="plots need matplotlib (the plot extra)")
    run_dir = _write_resumed(tmp_path / "r", [(2, 150, 3), (3, 100, 2)])  # 250 rounds: a moving average of 2
    with h5py.File(run_dir / "metrics.h5", "r") as f:
        unpack = f["rounds/unpack_ms"][()]
    mean = np.array([np.mean(unpack[i, :2 if i < 150 else 3]) for i in range(250)])
    want = np.concatenate([mean[:1], (mean[1:] + mean[:-1]) / 2])  # the first point: a shorter mean
    fig = plots.round_times_figure([load_run(run_dir)])
    line = next(line for line in fig.axes[0].lines if line.get_label() == "unpack")
    np.testing.assert_allclose(line.get_ydata(), want, rtol=1e-12)  # the old one: NaN from the first padded row on


def test_tensorboard_epoch_steps_are_the_files_epoch_numbers(tmp_path):
    from flodl_mpi.cli.tensorboard_export import scalars

    run_dir = _write_resumed(tmp_path / "r", [(2, 9, 3), (3, 12, 2)])
    steps, _ = scalars(load_run(run_dir))["epoch/test_accuracy"]
    np.testing.assert_array_equal(steps, [1, 2, 3, 4, 5])  # as train.log's "epoch 1/5" (was 2..6)
