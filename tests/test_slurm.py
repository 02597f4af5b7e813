"""The job scripts under a real single-node Slurm (``tests/slurm/check.sh``), marked ``slurm``.

Runs where Slurm is installed, or can be (as root, with ``apt-get`` and the
package mirror reachable: ``tests/slurm/install.sh``); skipped with the reason
otherwise. ``check.sh`` starts its own Slurm, submits ``jobs/slurm-*.sbatch`` as
a normal user with the documented CPU-only overrides, and prints one line per
check; this test asserts on the exit status and on each check by name, so a
check that silently stopped running fails as well. About 4 minutes (plus about
1 minute to install).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SLURM_DIR = Path(__file__).parent / "slurm"
COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "setfacl")

#: Every check check.sh makes, by name: each must print "PASS <name>: ...".
EXPECTED = [
    f"{script} {what}"
    for script in ("slurm-one-node", "slurm-multi-node")
    for what in ("state", "world size", "metrics", "checkpoints", "done line")
] + ["natural signal requeue", "scancel --batch signal"] + [
    f"{flow} {what}"
    for flow in ("natural signal", "scancel --batch")
    for what in ("state", "requeued on exit 4", "resumed", "world size", "rounds", "epochs", "checkpoint")
]


def _skip_reason() -> str | None:
    """None when check.sh can run here (installing Slurm first if needed), else why not."""
    if not sys.platform.startswith("linux"):
        return "a local Slurm needs Linux"
    if os.geteuid() != 0:
        return "a local Slurm needs root (to start slurmd and run jobs as a test user)"
    if all(shutil.which(c) for c in COMMANDS):
        return None
    if shutil.which("apt-get") is None:
        return f"Slurm is not installed ({', '.join(c for c in COMMANDS if not shutil.which(c))} missing) " \
               f"and there is no apt-get to install it"
    r = subprocess.run(["bash", str(SLURM_DIR / "install.sh")], capture_output=True, text=True, timeout=600,
                       stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"Slurm could not be installed with apt-get (exit {r.returncode}): {last}"
    return None


@pytest.mark.slurm
@pytest.mark.timeout(1200)
def test_job_scripts_under_slurm():
    reason = _skip_reason()
    if reason is not None:
        pytest.skip(reason)
    env = dict(os.environ, FLODL_VENV=sys.prefix)  # the venv running this test
    r = subprocess.run(["bash", str(SLURM_DIR / "check.sh")], capture_output=True, text=True, timeout=900,
                       env=env, stdin=subprocess.DEVNULL)
    report = r.stdout + r.stderr
    passed = {line[5:].split(":", 1)[0] for line in r.stdout.splitlines() if line.startswith("PASS ")}
    missing = [name for name in EXPECTED if name not in passed]
    assert r.returncode == 0 and not missing, f"check.sh exit {r.returncode}; not passed: {missing}\n{report}"
    assert f"slurm checks: {len(EXPECTED)} passed, 0 failed" in r.stdout, report
