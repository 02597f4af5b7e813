"""Outer optimizers end to end through the command (SPEC §7): resume exactness, the inner reset.

The runs are 2-rank runs (the outer step acts on the ranks' average; the inner reset on every rank's own
state), made by the module's fixture in two launches (tests/training/run_sequence.py: one start-up of the
ranks for several runs): the uninterrupted nesterov run, its stopped twin and the two slowmo runs, then
the resume of the stopped one (never in the launch that stopped it).
"""

import numpy as np
import pytest

from flodl_mpi.outputs.checkpoint import latest_checkpoint, read_checkpoint, read_cohort_state
from flodl_mpi.errors import EXIT_INPUT
from flodl_mpi.outputs.metrics import read_table
from tests.conftest import fork_flodl
from tests.training.run_sequence import run_sequence
from tests.training.test_resume import STOPPED

pytestmark = pytest.mark.slow

# 1437 digits samples, batch 32: 45 batches an epoch; 2 ranks x window 4: 6 rounds an epoch.
COMMON = ("train", "--epochs", "2", "--window", "4", "--outer", "nesterov")


def _final(run_dir):
    ckpt = read_checkpoint(latest_checkpoint(run_dir / "checkpoints"))
    return ckpt, {**ckpt.params, **ckpt.buffers}, read_cohort_state(ckpt.path)


def _slowmo(reset: bool) -> tuple[str, ...]:
    return ("train", "--epochs", "1", "--window", "4", "--outer", "slowmo", *(("--outer-reset-inner",) if reset
                                                                              else ()))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The module's runs, by name: ``(run dir, finished process)``; ``stopped`` is the stopped run's first part,
    read (its checkpoint) before ``resumed`` continues it in the second launch."""
    base = tmp_path_factory.mktemp("outer")
    plan = {"straight": ((), COMMON), "stopped": (("--stop-at-round", "8"), COMMON),
            "slowmo-False": ((), _slowmo(False)), "slowmo-True": ((), _slowmo(True))}
    first = run_sequence(2, [(hooks, (*args, "--run-dir", str(base / name))) for name, (hooks, args) in plan.items()],
                         base)
    out = {name: (base / name, proc) for name, proc in zip(plan, first)}
    out["stopped-meta"] = read_checkpoint(latest_checkpoint(base / "stopped" / "checkpoints")).meta
    (resumed,) = run_sequence(2, [((), (*COMMON, "--run-dir", str(base / "stopped"), "--resume"))], base)
    out["resumed"] = (base / "stopped", resumed)
    return out


def test_a_nesterov_run_stopped_and_resumed_equals_the_uninterrupted_one(runs):
    (straight, proc), (stopped, first) = runs["straight"], runs["stopped"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert first.returncode in STOPPED, first.stderr[-3000:]
    meta = runs["stopped-meta"]
    assert (meta["epoch"], meta["round"]) == (1, 8) and meta["cursor"] > 0  # mid-epoch 2
    resumed = runs["resumed"][1]
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    a_ckpt, a, (a_outer, a_attrs) = _final(straight)
    b_ckpt, b, (b_outer, b_attrs) = _final(stopped)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].tobytes() == b[name].tobytes(), name
    for name in ("prev", "velocity"):  # the outer state carried over exactly
        assert a_outer[name].tobytes() == b_outer[name].tobytes(), name
    assert a_attrs == b_attrs and a_attrs["kind"] == "nesterov" and a_attrs["steps"] == 12
    # the outer's lr and momentum are in every checkpoint's config as the run trained at them (not "unset"), so a
    # later change of the defaults does not change a resume (training.train.settle_outer)
    for ckpt in (a_ckpt, b_ckpt, read_checkpoint(latest_checkpoint(stopped / "checkpoints"), ranks=[])):
        config = ckpt.meta["config"]
        assert (config["outer_lr"], config["outer_momentum"]) == (0.7, 0.5), ckpt.path
    # the final weights are the outer optimizer's global parameters
    flat = np.concatenate([a[k].ravel() for k in a_ckpt.order if k in a_ckpt.params])
    np.testing.assert_array_equal(flat, a_outer["prev"])
    rounds = read_table(straight / "metrics.h5", "rounds")
    assert rounds["outer_ms"].shape == (12, 2) and np.all(rounds["outer_ms"][1:] > 0)


@pytest.mark.parametrize("reset", [False, True])
def test_outer_reset_inner_clears_every_ranks_optimizer_state(runs, reset):
    run_dir, proc = runs[f"slowmo-{reset}"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "outer slowmo (lr 0.7, momentum 0.5)" in proc.stdout  # OUTER_DEFAULTS (issue 24 item 4)
    ckpt = read_checkpoint(latest_checkpoint(run_dir / "checkpoints"))
    for r in (0, 1):  # the last round stepped, then every rank cleared (or kept) its Adam state
        arrays, _ = ckpt.ranks[r]
        held = [k for k in arrays if k.startswith("optimizer/state/")]
        assert (held == []) == reset, f"rank {r}: {held[:3]}"


def test_outer_options_are_refused_without_an_outer_optimizer(tmp_path):
    """A refusal made before MPI starts (the options alone decide it, as the config's checks do): a world
    of 1 in a fork says it; such a refusal on every rank of a launch is tests/cli/test_cli.py's
    (test_missing_data_file_is_one_line_and_exit_2_on_every_rank)."""
    proc = fork_flodl("train", "--outer-lr", "0.5", "--run-dir", str(tmp_path / "r"), timeout=300)
    assert proc.returncode == EXIT_INPUT
    assert ("flodl-mpi: error: --outer-lr, --outer-momentum and --outer-reset-inner take effect with --outer "
            "slowmo or nesterov; --outer avg adopts the consensus as it is") in proc.stderr
    assert not (tmp_path / "r").exists()
