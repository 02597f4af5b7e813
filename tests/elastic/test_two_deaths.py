"""Two ranks killed at once (issue 21's targets: "two ranks at once at W=4"), under ``--on-rank-failure shrink``.

Four ranks under Open MPI's launcher with ``--with-ft ulfm`` train the built-in digits under ``--policy
sync`` for 2 epochs; ranks 1 and 2 are both killed (SIGKILL) at the start of round 8 (epoch 1: 12 rounds
of 4 batches, the last of 1). The survivors must agree on both deaths in one membership change (one row:
both left, world size 2), go on at 2 ranks and finish (exit 0); hold the same parameters at the end; and
train every sample of both epochs exactly once in the consensus: what the survivors trained (less their
window of the abandoned round, trained again) plus what the dead ranks trained before it, which the
launch plan gives (`plan_window` with quotas of 1). Elsewhere (MPICH: no ULFM) it is skipped with the
reason.
"""

from __future__ import annotations

import collections
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from flodl_mpi.policy.cadence import plan_window
from tests.conftest import HOOKED, launch_argv, launch_env
from tests.elastic.test_elastic import N_BATCHES, _ulfm_or_skip

pytestmark = [pytest.mark.launch, pytest.mark.slow]

RANKS, DEAD, ROUND = 4, (1, 2), 8


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    _ulfm_or_skip()
    root = tmp_path_factory.mktemp("two_deaths")
    argv = launch_argv(RANKS, sys.executable, HOOKED, "--dump-final", str(root / "final"), "--fault",
                       f"kill@{DEAD[0]},{DEAD[1]}:{ROUND}", "--", "train", "--on-rank-failure", "shrink", "--policy",
                       "sync", "--epochs", "2", "--run-dir", str(root / "run"))
    argv[1:1] = ["--with-ft", "ulfm"]
    t0 = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False, env=launch_env())
    return root, proc, time.monotonic() - t0


def test_both_deaths_are_one_membership_change_and_the_run_finishes(killed):
    root, proc, seconds = killed
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for dead in DEAD:  # the path ran: both were killed where the test says
        assert f"injected fault: rank {dead} is killed (SIGKILL) at round {ROUND}" in proc.stderr
    assert seconds < 270
    with h5py.File(root / "run" / "metrics.h5", "r") as f:
        m = {k: f["membership"][k][()] for k in f["membership"]}
    assert list(m["round"]) == [ROUND]
    assert m["left"][0].tolist() == [r in DEAD for r in range(RANKS)]
    assert m["world_size"].tolist() == [RANKS - len(DEAD)]
    assert m["steps_lost"][0].tolist() == [int(r in DEAD) for r in range(RANKS)]  # each its window's one step
    assert m["rank"][0].tolist() == [0, -1, -1, 1]
    log = (root / "run" / "train.log").read_text()
    assert f"round {ROUND}: rank(s) 1 (id 1), 2 (id 2) failed; 2 rank(s) go on" in log, log[-3000:]
    assert "done: test accuracy" in log


def test_the_two_survivors_hold_the_same_parameters(killed):
    root, proc, _ = killed
    assert proc.returncode == 0
    assert not any((root / "final" / f"final{r}.npz").exists() for r in DEAD)
    a, b = (np.load(root / "final" / f"final{r}.npz") for r in (0, 3))
    names = [k for k in a.files if k.startswith("p")]
    assert names
    for name in names:
        np.testing.assert_array_equal(a[name], b[name])


def test_every_batch_is_trained_once_per_epoch(killed):
    root, proc, _ = killed
    assert proc.returncode == 0
    count = collections.Counter()
    cursor = 0
    for _ in range(ROUND):  # the dead ranks' windows before the abandoned round, by the launch plan (epoch 0)
        w = plan_window((1,) * RANKS, cursor, N_BATCHES)
        for dead in DEAD:
            count.update((0, b) for b in range(w.starts[dead], w.starts[dead] + w.counts[dead]))
        cursor = w.end
    for r in (0, 3):
        trained = np.load(root / "final" / f"final{r}.npz")["trained"]  # (epoch, batch, round then)
        abandoned = set(np.flatnonzero(trained[:, 2] == ROUND)[:1])  # its window of the abandoned round went back
        count.update((e, b) for i, (e, b, _) in enumerate(trained.tolist()) if i not in abandoned)
    assert sorted(count) == [(e, b) for e in range(2) for b in range(N_BATCHES)]
    assert set(count.values()) == {1}, {k: v for k, v in count.items() if v != 1}
