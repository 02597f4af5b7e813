"""A run that starts while ``flodl-mpi report`` probes the run dir's lock is not refused for it.

``run_dir_lock.in_use`` (report's "running" / "stopped") probes by taking the lock
for an instant. ``claim`` waits out a lock held that briefly (``CLAIM_PATIENCE_S``)
and still refuses a directory another run holds.
"""

import subprocess
import sys
import time

import pytest

from flodl_mpi.outputs import run_dir_lock

# A second process that takes the lock as in_use's probe does, says so, holds it for
# `hold` seconds (far longer than a real probe, so the claim surely meets it held)
# and lets go by exiting.
HOLDER = """
import fcntl, os, sys, time
fd = os.open(os.path.join(sys.argv[1], ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


def _hold(run_dir, hold):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir), str(hold)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.fixture(autouse=True)
def _release(tmp_path):
    yield
    run_dir_lock.release(tmp_path)


def test_a_claim_waits_out_a_lock_held_for_an_instant(tmp_path):
    holder = _hold(tmp_path, 0.5)
    try:
        assert run_dir_lock.in_use(tmp_path)  # held by the other process now: a claim without patience fails here
        started = time.monotonic()
        run_dir_lock.claim(tmp_path)
        waited = time.monotonic() - started
    finally:
        holder.communicate(timeout=30)
    assert holder.returncode == 0
    assert run_dir_lock.in_use(tmp_path)  # ours now
    assert waited < run_dir_lock.CLAIM_PATIENCE_S + 5


def test_a_claim_still_refuses_a_lock_held_past_its_patience(tmp_path, monkeypatch):
    monkeypatch.setattr(run_dir_lock, "CLAIM_PATIENCE_S", 0.3)
    holder = _hold(tmp_path, 60)
    try:
        started = time.monotonic()
        with pytest.raises(run_dir_lock.RunDirInUse, match="is in use by another run"):
            run_dir_lock.claim(tmp_path)
        waited = time.monotonic() - started
    finally:
        holder.kill()
        holder.communicate(timeout=30)
    assert 0.3 <= waited < 10  # it tried for its patience, then gave up (upper bound: only against a hang)
