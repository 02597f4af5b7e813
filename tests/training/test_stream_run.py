"""Streamed data end to end (issue 22 item 1): ``--data-loading stream`` trains the very run ``memory`` trains.

One 2-rank launch (tests/training/run_sequence.py) makes both runs of the built-in digits at a window of 3:
the streamed run's final parameters are bit-identical to the in-memory run's, and each rank's read-ahead
thread read exactly the rows of that rank's batches (counted by tests/hooked_flodl.py --count-reads, the
batches recorded by --record-indices), with no read of the training features by the training thread
once training began.
"""

import numpy as np
import pytest

from flodl_mpi.outputs.checkpoint import latest_checkpoint, read_checkpoint
from flodl_mpi.outputs.metrics import read_table
from tests.training.run_sequence import run_sequence
from tests.training.test_resume import STOPPED

pytestmark = pytest.mark.slow

ARGS = ("train", "--epochs", "2", "--window", "3", "--seed", "3")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("stream")
    plan = {
        "memory": ((), ("--data-loading", "memory")),
        "stream": (
            ("--record-indices", str(base / "seen"), "--count-reads", str(base / "reads")),
            ("--data-loading", "stream"),
        ),
    }
    # the stop lands in epoch 2 (8 rounds an epoch: 45 batches in windows of 2 x 3), mid-epoch
    plan["stopped"] = (("--stop-at-round", "11"), ("--data-loading", "stream"))
    procs = run_sequence(
        2, [(hooks, (*ARGS, *extra, "--run-dir", str(base / name))) for name, (hooks, extra) in plan.items()], base
    )
    out = dict(zip(plan, procs))
    # the resume in a launch of its own (what it restores comes from the checkpoint)
    (out["resumed"],) = run_sequence(
        2, [((), (*ARGS, "--data-loading", "stream", "--run-dir", str(base / "stopped"), "--resume"))], base
    )
    return base, out


@pytest.mark.parametrize("streamed", ["stream", "stopped"], ids=["straight", "stopped-and-resumed"])
def test_a_streamed_run_ends_bit_identical_to_the_in_memory_run(runs, streamed):
    base, procs = runs
    for name, proc in procs.items():
        assert proc.returncode in (STOPPED if name == "stopped" else (0,)), proc.stderr[-3000:]
    assert (
        "data streamed (--data-loading stream): each rank reads only its batches"
        in (base / streamed / "train.log").read_text()
    )
    # (in one launch a CLI run's train.log handler stays on the logger: later runs' lines follow its own)
    own = (base / "memory" / "train.log").read_text().split(" flodl-mpi ")[1]
    assert "run dir " in own and "data streamed" not in own
    if streamed == "stopped":  # the path: a stop mid-epoch, the resume's first window read from its cursor
        assert "stopped on request in epoch 2 at round 11" in (base / "stopped" / "train.log").read_text()
    a, b = (read_checkpoint(latest_checkpoint(base / name / "checkpoints")) for name in ("memory", streamed))
    for name in a.params:
        np.testing.assert_array_equal(a.params[name], b.params[name], err_msg=name)
    for name in a.buffers:
        np.testing.assert_array_equal(a.buffers[name], b.buffers[name], err_msg=name)
    assert a.meta["test_accuracy"] == b.meta["test_accuracy"] and a.meta["test_count"] == b.meta["test_count"]
    ea, eb = (read_table(base / name / "metrics.h5", "epochs") for name in ("memory", "stream"))
    np.testing.assert_array_equal(ea["avg_loss"], eb["avg_loss"])


def test_each_rank_reads_only_its_batches_and_reads_them_ahead(runs):
    base, _ = runs
    for rank in (0, 1):
        seen = np.load(base / "seen" / f"rank{rank}.npz")
        batches = np.concatenate([seen["e0"], seen["e1"]])
        reads = np.load(base / "reads" / f"reads{rank}.npz")
        rows, train, ahead = reads["rows"], reads["train"].astype(bool), reads["ahead"].astype(bool)
        got = np.concatenate([np.arange(a, b) for a, b in rows[train & ahead]])
        # the read-ahead read each row of this rank's batches once per epoch it was in, and nothing else
        np.testing.assert_array_equal(np.sort(got), np.sort(batches))
        assert len(got) == len(batches) < 0.6 * 2 * 1437  # about half of each epoch's 1437 rows: not the whole file
        first = np.flatnonzero(train & ahead)[0]
        assert not (train & ~ahead)[first:].any()  # after the setup's checks, no training row read in-line
        assert (rows[train & ahead, 1] - rows[train & ahead, 0] >= 1).all()
