"""flodl-mpi report's figures say what they count (issue 26 item 8).

A hand-built metrics.h5 whose numbers are worked out by hand in the comments: the time
breakdown's parts add up to the wall time and the summary's averaging share counts every
averaging part; the batch-share plot and the summary line both show batches done (the
policy's allocation drawn apart, dotted); idle ranks' divergence and epochs' last rounds
are marked; the cadence figure only for policies with quotas; several runs on an epoch
axis; stops, resumes and world-size changes marked. The figures are read as matplotlib
objects (their lines' data, gids and labels), not as pixels.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from flodl_mpi.outputs.metrics import MetricsFile
from flodl_mpi.cli.report import format_summary, summarize
from flodl_mpi.cli.run_events import round_epochs
from flodl_mpi.outputs.run_reader import load_run
from flodl_mpi.cli.time_budget import NAMES, PARTS, rank_seconds, time_parts
from tests._runs import session_run_a, synthetic_rows
from tests.cli.test_report_world_change import _write_resumed

plots = pytest.importorskip("flodl_mpi.cli.plots", reason="plots need matplotlib (the plot extra)")


def _write(run_dir: Path, policy: str = "sync", rounds: int = 4, wait: float = 26.0) -> Path:
    """W = 2, 2 epochs of ``rounds / 2`` rounds; every round per rank: snapshot 2 ms, control 3 (r0) / 5 (r1),
    pack 4, allreduce 10, unpack 4, outer 0, bridge 25 (r0) / 27 (r1), wait ``wait``, adoption 1;
    rounds end at 1, 2, ... s, the epochs at 2.5 and 5 s; per epoch and rank 2000 ms of epoch time,
    compute 1200 (r0) / 1100 (r1), data 100; batches done 3 + 1, then 2 + 2; allocation 1/2 each."""
    R, E = rounds, 2
    rows = synthetic_rows(2, R, E)
    per_rank = lambda a, b: np.tile([a, b], (R, 1)).astype(np.float64)  # noqa: E731
    rows["rounds"].update(
        time_s=np.arange(1, R + 1) * (4.0 / R), snapshot_ms=per_rank(2, 2), control_ms=per_rank(3, 5),
        pack_ms=per_rank(4, 4), allreduce_ms=per_rank(10, 10), unpack_ms=per_rank(4, 4), outer_ms=per_rank(0, 0),
        bridge_ms=per_rank(25, 27), wait_ms=per_rank(wait, wait), adopt_ms=per_rank(1, 1),
        window=np.ones((R, 2), np.int64), mass=np.ones((R, 2)), guard=np.zeros(R, np.int8))
    rows["rounds"]["mass"][R // 2 - 1, 1] = 0.0       # rank 1 idle in epoch 1's last round
    rows["rounds"]["divergence"] = np.tile([0.01, 0.02], (R, 1))
    rows["rounds"]["divergence"][R // 2 - 1, 1] = 0.5  # the idle rank's "spike"
    rows["epochs"].update(
        time_s=np.array([2.5, 5.0]), rounds=np.array([R // 2, R]), batches=np.array([R, R]),
        per_rank_epoch_ms=np.full((E, 2), 2000.0), per_rank_compute_ms=np.tile([1200.0, 1100.0], (E, 1)),
        per_rank_data_ms=np.full((E, 2), 100.0), per_rank_batches=np.array([[3, 1], [2, 2]]),
        per_rank_batch_share=np.full((E, 2), 0.5))
    run_dir.mkdir(parents=True)
    cfg = {"epochs": E, "policy": policy, "window": 1, "gamma": 1.0}
    with MetricsFile(run_dir / "metrics.h5", 2, {"config": cfg, "policy": policy}) as m:
        for table, cols in rows.items():
            m.append(table, cols)
    (run_dir / "config.json").write_text(json.dumps(cfg))
    return run_dir


# ---------------------------------------------------------------- (a) the time breakdown


def test_time_parts_add_up_to_the_wall_time_and_averaging_counts_every_part(tmp_path):
    """issue 26 item 8 (a): every bucket named and defined; they add up to the rank's wall time;
    the summary's averaging share is snapshot + the round's phases + hand-off + adoption."""
    run = load_run(_write(tmp_path / "r"))
    parts = time_parts(run)
    # By hand, rank 0 (ms): compute 2400, data 200, snapshot 4 * 2, control 4 * 3, pack 16, allreduce 40,
    # unpack 16, outer 0, the rest of the round 4 * (25 - 21) = 16, hand-off 4 * (26 - 25) = 4, async wait 0,
    # adoption 4; outside the epochs 5000 - 4000 = 1000; the rest of the loop 4000 - 2716 = 1284.
    # Rank 1: control 4 * 5 = 20, the rest 4 * (27 - 23) = 16, hand-off 0 (the wait 26 < bridge 27),
    # compute 2200; the rest of the loop 4000 - 2520 = 1480.
    want = np.array([[2400, 200, 8, 12, 16, 40, 16, 0, 16, 4, 0, 4, 1000, 1284],
                     [2200, 200, 8, 20, 16, 40, 16, 0, 16, 0, 0, 4, 1000, 1480]]) / 1e3
    assert NAMES == ("compute", "data wait", "snapshot", "control gather", "pack", "allreduce", "unpack",
                     "outer step", "rest of the round", "hand-off", "round wait (async)", "adoption",
                     "outside the epochs", "rest of the loop")
    np.testing.assert_allclose(parts, want, rtol=0, atol=1e-12)
    np.testing.assert_allclose(parts.sum(axis=1), rank_seconds(run), rtol=1e-12)   # 5 s each
    s = summarize(run)
    # averaging: rank 0 116 ms, rank 1 120 ms of 5 s (pack + allreduce + unpack alone: 72 ms, 1.44 %)
    np.testing.assert_allclose(s["averaging_pct"], [2.32, 2.4], rtol=1e-12)
    np.testing.assert_allclose(s["time_pct"].sum(axis=1), [100.0, 100.0], rtol=1e-12)
    text = format_summary(run)
    assert "averaging     r0 2.3  r1 2.4 % of wall time (snapshot, the round, adoption)" in text
    # mean rank: compute 46.0, data 4.0, averaging 2.36, outside 20.0, the rest of the loop 27.64
    assert ("wall time     compute 46.0, data wait 4.0, averaging 2.4, outside the epochs 20.0, "
            "rest of the loop 27.6 % (mean rank; adds up to 100)") in text
    # The figure: one bar segment per part shown, widths = the parts, each part defined under the axes.
    fig = plots.time_figure([run])
    ax = fig.axes[0]
    shown = [c.get_label() for c in ax.containers]
    assert shown == [n for n in NAMES if n not in ("outer step", "round wait (async)")]  # 0 in every bar
    for c in ax.containers:
        j = NAMES.index(c.get_label())
        assert [bar.get_width() for bar in c] == pytest.approx(parts[:, j].tolist())
    for name, definition in PARTS:
        assert (f"{name}: {definition}" in ax.get_xlabel()) == (name in shown)
    assert "add up to its wall time" in ax.get_title()


def test_async_counts_the_wait_compute_did_not_hide(tmp_path):
    """issue 26 item 8 (a): under async the round's phases ran beside compute; the training thread's
    share is its wait (6 ms a round here), not the bridge's 25 ms."""
    run = load_run(_write(tmp_path / "r", policy="async", wait=6.0))
    parts = time_parts(run)
    j = NAMES.index
    np.testing.assert_allclose(parts[:, j("round wait (async)")], [0.024, 0.024])
    for name in ("control gather", "pack", "allreduce", "unpack", "rest of the round", "hand-off"):
        assert parts[:, j(name)].tolist() == [0.0, 0.0], name
    np.testing.assert_allclose(parts.sum(axis=1), [5.0, 5.0], rtol=1e-12)
    np.testing.assert_allclose(summarize(run)["averaging_pct"], [0.72, 0.72], rtol=1e-12)  # (8 + 24 + 4) / 5000


@pytest.mark.slow
def test_a_real_run_records_snapshot_and_adoption_and_adds_up(tmp_path_factory):
    """issue 26 item 8 (a): the trainer records each round's snapshot and adoption times, and a real
    run's parts add up to its wall time."""
    run = load_run(session_run_a(tmp_path_factory))
    for col in ("snapshot_ms", "adopt_ms"):
        values = run.per_rank("rounds", col)
        assert values is not None and np.isfinite(values[1:]).all() and (values[1:] > 0).all(), col
    parts = time_parts(run)
    np.testing.assert_allclose(parts.sum(axis=1), rank_seconds(run), rtol=1e-9)
    assert (parts[:, :-1] >= 0).all()


# ---------------------------------------------------------------- (b) batches done vs allocation


def test_batch_share_is_batches_done_in_the_plot_and_the_summary(tmp_path):
    """issue 26 item 8 (b): one name, one quantity: the share of batches done (3 + 1, then 2 + 2);
    the policy's allocation (1/2 each) is drawn apart, dotted, under its own name."""
    run = load_run(_write(tmp_path / "r"))
    np.testing.assert_allclose(summarize(run)["batch_share"], [5 / 8, 3 / 8])
    assert "batches done  r0 0.625  r1 0.375 (share of all batches done)" in format_summary(run)
    ax = plots.ranks_figure([run]).axes[1]
    done = {ln.get_label(): ln.get_ydata().tolist() for ln in ax.get_lines() if ln.get_gid() == "batches done"}
    alloc = {ln.get_label(): ln.get_ydata().tolist() for ln in ax.get_lines() if ln.get_gid() == "allocation"}
    assert done == {"rank 0: done": [75.0, 50.0], "rank 1: done": [25.0, 50.0]}
    assert alloc == {"rank 0: policy's allocation": [50.0, 50.0], "rank 1: policy's allocation": [50.0, 50.0]}
    assert all(ln.get_linestyle() == ":" for ln in ax.get_lines() if ln.get_gid() == "allocation")
    assert "batches done" in ax.get_title() and "allocation" in ax.get_title()
    # TensorBoard's tags: the same two quantities under the same two names
    from flodl_mpi.cli.tensorboard_export import scalars

    tags = scalars(run)
    assert tags["epoch/batches_done_rank0"][1].tolist() == [0.75, 0.5]
    assert tags["epoch/allocation_rank1"][1].tolist() == [0.5, 0.5]
    assert not any("batch_share" in tag for tag in tags)


# ---------------------------------------------------------------- (c) idle ranks and epochs' ends


def test_idle_divergence_and_epoch_ends_are_marked(tmp_path):
    """issue 26 item 8 (c): rank 1 idle (mass 0) in round 1, epoch 1's last: its 0.5 is an 'x' of its own,
    out of its line; rounds 1 and 3 (the epochs' last) are dotted vertical lines; the title says so."""
    run = load_run(_write(tmp_path / "r"))
    ax = plots.divergence_figure([run]).axes[0]
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    r1 = lines["rank 1"].get_ydata()
    assert np.isnan(r1[1]) and r1[[0, 2, 3]].tolist() == [0.02] * 3
    idle = [ln for ln in ax.get_lines() if ln.get_gid() == "idle"]
    assert len(idle) == 1 and idle[0].get_label() == "rank 1 idle (mass 0)"
    assert idle[0].get_xdata().tolist() == [1] and idle[0].get_ydata().tolist() == [0.5]
    ends = [ln.get_xdata()[0] for ln in ax.get_lines() if ln.get_gid() == "epoch end"]
    assert ends == [1, 3]
    assert "idle" in ax.get_title() and "epoch's last round" in ax.get_title()


# ---------------------------------------------------------------- (d) the cadence figure


def test_cadence_figure_only_for_policies_with_quotas(tmp_path):
    """issue 26 item 8 (d): sync and window plan no quotas: no cadence figure, one line saying why;
    a cadence run beside a sync run: drawn for the cadence run only, the other named as left out."""
    sync = load_run(_write(tmp_path / "s"))
    window = load_run(_write(tmp_path / "w", policy="window"))
    cad = load_run(_write(tmp_path / "c", policy="cadence"))
    for runs in ([sync], [window]):
        assert plots.cadence_figure(runs) is None
    assert plots.not_drawn([window]) == ["cadence.png: not drawn: policy window plans no quotas per rank (only "
                                         "cadence and async do; a fixed policy's window is its --window option)"]
    assert plots.not_drawn([cad]) == []
    fig = plots.cadence_figure([cad, sync])
    labels = [ln.get_label() for ln in fig.axes[0].get_lines()]
    assert labels == ["c: anchor", "c: rank 0 window", "c: rank 1 window"]
    assert plots.not_drawn([cad, sync])[0].startswith("cadence.png: left out: s (policy sync) plans no quotas")


# ---------------------------------------------------------------- (e) A/B on an epoch axis


def test_comparison_plots_share_an_epoch_axis(tmp_path):
    """issue 26 item 8 (e): 4 rounds and 8 rounds in 2 epochs each: on an epoch axis both end at epoch 2
    (each round at the share of its epoch's batches done: 2 of 4, then of 8, per round)."""
    a = load_run(_write(tmp_path / "a", rounds=4))
    b = load_run(_write(tmp_path / "b", rounds=8))
    for fig in (plots.divergence_figure([a, b]), plots.round_times_figure([a, b])):
        ax = fig.axes[0]
        assert ax.get_xlabel().startswith("epoch")
        xs = {ln.get_label(): ln.get_xdata().tolist() for ln in ax.get_lines() if ln.get_label().endswith("rank 0")
              or ln.get_label().endswith("allreduce")}
        for label, x in xs.items():
            want = [0.5, 1.0, 1.5, 2.0] if label.startswith("a:") else [0.25 * k for k in range(1, 9)]
            assert x == pytest.approx(want), label
        assert len(xs) == 2
    # one run alone keeps its rounds
    assert plots.divergence_figure([a]).axes[0].get_xlabel() == "round"


# ---------------------------------------------------------------- (f) stops, resumes, world-size changes


def test_stops_resumes_and_world_changes_are_marked(tmp_path):
    """issue 26 item 8 (f): a stop after round 10 (train.log), the resume there at 1 rank (world_size_history)
    and a later resume at the same size (config-resume-r000012.json) are vertical lines on every time line:
    at round 9.5 / 11.5 on the round axis, at epoch 4 (the epoch that ended on round 10) on the epoch axis."""
    run_dir = _write_resumed(tmp_path / "r", [(2, 10, 4), (1, 4, 2)])
    (run_dir / "train.log").write_text("10:00:01 stopped on request in epoch 5 at round 10; its checkpoint is "
                                       "queued (the final save writes it)\n")
    for n in (10, 12):
        (run_dir / f"config-resume-r{n:06d}.json").write_text("{}")
    run = load_run(run_dir)

    def marks(ax):
        return sorted((ln.get_gid(), round(float(ln.get_xdata()[0]), 6)) for ln in ax.get_lines()
                      if str(ln.get_gid()).startswith("event:"))

    for fig in (plots.divergence_figure([run]), plots.round_times_figure([run])):
        assert marks(fig.axes[0]) == [("event:resume", 11.5), ("event:stop", 9.5), ("event:world", 9.5)]
    x12 = float(np.round(round_epochs(run)[11], 6))
    for fig in (plots.training_figure([run]), plots.ranks_figure([run])):
        for ax in fig.axes:
            assert marks(ax) == sorted([("event:resume", x12), ("event:stop", 4.0), ("event:world", 4.0)])
    world = next(ln for ln in plots.divergence_figure([run]).axes[0].get_lines() if ln.get_gid() == "event:world")
    assert world.event_label == "resume at 1 rank (was 2; round 10)"
