"""Non-finite loss or parameters, end to end through the command (issue 5 item 7).

A rank whose loss or parameters go NaN/Inf is quarantined for the round (mass 0,
it adopts the others' consensus) and the event is in ``metrics.h5``; the job stops
(exit 1, one line naming the ranks, earlier checkpoints kept) only when no rank is
finite, or on any non-finite rank with ``--on-non-finite stop``.

Every run here is about one rank among its peers, so each is launched (2 or 3 ranks); the 2-rank
quarantine cases share one run with both faults (`tests.transport._quarantine_runs`), with
test_quarantine_loss too.
"""

import time

import numpy as np
import pytest

from flodl_mpi.outputs.checkpoint import latest_checkpoint, read_checkpoint
from flodl_mpi.errors import EXIT_ERROR
from flodl_mpi.outputs.metrics import read_table
from tests.conftest import run_flodl
from tests.faults import fault_hooks
from tests.transport._quarantine_runs import NAN_ROUND, NANLOSS_ROUND, two_fault_run

QUICK = ("--epochs", "1", "--batch-size", "64")


def inject(spec: str) -> tuple[str, ...]:
    """The test-only fault hook (tests/faults.py): tests/hooked_flodl.py's options for a run with it."""
    return fault_hooks(spec)


def error_lines(proc):
    return [line for line in proc.stderr.splitlines() if "error" in line]


@pytest.mark.parametrize(("n", "kind"), [(2, "nan"), (3, "nan"), (2, "nanloss")])
def test_a_non_finite_rank_is_quarantined_and_the_run_goes_on(tmp_path, tmp_path_factory, n, kind):
    """At 2 ranks both kinds are read from one shared run (`two_fault_run`: ``nan`` at round 5, ``nanloss`` at
    round 9, both on rank 1; were two runs, each kind at round 5); at 3 ranks a run of its own (``nan@1:5``)."""
    if n == 2:
        run_dir, proc = two_fault_run(tmp_path_factory)
        faults = {"nan": NAN_ROUND, "nanloss": NANLOSS_ROUND}
    else:
        run_dir = tmp_path / "r"
        proc = run_flodl(n, "train", *QUICK, "--run-dir", str(run_dir), hooks=inject(f"{kind}@1:5"), timeout=400)
        faults = {kind: 5}
    at = faults[kind]
    assert proc.returncode == 0, proc.stderr
    assert f"round {at}: rank(s) 1 had a non-finite loss or NaN/Inf parameters: quarantined" in proc.stdout + proc.stderr
    rounds = read_table(run_dir / "metrics.h5", "rounds")
    want = np.zeros((len(rounds["round"]), n), dtype=bool)
    want[list(faults.values()), 1] = True  # those rounds only: the rank came back (its optimizer state was reset)
    np.testing.assert_array_equal(rounds["quarantined"], want)
    assert rounds["mass"][at, 1] == 0.0 and (rounds["mass"][at, [0, *range(2, n)]] > 0).all()
    assert np.isnan(rounds["divergence"][at, 1])
    if n == 2:
        # The consensus is rank 0's parameters exactly ((2·1·θ)/2 is exact in binary),
        # so rank 0's own divergence is 0: the quarantined rank counted for nothing.
        assert rounds["divergence"][at, 0] == 0.0
    ckpt = read_checkpoint(latest_checkpoint(run_dir / "checkpoints"))
    assert all(np.isfinite(a).all() for a in ckpt.params.values())


def test_every_rank_non_finite_ends_the_job_with_one_line_and_keeps_checkpoints(tmp_path):
    """Launched at 2 ranks: the line names each rank's non-finite values, and one line between them."""
    module = tmp_path / "diverging.py"
    module.write_text(
        "import torch\n"
        "class Diverging(torch.nn.Module):\n"
        "    def __init__(self, d, k):\n"
        "        super().__init__()\n"
        "        self.fc = torch.nn.Linear(d, k)\n"
        "        self.calls = 0\n"
        "    def forward(self, x):\n"
        "        self.calls += self.training\n"
        "        out = self.fc(x)\n"
        "        return out * float('nan') if self.calls > 30 else out\n"  # epoch 2 on every rank
        "def make(input_shape, num_classes):\n"
        "    return Diverging(input_shape[0], num_classes)\n")
    run_dir = tmp_path / "r"
    t0 = time.monotonic()
    proc = run_flodl(2, "train", "--epochs", "3", "--model", "diverging:make", "--run-dir", str(run_dir),
                     timeout=400, env={"PYTHONPATH": str(tmp_path)})
    assert time.monotonic() - t0 < 300  # no hang, no 600 s stall (generous: a loaded machine)
    assert proc.returncode == EXIT_ERROR, proc.stderr
    lines = error_lines(proc)
    assert len(lines) == 1, proc.stderr
    assert ("rank(s) 0 (loss and parameters/buffers), 1 (loss and parameters/buffers) had NaN or infinite values; "
            "no rank is finite, so the job stops") in lines[0]
    ckpt = read_checkpoint(latest_checkpoint(run_dir / "checkpoints"))
    assert ckpt.meta["epoch"] == 1 and all(np.isfinite(a).all() for a in ckpt.params.values())


def test_on_non_finite_stop_ends_every_rank_with_one_line_and_keeps_checkpoints(tmp_path):
    """Launched at 2 ranks: the stop is ``--on-non-finite stop``'s only while a finite peer is left (alone, the
    non-finite rank would be every rank: the test above's stop), and it ends the peer too."""
    run_dir = tmp_path / "r"
    # Round 40 is in epoch 2 (23 rounds per epoch at batch 32): epoch 1's checkpoint must survive.
    t0 = time.monotonic()
    proc = run_flodl(2, "train", "--epochs", "3", "--run-dir", str(run_dir), "--on-non-finite", "stop",
                     hooks=inject("nan@0:40"), timeout=400)
    assert time.monotonic() - t0 < 300  # as above
    assert proc.returncode == EXIT_ERROR, proc.stderr
    lines = error_lines(proc)
    assert lines == ["flodl-mpi: error: non-finite values in round 40: rank(s) 0 (parameters/buffers) had NaN or "
                     "infinite values; --on-non-finite stop, so the job stops (training diverged? lower the "
                     "learning rate) and saves nothing from this round; checkpoints saved before stay"]
    ckpt = read_checkpoint(latest_checkpoint(run_dir / "checkpoints"))
    assert ckpt.meta["epoch"] == 1 and all(np.isfinite(a).all() for a in ckpt.params.values())
    assert len(read_table(run_dir / "metrics.h5", "rounds")["round"]) <= 40


def test_on_non_finite_is_validated_in_config_files_and_flags():
    from flodl_mpi.cli.main import build_parser, config_from_args
    from flodl_mpi.config import ConfigError, TrainConfig

    assert TrainConfig().on_non_finite == "quarantine"
    with pytest.raises(ConfigError, match=r"^--on-non-finite 'skip': must be one of quarantine, stop$"):
        TrainConfig(on_non_finite="skip")
    cfg = config_from_args(build_parser().parse_args(["train", "--on-non-finite", "stop"]))
    assert cfg.on_non_finite == "stop"
