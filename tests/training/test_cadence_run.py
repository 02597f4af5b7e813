"""The cadence and async policies end to end: exact coverage at uneven speeds, exact resume, async accuracy.

Speeds are scripted (``tests/hooked_flodl.py --script-speeds``): the balancer reads the
ms per batch the test says, so quotas are a function of the round, never of the clock.

Every run is a 2-rank run (the policies plan per rank), made by the module's fixture in two launches
(tests/training/run_sequence.py: one start-up of the ranks for several runs, each with its own hooks):
every run that starts afresh, then the resumes of the two stopped ones (never in the launch that
stopped them).
"""

from pathlib import Path
import re

import numpy as np
import pytest

from flodl_mpi.outputs.checkpoint import latest_checkpoint, read_checkpoint
from flodl_mpi.outputs.metrics import read_table
from tests.training.run_sequence import run_sequence
from tests.training.test_resume import STOPPED

pytestmark = pytest.mark.slow

N_TRAIN = 1437  # the digits' training samples: 45 batches of 32 (the last one 29)

# test_a_stopped_and_resumed_cadence_run_equals_the_uninterrupted_one's runs
CADENCE_HOOKS = ("--script-speeds", "1,3", "--script-round-ms", "40")
# Each rank's own Adam state (as the scenario was designed): with the state averaged
# the divergence trend differs and the guard holds the anchor after its first growth.
CADENCE = ("train", "--policy", "cadence", "--anchor", "4", "--epochs", "3", "--batch-size", "16",
           "--average-optimizer-state", "off")
# test_shard_gives_each_rank_what_the_cli_trained_on_it's run: 1437 in 64s is 23 batches (the last of 29); at 2
# ranks, windows of 2 x 3: three, then 5 left, split (3, 2)
WINDOW_PLAN = ("train", "--window", "3", "--epochs", "2", "--batch-size", "64", "--seed", "7")
# test_async_a_stop_in_an_epochs_carried_round_ends_that_epoch_then_stops_after_the_next_window's
ASYNC_HOOKS = ("--script-speeds", "1,3", "--script-round-ms", "60")
ASYNC = ("train", "--policy", "async", "--anchor", "4", "--max-anchor", "4", "--epochs", "3")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The module's runs, by name: ``(run dir, finished process)``. ``cadence-stopped`` and ``async-stopped``
    are the stopped runs' first parts, whose checkpoint and epochs table are read (``...-mid``) before
    ``...-resumed`` continue them in the second launch. ``coverage``'s indices are in ``seen``."""
    base = tmp_path_factory.mktemp("cadence")
    seen = base / "seen"
    plan = {
        "coverage": (("--script-speeds", "1,3", "--script-round-ms", "0", "--record-indices", str(seen)),
                     ("train", "--policy", "cadence", "--anchor", "4", "--epochs", "2")),
        # flodl_mpi.shard's plan is this (tests/training/test_shard.py): a fixed window, uneven last windows
        "window-plan": (("--record-indices", str(base / "seen-window")), WINDOW_PLAN),
        "cadence-straight": (CADENCE_HOOKS, CADENCE),
        "cadence-stopped": ((*CADENCE_HOOKS, "--stop-at-round", "9"), CADENCE),
        "async-10": ((), ("train", "--policy", "async", "--epochs", "10")),
        **{f"easgd-{alpha}": ((), ("train", "--policy", "async", "--async-adopt", "easgd", "--easgd-alpha", alpha,
                                   "--epochs", "5")) for alpha in ("0.5", "1.0")},
        "async-carried": ((), ("train", "--policy", "async", "--epochs", "3", "--checkpoint-every", "1")),
        "async-stopped": ((*ASYNC_HOOKS, "--stop-at-round", "4"), ASYNC),
        **{f"shrink-{policy}": (("--script-speeds", "1,3", "--script-round-ms", "0"),
                                ("train", "--policy", policy, "--anchor", "4", "--max-anchor", "4", "--epochs", "2"))
           for policy in ("async", "cadence")},
    }
    first = run_sequence(2, [(hooks, (*args, "--run-dir", str(base / name))) for name, (hooks, args) in plan.items()],
                         base)
    out = {name: (base / name, proc) for name, proc in zip(plan, first)}
    out["seen"], out["seen-window"] = seen, base / "seen-window"
    for name in ("cadence", "async"):
        d = base / f"{name}-stopped"
        out[f"{name}-mid"] = (read_checkpoint(latest_checkpoint(d / "checkpoints")),
                              read_table(d / "metrics.h5", "epochs"))
    again = run_sequence(2, [(CADENCE_HOOKS, (*CADENCE, "--run-dir", str(base / "cadence-stopped"), "--resume")),
                             (ASYNC_HOOKS, (*ASYNC, "--run-dir", str(base / "async-stopped"), "--resume"))], base)
    for name, proc in zip(("cadence", "async"), again):
        out[f"{name}-resumed"] = (base / f"{name}-stopped", proc)
    return out


def test_each_runs_train_log_holds_only_its_own_lines(runs):
    """The module's first launch made several runs in one process: each train.log names its own run dir and no
    other run's (the handler of a finished run is detached)."""
    names = [name for name, value in runs.items() if isinstance(value, tuple) and isinstance(value[0], Path)
             and not name.endswith("-resumed") and (value[0] / "train.log").exists()]
    assert len(names) >= 3, names
    for name in names:
        text = (runs[name][0] / "train.log").read_text()
        assert str(runs[name][0]) in text, name
        others = [other for other in names if other != name
                  and re.search(re.escape(str(runs[other][0])) + r"(?![\w-])", text)]
        assert not others, (name, others)


def test_cadence_at_speeds_1_to_3_reads_every_sample_exactly_once_per_epoch(runs):
    (run_dir, proc), seen = runs["coverage"], runs["seen"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    reads = [np.load(seen / f"rank{r}.npz") for r in (0, 1)]
    for epoch in (0, 1):
        both = np.concatenate([reads[0][f"e{epoch}"], reads[1][f"e{epoch}"]])
        np.testing.assert_array_equal(np.sort(both), np.arange(N_TRAIN))  # every sample once, none twice
    # Hand-worked plan: the first window has no speeds yet (4, 4); rank 1 at 30 ms a batch, rank 0 at 10 ms:
    # quotas (12, 4). Epoch 1: 8 + 16 + 16 = 40 batches, 5 left -> (4, 1) (largest remainder of 3.75, 1.25).
    # Epoch 2: 16 + 16, 13 left -> (10, 3) (9.75, 3.25). Round overhead 0: the anchor stays 4.
    rounds = read_table(run_dir / "metrics.h5", "rounds")
    np.testing.assert_array_equal(rounds["window"], [[4, 4], [12, 4], [12, 4], [4, 1], [12, 4], [12, 4], [10, 3]])
    np.testing.assert_array_equal(rounds["quota"], [[4, 4]] + [[12, 4]] * 6)
    np.testing.assert_array_equal(rounds["anchor"], [4] * 7)
    epochs = read_table(run_dir / "metrics.h5", "epochs")
    np.testing.assert_allclose(epochs["per_rank_batch_share"], [[0.75, 0.25]] * 2)  # the allocation, normalized
    np.testing.assert_array_equal(epochs["per_rank_batches"], [[32, 13], [34, 11]])
    np.testing.assert_array_equal(epochs["per_rank_share_complete_ms"] > 0, True)


def test_shard_gives_each_rank_what_the_cli_trained_on_it(runs):
    """Issue 22 item 6: ``flodl_mpi.shard`` at the run's seed, batch size, window and world size is, per rank and
    epoch, the samples ``flodl-mpi train`` read on that rank, in order (recorded by --record-indices)."""
    import flodl_mpi

    (_, proc), seen = runs["window-plan"], runs["seen-window"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        reads = np.load(seen / f"rank{rank}.npz")
        for epoch in (0, 1):
            mine = flodl_mpi.shard(N_TRAIN, epoch, 7, batch_size=64, rank=rank, world_size=2, window=3)
            assert len(mine) == (12, 11)[rank]
            np.testing.assert_array_equal(np.concatenate(list(mine)), reads[f"e{epoch}"])


def test_a_stopped_and_resumed_cadence_run_equals_the_uninterrupted_one(runs):
    """The anchor grows (scripted overhead 40 ms), quotas are scaled at epoch ends, the guard acts: bit-equal."""
    (straight, proc), (stopped, first) = runs["cadence-straight"], runs["cadence-stopped"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert first.returncode in STOPPED, first.stderr[-3000:]
    ckpt = runs["cadence-mid"][0]
    assert ckpt.meta["round"] == 9 and ckpt.meta["cursor"] > 0  # stopped mid-epoch, balancer state saved
    assert ckpt.meta["policy"]["name"] == "cadence" and ckpt.meta["policy"]["elche"]["anchor"] > 4
    second = runs["cadence-resumed"][1]
    assert second.returncode == 0, second.stderr[-3000:]
    a = read_checkpoint(latest_checkpoint(straight / "checkpoints"))
    b = read_checkpoint(latest_checkpoint(stopped / "checkpoints"))
    for name in a.params:
        np.testing.assert_array_equal(a.params[name], b.params[name], err_msg=name)
    for name in a.buffers:
        np.testing.assert_array_equal(a.buffers[name], b.buffers[name], err_msg=name)
    assert a.meta["policy"] == b.meta["policy"]
    ra, rb = (read_table(d / "metrics.h5", "rounds") for d in (straight, stopped))
    for col in ("round", "window", "quota", "anchor", "steps", "guard"):
        np.testing.assert_array_equal(ra[col], rb[col], err_msg=col)
    assert len(set(ra["anchor"].tolist())) > 2  # the anchor did grow, more than once


def test_async_on_digits_at_two_ranks_reaches_093(runs):
    run_dir, proc = runs["async-10"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = read_checkpoint(latest_checkpoint(run_dir / "checkpoints"))
    assert ckpt.meta["test_accuracy"] >= 0.93
    assert ckpt.meta["test_count"] == 1797 - N_TRAIN  # the whole test set
    rounds = read_table(run_dir / "metrics.h5", "rounds")
    epochs = read_table(run_dir / "metrics.h5", "epochs")
    # Every sample once per epoch, whatever each rank's share of each window
    np.testing.assert_array_equal(epochs["per_rank_batches"].sum(axis=1), [45] * 10)
    assert np.all(rounds["wait_ms"] >= 0) and np.all(np.isfinite(rounds["round_ms"]))


@pytest.mark.parametrize("alpha", ["0.5", "1.0"])
def test_async_easgd_on_digits_at_two_ranks_reaches_093(runs, alpha):
    """EASGD pulls each rank at its snapshot and keeps its own steps since: it trains as fast
    as delta. (Blending the live params instead pulled back alpha of every window: at alpha
    1.0 the run never moved from its initial model, about 10 % on digits.)

    Issue 20 item 4: train.log says the adoption in the registry's one wording, the report's
    ``adopt easgd, alpha A`` (the option's word), where it said ``adopt EASGD alpha A``."""
    run_dir, proc = runs[f"easgd-{alpha}"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"adopt easgd, alpha {float(alpha):g}: own steps + alpha (consensus - snapshot)" in proc.stdout + \
        proc.stderr  # the run did use the blend
    ckpt = read_checkpoint(latest_checkpoint(run_dir / "checkpoints"))
    assert ckpt.meta["test_accuracy"] >= 0.93
    assert read_table(run_dir / "metrics.h5", "rounds")["round"].size >= 5


def test_async_carries_each_epochs_last_round_and_evaluates_and_saves_its_consensus(runs):
    """The last round of epochs 1 and 2 runs on while the next epoch's first window trains; each epoch's
    checkpoint is that round's consensus, and the test accuracy recorded for the epoch is that model's
    (evaluated again here, in one process, on the whole test set). The last epoch waits for its round."""
    import torch

    from flodl_mpi.outputs.checkpoint import list_checkpoints, load_state_dict
    from flodl_mpi.training.data import ensure_digits, load_dataset
    from flodl_mpi.training.models import digits_mlp
    from flodl_mpi.training.task import evaluate

    run_dir, proc = runs["async-carried"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    epochs = read_table(run_dir / "metrics.h5", "epochs")
    np.testing.assert_array_equal(epochs["per_rank_batches"].sum(axis=1), [45] * 3)  # exact coverage
    ckpts = [read_checkpoint(p) for p in list_checkpoints(run_dir / "checkpoints")]
    assert [c.meta["epoch"] for c in ckpts] == [1, 2, 3]
    data = load_dataset(ensure_digits())  # the file the run read (the same environment)
    done = np.cumsum(epochs["per_rank_batches"], axis=0)  # each rank's batches at each epoch's end
    for e, (path, ckpt) in enumerate(zip(list_checkpoints(run_dir / "checkpoints"), ckpts)):
        steps = [ckpt.ranks[r][1]["global_step"] for r in (0, 1)]
        if e < 2:  # carried: each rank had trained the next epoch's first window when the epoch ended
            assert all(s > d for s, d in zip(steps, done[e])), (e, steps, done[e])
        else:  # the last epoch waits for its round
            assert steps == done[e].tolist()
        model = digits_mlp((64,), 10)
        model.load_state_dict(load_state_dict(path))
        _, correct, count = evaluate(model, data.test, 0, 1, torch.device("cpu"), 256)
        assert count == 1797 - N_TRAIN and correct / count == epochs["test_accuracy"][e], e


def test_async_a_stop_in_an_epochs_carried_round_ends_that_epoch_then_stops_after_the_next_window(runs):
    """Async's plan is one round older: epoch 1 runs windows (4, 4), (4, 4), (12, 4) (speeds 1:3), and
    (10, 3) for the 13 batches left: rounds 0-3. Round 3 carries the stop and runs on while epoch 2's
    first window (12, 4) trains; epoch 1 then ends complete on its consensus, and epoch 2 stops after
    that window's round 4 (cursor 16). The resumed run completes every epoch, each sample once.
    Rounds of 60 ms (scripted) need ceil(2 * 60 / 30) = 4 batches of rank 1 to hide: the anchor never
    shrinks, and --max-anchor 4 keeps the (real) wait from growing it."""
    run_dir, first = runs["async-stopped"]
    assert first.returncode in STOPPED, first.stderr[-3000:]
    ckpt, epochs = runs["async-mid"]
    assert (ckpt.meta["epoch"], ckpt.meta["cursor"], ckpt.meta["round"]) == (1, 16, 5)
    assert ckpt.meta["reason"] == "graceful_shutdown"
    np.testing.assert_array_equal(epochs["per_rank_batches"][0], [30, 15])  # epoch 1 whole, ended on its round
    second = runs["async-resumed"][1]
    assert second.returncode == 0, second.stderr[-3000:]
    epochs = read_table(run_dir / "metrics.h5", "epochs")
    np.testing.assert_array_equal(epochs["per_rank_batches"].sum(axis=1), [45] * 3)


def test_async_shrinks_the_anchor_to_what_hides_the_round(runs):
    """Speeds 1:3 (rank 1: 30 ms a batch) and free rounds (0 ms, scripted): a window need not be long to
    hide them, so async halves the anchor, 4 -> 2 -> 1, from the first rounds that close a window on (the
    plan is one round older than cadence's). At the ceiling 4 no wait can grow it, so the first halving
    is certain; the quotas follow the anchor: (6, 2) at 2. Cadence on the same facts keeps 4."""
    for policy in ("async", "cadence"):
        run_dir, proc = runs[f"shrink-{policy}"]
        assert proc.returncode == 0, proc.stderr[-3000:]
        rounds = read_table(run_dir / "metrics.h5", "rounds")
        anchors = rounds["anchor"].tolist()
        if policy == "async":
            assert anchors[:2] == [4, 4] and 2 in anchors, anchors
            at2 = rounds["anchor"] == 2
            np.testing.assert_array_equal(rounds["quota"][at2], [[6, 2]] * int(at2.sum()))
        else:
            assert anchors == [4] * len(anchors)
