"""A rank's death does not end the run (``--on-rank-failure shrink``; SPEC §9, issue 21).

Under Open MPI's launcher with ``--with-ft ulfm`` (tests/run.sh --launch, .ci/run's Open
MPI stage): three ranks train the built-in digits under ``--policy sync`` (and
``--policy window --window 2``); a kill -9 of rank 1 (mid params reduce; at a round's
start under the window), and in another run of rank 0, in a round of epoch 2. Each run
must finish (exit 0) with one ``membership`` row, the survivors' final parameters bit
for bit the same, and every training sample trained exactly once per epoch in the
consensus: counted from what each rank trained (tests/hooked_flodl.py --dump-final)
plus what the dead rank trained before the abandoned round, which the launch plan gives
(`Kill.dead_batches`: fixed quotas, its windows over the whole epoch).
Elsewhere (MPICH: no ULFM) the runs are skipped with the reason;
the refusal of ``shrink`` is checked under every launcher.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from pathlib import Path
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from flodl_mpi.policy.cadence import plan_window
from tests.conftest import HOOKED, MPIEXEC, launch_argv, launch_env, launcher_kind, run_flodl

pytestmark = [pytest.mark.launch, pytest.mark.slow]

SHRINK_THEN_EXIT = str(Path(__file__).with_name("shrink_then_exit.py"))
N_BATCHES = 45  # 1437 training samples in batches of 32 (the last of 29)
RANKS = 3


def _ulfm_or_skip() -> None:
    if MPIEXEC is None or launcher_kind() != "openmpi":
        pytest.skip(
            "this MPI (MPICH's Hydra) has no fault tolerance (ULFM): a death ends the job, as tested in "
            "tests/cli/test_cli.py"
        )


def _ulfm_argv(*argv: str) -> list[str]:
    argv = launch_argv(RANKS, *argv)
    argv[1:1] = ["--with-ft", "ulfm"]
    return argv


@dataclass(frozen=True)
class Kill:
    """A kill -9 of launch rank ``dead`` in round ``round``, under a fixed window of ``q`` batches per rank."""

    kind: str
    dead: int
    q: int  # 1: --policy sync (an epoch: 15 rounds); 2: --policy window --window 2 (an epoch: 8 rounds)
    round: int
    asked: bool = True  # --on-rank-failure shrink given; False: the default (shrink under this launcher)

    @property
    def abandons(self) -> bool:
        """Whether the death cuts a round off (its window trained again); not so in the epoch exchange."""
        return self.kind != "kill-epoch"

    def policy(self) -> tuple[str, ...]:
        return ("--policy", "sync") if self.q == 1 else ("--policy", "window", "--window", str(self.q))

    def dead_batches(self) -> list[tuple[int, int]]:
        """(epoch, batch) the dead rank trained in the rounds before the abandoned one, by the launch plan: fixed
        quotas ``q`` per rank over the whole epoch's batches (`plan_window`, tested in tests/policy; here only
        its windows are needed, not what the shrink does)."""
        out, cursor, epoch = [], 0, 0
        for _ in range(self.round):
            w = plan_window((self.q,) * RANKS, cursor, N_BATCHES)
            out += [(epoch, b) for b in range(w.starts[self.dead], w.starts[self.dead] + w.counts[self.dead])]
            cursor = w.end
            if cursor == N_BATCHES:
                cursor, epoch = 0, epoch + 1
        return out


KILLS = [Kill("kill-reduce", 1, 1, 20), Kill("kill", 0, 1, 20), Kill("kill", 1, 2, 8, asked=False),
         Kill("kill-epoch", 1, 1, 15)]


@pytest.fixture(scope="module", params=KILLS, ids=["sync-rank1-mid-reduce", "sync-rank0", "window2-rank1", "sync-rank1-epoch-exchange"])
def killed(request, tmp_path_factory):
    """A run at 3 ranks whose rank ``dead`` is killed (SIGKILL) in round 20: rank 1 in the params reduce
    (its peers past the control gather, in the reduce), rank 0 at the round's start; the window-2 run without
    ``--on-rank-failure`` (the default under this launcher); and rank 1 on entering epoch 1's exchange (after
    round 14: every survivor fails in its first gather)."""
    _ulfm_or_skip()
    kill = request.param
    root = tmp_path_factory.mktemp(f"killed{kill.dead}")
    argv = _ulfm_argv(
        sys.executable,
        HOOKED,
        "--dump-final",
        str(root / "final"),
        "--fault",
        f"{kill.kind}@{kill.dead}:{kill.round}",
        "--",
        "train",
        *(("--on-rank-failure", "shrink") if kill.asked else ()),
        *kill.policy(),
        "--epochs",
        "2",
        "--run-dir",
        str(root / "run"),
    )
    t0 = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180, check=False, env=launch_env())
    return kill, root, proc, time.monotonic() - t0


def test_the_run_finishes_with_one_membership_row(killed):
    kill, root, proc, seconds = killed
    dead, kill_round = kill.dead, kill.round
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"injected fault: rank {dead} is killed (SIGKILL) " in proc.stderr  # the path ran
    assert seconds < 150
    with h5py.File(root / "run" / "metrics.h5", "r") as f:
        m = {k: f["membership"][k][()] for k in f["membership"]}
        epochs = f["epochs"]["epoch"][()]
    assert list(m["round"]) == [kill_round]
    assert m["left"][0].tolist() == [r == dead for r in range(RANKS)]
    assert not m["joined"].any()
    assert m["world_size"].tolist() == [RANKS - 1]
    # its window's steps; none in the epoch exchange (every round before it adopted)
    assert m["steps_lost"][0].tolist() == [kill.q * (r == dead and kill.abandons) for r in range(RANKS)]
    assert m["rank"][0].tolist() == [-1 if r == dead else r - (r > dead) for r in range(RANKS)]
    assert 0 < m["detection_ms"][0] < 2000 and 0 < m["recovery_ms"][0] < 2000  # the bound: 2 s together
    assert len(epochs) == 2  # both epochs' rows: the first by the launch writer, the second after the change
    log = (root / "run" / "train.log").read_text()
    assert "on a rank's death: shrink (Open MPI with --with-ft ulfm)" in log  # asked, or the default (window2)
    assert f"round {kill_round}: rank(s) {dead} (id {dead}) failed; 2 rank(s) go on" in log
    if not kill.abandons:  # the path that goes on from the epoch exchange ran
        assert "it died in the epoch exchange: the epoch is evaluated and exchanged again over the survivors" in log
    if dead == 0:
        assert f"round {kill_round}: rank 0 died; rank 1 (stable id 1) takes over as rank 0" in log
    assert "done: test accuracy" in log


def test_the_survivors_hold_the_same_parameters(killed):
    kill, root, proc, _ = killed
    dead = kill.dead
    assert proc.returncode == 0
    survivors = [np.load(root / "final" / f"final{r}.npz") for r in range(RANKS) if r != dead]
    assert not (root / "final" / f"final{dead}.npz").exists()  # it died: nothing written at its exit
    names = [k for k in survivors[0].files if k.startswith("p")]
    assert names
    for name in names:
        np.testing.assert_array_equal(survivors[0][name], survivors[1][name])


def test_every_batch_is_trained_once_per_epoch(killed):
    kill, root, proc, _ = killed
    dead, kill_round = kill.dead, kill.round
    assert proc.returncode == 0
    count = collections.Counter()
    for r in range(RANKS):
        if r == dead:  # by the plan: every window up to the abandoned round
            count.update(kill.dead_batches())
            continue
        trained = np.load(root / "final" / f"final{r}.npz")["trained"]  # (epoch, batch, round then)
        # its first window at the kill's round went back (none in the epoch exchange: the round had ended)
        abandoned = set(np.flatnonzero(trained[:, 2] == kill_round)[: kill.q]) if kill.abandons else set()
        for i, (epoch, batch, _) in enumerate(trained.tolist()):
            if i not in abandoned:
                count[(epoch, batch)] += 1
    assert sorted(count) == [(e, b) for e in range(2) for b in range(N_BATCHES)]
    assert set(count.values()) == {1}, {k: v for k, v in count.items() if v != 1}


def test_shrink_is_refused_without_fault_tolerance(tmp_path):
    """Under a launcher without ULFM (MPICH; Open MPI without --with-ft): one line, exit 2, nothing trained."""
    t0 = time.monotonic()
    proc = run_flodl(
        1, "train", "--epochs", "1", "--on-rank-failure", "shrink", "--run-dir", str(tmp_path / "r"), timeout=120
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "--on-rank-failure shrink: " in lines[0], proc.stderr
    assert ("has no fault tolerance (ULFM)" in lines[0]) or ("launched without fault tolerance" in lines[0])
    assert "epoch 1/1" not in proc.stdout
    assert not (tmp_path / "r").exists()  # refused before the run dir is made: nothing written
    assert time.monotonic() - t0 < 100


def test_a_death_in_a_checkpoint_gather_stops_the_job_in_seconds(tmp_path):
    """A death in a checkpoint's state gather is not shrunk (docs/elastic.rst, "Limits"): the job ends, non-zero, naming the stage, within a bound (never a
    hang); the checkpoint being gathered is absent, never half written."""
    kind, stage = "kill-gather", "state gather"
    _ulfm_or_skip()
    run_dir = tmp_path / "run"
    argv = _ulfm_argv(
        sys.executable, HOOKED, "--fault", f"{kind}@1:15", "--", "train", "--on-rank-failure", "shrink", "--epochs", "1",
        "--run-dir", str(run_dir)
    )
    t0 = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=150, check=False, env=launch_env())
    assert time.monotonic() - t0 < 120
    assert proc.returncode != 0
    assert f"injected fault: rank 1 is killed (SIGKILL) in the {stage} at round 15" in proc.stderr
    assert f"a peer failed in round 15 at stage '{stage}': MPI_ERR_PROC_FAILED" in proc.stderr
    assert list((run_dir / "checkpoints").glob("*.h5")) == []
    assert f"a peer failed in round 15 at stage '{stage}'" in (run_dir / "train.log").read_text()


def test_the_survivors_of_a_shrink_exit():
    """After a death and a shrink the survivors' ``MPI_Finalize`` returns: each of 6 launches of
    tests/elastic/shrink_then_exit.py exits 0 within its bound, both survivors having shrunk to 2 with
    Open MPI's closing fence skipped (`flodl_mpi.runtime.startup.fault_tolerant_finalize`). Without it,
    4 of 30 such launches hung in ``ompi_mpi_finalize`` (docs/elastic.rst, "Measured"), as a shrunk
    ``flodl-mpi train`` did after its last line (the window-2 run above, past its 180 s bound)."""
    _ulfm_or_skip()
    for launch in range(6):
        t0 = time.monotonic()
        try:
            proc = subprocess.run(_ulfm_argv(sys.executable, SHRINK_THEN_EXIT), capture_output=True, text=True,
                                  timeout=90, check=False, env=launch_env())
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"launch {launch}: the survivors did not exit within 90 s: {exc.stdout!r}")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        for rank in (0, 2):
            assert f"rank {rank}: shrunk to 2 (failed [1]); OMPI_MCA_async_mpi_finalize=1" in proc.stdout, proc.stdout
        assert time.monotonic() - t0 < 80
