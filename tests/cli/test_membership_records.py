"""The membership ledger from the recorder to the report (SPEC §9, docs/elastic-records.rst), in one process.

A run of 3 ranks is recorded as the bridge would (the recorder over rank 0's writer thread): 6 rounds
and an epoch, then id 1 dies in round 6 (4 steps lost; the round is abandoned), rounds 6-8 at 2 ranks, then rank 0 (id 0) dies
too and the lowest survivor (id 2) takes metrics.h5 over, widened for a newcomer (id 3) that joins at
round 9 with it; 3 more rounds and an epoch. Every expected value is written here by hand from that story.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from flodl_mpi.cli import plots
from flodl_mpi.cli.inspect_cmd import describe_metrics
from flodl_mpi.cli.report import describe_world, format_summary
from flodl_mpi.cli.run_events import events
from flodl_mpi.cli.time_budget import rank_seconds
from flodl_mpi.outputs.metrics import MetricsWriter, table_schema
from flodl_mpi.outputs.recorder import COHORT_ACKS, Recorder
from flodl_mpi.outputs.run_reader import load_run
from flodl_mpi.policy.replay import ReplayError, read_recorded_plan
from flodl_mpi.protocol.control import ACK
from flodl_mpi.protocol.epoch_report import EpochSummary
from flodl_mpi.protocol.membership import Membership, MembershipChange

SHRINK = MembershipChange(
    round=6, time_s=6.5, left=(1,), joined=(), steps_lost=(4,), world_size=2, detection_ms=150.0, recovery_ms=50.0
)
REGROW = MembershipChange(
    round=9, time_s=10.0, left=(0,), joined=(3,), steps_lost=(2,), world_size=2, detection_ms=50.0, recovery_ms=1450.0
)


def _round(rec: Recorder, n: int, members: Membership) -> None:
    """Round ``n`` as the bridge records it: each per-rank value is 10 * n + the rank's stable id."""
    ids = np.asarray(members.ids)
    value = 10.0 * n + ids
    record, acks = {}, {}
    for name, (dtype, shape) in table_schema(1)["rounds"].items():
        if name == "guard":
            continue
        v = value.astype(dtype) if shape else np.asarray(n, dtype)
        if name in ACK.names:
            acks[name] = value.astype(dtype) if shape or name in COHORT_ACKS else v  # a cohort ack: per rank too
        else:
            record[name] = v
    record["time_s"] = float(n)
    rec.round(**record)
    rec.acks(acks, 0)


def _epoch(rec: Recorder, epoch: int, rounds: int, members: Membership, time_s: float) -> None:
    w = members.world_size
    per = np.full(w, 7.0)
    rec.epoch(
        EpochSummary(
            epoch=epoch,
            rounds=rounds,
            avg_loss=0.5,
            epoch_ms=1000.0,
            batches=30,
            per_rank_loss=per,
            per_rank_batches=np.full(w, 30 // w),
            per_rank_samples=np.full(w, 96),
            per_rank_throughput=per,
            per_rank_batch_share=np.full(w, 1 / w),
            per_rank_epoch_ms=per,
            per_rank_compute_ms=per,
            per_rank_data_ms=per,
            per_rank_share_complete_ms=per,
            test_loss=0.4,
            test_accuracy=0.9,
            test_count=100,
        ),
        np.array([[r, epoch + 1, 1, 5.0, 1.0, 0.5, 0.1, math.nan] for r in range(w)]),
        time_s,
    )


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("elastic")
    writer = MetricsWriter(run_dir, 3, {"config": {"epochs": 2, "policy": "cadence"}, "policy": "cadence"})
    writer.start()
    rec, members = Recorder(writer), Membership.launch(3)
    for n in range(6):
        _round(rec, n, members)
    _epoch(rec, 0, 6, members, 6.0)
    rec.round(round=6)  # the round the death cut off: pending, its acks never come (dropped)
    members = members.without([1])
    rec.membership(SHRINK, members)
    for n in range(6, 9):  # the abandoned round's number is the new world's first
        _round(rec, n, members)
    writer.close()  # rank 0 (id 0) dies; id 2 (rank 1 now) takes over, one newcomer joins
    members, joined = members.without([0]).with_newcomers(1)
    assert joined == (3,)
    writer = MetricsWriter.take_over(run_dir, width=members.width)
    writer.start()
    rec = Recorder(writer)
    rec.membership(REGROW, members)
    for n in range(9, 12):
        _round(rec, n, members)
    _epoch(rec, 1, 12, members, 12.0)
    writer.close()
    return run_dir


def test_the_reader_gives_the_changes_and_series_by_stable_id(run_dir):
    run = load_run(run_dir)
    assert run.membership == [SHRINK, REGROW]
    assert run.width == 4 and run.rank_name(3) == "id 3"
    steps = run.per_rank("rounds", "steps")  # (rounds, id)
    assert steps.shape == (12, 4)
    rounds = run.column("rounds", "round").tolist()
    assert rounds == list(range(12)), "the abandoned round 6 is not recorded; the new world's round 6 is"
    for row, n in enumerate(rounds):
        members = (0, 1, 2) if row < 6 else (0, 2) if row < 9 else (2, 3)
        for i in range(4):
            want = 10.0 * n + i if i in members else math.nan
            assert steps[row, i] == want or (math.isnan(want) and math.isnan(steps[row, i])), (row, i)
    batches = run.column("batches", "rank").tolist()
    assert batches == [0, 1, 2, 2, 3]  # the second epoch's batch records by stable id
    assert np.isnan(run.per_rank("epochs", "per_rank_throughput")[1, :2]).all()


def test_the_report_says_what_each_change_cost(run_dir):
    run = load_run(run_dir)
    text = format_summary(run)
    assert (
        "  membership    2 changes (2 left, 1 joined): detection 100 ms mean, 150 largest; recovery 750 ms "
        "mean, 1450 largest; 6 steps lost in all (never averaged)"
    ) in text
    assert "    round 6: id 1 left (4 steps lost); 2 ranks; detection 150 ms, recovery 50 ms" in text
    assert "    round 9: id 0 left (2 steps lost) and id 3 joined; 2 ranks; detection 50 ms, recovery 1450 ms" in text
    assert describe_world(run) == "3 ranks, then 2 from round 6 (1 left), then 2 from round 9 (1 left and 1 joined)"
    assert [(e.rounds, e.kind) for e in events(run)] == [(6, "membership"), (9, "membership")]
    # each id counts the time it was a rank: 0 until 10 s, 1 until 6.5 s, 2 throughout, 3 from 10 s (of 12)
    np.testing.assert_allclose(rank_seconds(run), [10.0, 6.5, 12.0, 2.0])


def test_the_time_line_plots_mark_each_change(run_dir):
    pytest.importorskip("matplotlib")
    run = load_run(run_dir)
    fig = plots.divergence_figure([run])
    marks = [line for ax in fig.axes for line in ax.lines if line.get_gid() == "event:membership"]
    assert sorted({line.get_xdata()[0] for line in marks}) == [5.5, 8.5]
    assert {line.event_label for line in marks} >= {
        "round 6: id 1 left (4 steps lost); 2 ranks; detection 150 ms, recovery 50 ms"
    }
    labels = [line.get_label() for ax in fig.axes for line in ax.lines]
    assert "id 3" in labels and "rank 3" not in labels


def test_inspect_lists_the_changes(run_dir):
    text = describe_metrics(run_dir / "metrics.h5")
    assert "  table membership: 2 rows, 9 columns" in text
    assert (
        "  membership changes (2):\n    round 6: id 1 left (4 steps lost); 2 ranks; detection 150 ms, "
        "recovery 50 ms\n    round 9:"
    ) in text


def test_replay_refuses_a_plan_a_membership_change_ended(run_dir):
    with pytest.raises(ReplayError) as info:
        read_recorded_plan(run_dir)
    assert str(info.value) == (
        f"--replay-plan '{run_dir / 'metrics.h5'}': the recorded run's plan was ended by a membership change at "
        "round 6 (a rank left or joined: 3 ranks, then 2); the rounds after it are another world's plan, so it "
        "cannot be replayed"
    )
    assert "\n" not in str(info.value)


def test_time_in_the_run_after_a_change_then_a_resume(tmp_path):
    """Hand-worked: 3 ranks, id 1 leaves at 6.5 s (round 6), a resume at 2 ranks from round 12 (12 s) to 19 s.
    The resume launches ranks 0 and 1 again: id 0 is in 0-19 s, id 1 in 0-6.5 s and 12-19 s, id 2 in 0-12 s."""
    from flodl_mpi.outputs.recorder import membership_row
    from flodl_mpi.outputs.run_reader import Run

    n = np.arange(20)
    tables = {
        "rounds": {"round": n, "time_s": n.astype(float)},
        "epochs": {"rounds": np.array([12]), "time_s": np.array([12.0])},
        "membership": membership_row(SHRINK, Membership((0, 2), 3)),
    }
    run = Run(path=tmp_path, label="r", attrs={"world_size": 2, "world_size_history": [[0, 3], [12, 2]]}, tables=tables)
    np.testing.assert_allclose(rank_seconds(run), [19.0, 13.5, 12.0])
