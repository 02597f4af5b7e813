"""The end-of-run averaging profile: hand-worked sums, and the logged lines equal metrics.h5's."""

import numpy as np
import pytest

from flodl_mpi.outputs.metrics import read_table
from flodl_mpi.protocol.round_profile import PHASES, RunProfile
from tests._runs import session_run_a


def _row(**over):
    W = 2
    row = {f"{p}_ms": np.zeros(W) for p in PHASES if p not in ("other", "handoff")}
    row.update(bridge_ms=np.zeros(W), wait_ms=np.zeros(W), bytes=np.full(W, 4000.0))
    row.update({k: np.asarray(v, dtype=float) for k, v in over.items()})
    return row


def test_sums_phases_other_and_skips_ranks_without_figures():
    prof = RunProfile(2)
    prof.add(_row(control_ms=[1, 2], pack_ms=[2, 2], allreduce_ms=[3, 3], unpack_ms=[1, 1], bridge_ms=[8, 9],
                  wait_ms=[8.5, 10.0]))
    prof.add(_row(control_ms=[1, np.nan], pack_ms=[2, np.nan], allreduce_ms=[3, np.nan], unpack_ms=[1, np.nan],
                  bridge_ms=[7, np.nan], wait_ms=[np.nan, np.nan]))
    assert prof.rounds.tolist() == [2, 1]
    assert prof.ms["control"].tolist() == [2, 2] and prof.ms["allreduce"].tolist() == [6, 3]
    assert prof.ms["other"].tolist() == [1, 1]  # bridge_ms less the named phases: 8-7 + 7-7; 9-8
    assert prof.ms["handoff"].tolist() == [0.5, 1.0]
    lines = prof.lines()
    # rank 0: 2 rounds, 15 + 0.5 ms of phases, 8000 bytes: 7.75 ms/round, 4 kB/round
    assert lines[0].startswith("averaging profile, rank 0: 2 rounds, 7.75 ms/round: control 1.00 (13%)")
    assert "0.00 MB/round" in lines[0]
    assert f"{8000 / 15.5e-3 / 1e9:.2f} GB/s effective" in lines[0]
    assert lines[1].startswith("averaging profile, rank 1: 1 round, 10.00 ms/round")  # 9 + 1 hand-off


def test_world_size_is_checked():
    with pytest.raises(ValueError, match="world_size must be an int >= 1, got 0"):
        RunProfile(0)


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    return session_run_a(tmp_path_factory)


def test_the_logged_lines_are_the_sums_of_the_rounds_table(run_a):
    logged = [line.split(" ", 1)[1] for line in (run_a / "train.log").read_text().splitlines()
              if "averaging profile, rank" in line]
    rounds = read_table(run_a / "metrics.h5", "rounds")
    assert len(logged) == 2 and np.all(np.isfinite(rounds["bridge_ms"]))
    assert np.all(rounds["bridge_ms"] >= rounds["pack_ms"] + rounds["allreduce_ms"] + rounds["unpack_ms"])
    assert logged == RunProfile.from_rounds(rounds).lines()
    assert f"{len(rounds['round'])} rounds" in logged[0]
