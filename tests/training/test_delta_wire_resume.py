"""A delta ``--wire`` run stopped and resumed ends bit-identical to the uninterrupted one (SPEC §6).

The checkpoint holds the wire's reference once (``/cohort``: ``wire_reference_<plane>``) and each rank's
error feedback (``/ranks/<r>/wire/error/<plane>``); without them the first round after the resume would
be the exact float64 Allreduce and the runs would part. 2-rank runs made by the module's fixture in two
launches (tests/training/run_sequence.py): the uninterrupted and the stopped run of each wire, then the
resumes (never in the launch that stopped them).
"""

import numpy as np
import pytest

from flodl_mpi.outputs.checkpoint import latest_checkpoint, read_checkpoint, read_cohort_state
from tests.training.run_sequence import run_sequence
from tests.training.test_resume import STOPPED

pytestmark = pytest.mark.slow

WIRES = ("int8-delta", "bf16-delta")


def _args(wire: str) -> tuple[str, ...]:
    # 1437 digits samples, batch 32: 45 batches an epoch; 2 ranks x window 4: 6 rounds an epoch.
    return ("train", "--epochs", "2", "--window", "4", "--wire", wire)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """By wire: ``(straight dir, straight proc, stopped dir, stopped proc, stopped checkpoint, resumed proc)``."""
    base = tmp_path_factory.mktemp("delta-resume")
    plan = [((), (*_args(w), "--run-dir", str(base / f"straight-{w}"))) for w in WIRES]
    plan += [(("--stop-at-round", "8"), (*_args(w), "--run-dir", str(base / f"stopped-{w}"))) for w in WIRES]
    first = run_sequence(2, plan, base)
    stops = {w: read_checkpoint(latest_checkpoint(base / f"stopped-{w}" / "checkpoints")) for w in WIRES}
    resumed = run_sequence(
        2, [((), (*_args(w), "--run-dir", str(base / f"stopped-{w}"), "--resume")) for w in WIRES], base
    )
    return {
        w: (base / f"straight-{w}", first[i], base / f"stopped-{w}", first[len(WIRES) + i], stops[w], resumed[i])
        for i, w in enumerate(WIRES)
    }


@pytest.mark.parametrize("wire", WIRES)
def test_a_delta_wire_run_stopped_and_resumed_equals_the_uninterrupted_one(runs, wire):
    straight, proc, stopped, first, stop_ckpt, resumed = runs[wire]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert first.returncode in STOPPED, first.stderr[-3000:]
    assert (stop_ckpt.meta["epoch"], stop_ckpt.meta["round"]) == (1, 8) and stop_ckpt.meta["cursor"] > 0
    # the stopped checkpoint holds the reference once and each rank's own error feedback
    cohort, attrs = read_cohort_state(stop_ckpt.path)
    kind = wire.removesuffix("-delta")
    assert attrs["wire"]["kind"] == kind and "params" in attrs["wire"]["planes"]
    n = sum(a.size for k, a in stop_ckpt.params.items())
    assert cohort["wire_reference_params"].dtype == np.float32 and cohort["wire_reference_params"].shape == (n,)
    errors = [stop_ckpt.ranks[r][0]["wire/error/params"] for r in (0, 1)]
    assert all(e.dtype == np.float32 and e.shape == (n,) and np.any(e != 0) for e in errors)
    assert errors[0].tobytes() != errors[1].tobytes()  # per rank: each its own remainder
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    log = (stopped / "train.log").read_text()
    assert f"--wire {wire}: the reference and each rank's error feedback restored from the checkpoint" in log

    a = read_checkpoint(latest_checkpoint(straight / "checkpoints"))
    b = read_checkpoint(latest_checkpoint(stopped / "checkpoints"))
    assert a.meta["round"] == b.meta["round"] == 12
    for name in (*a.params, *a.buffers):
        x, y = {**a.params, **a.buffers}[name], {**b.params, **b.buffers}[name]
        assert x.tobytes() == y.tobytes(), name
    for r in (0, 1):  # the error feedback went on alike too
        assert a.ranks[r][0]["wire/error/params"].tobytes() == b.ranks[r][0]["wire/error/params"].tobytes()
