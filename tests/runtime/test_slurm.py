"""The job scripts under a real Slurm, two nodes and one (``tests/slurm/check.sh``), marked ``slurm``.

Runs when asked for with ``FLODL_TEST_SLURM=1`` (``.ci/run``'s Slurm stage sets
``=require``, which fails instead of skipping when Slurm cannot be had), and where
Slurm is installed, or can be (as root, with ``apt-get`` and the package mirror
reachable: ``tests/slurm/install.sh``). It is not on by default because it needs
root, starts Slurm daemons (and, for two nodes, namespaces) and a test user on the
machine, and takes about 3 minutes. ``check.sh`` starts its own Slurm clusters side by side (two
nodes, each a host of its own in namespaces, where they can be made; one node), submits ``jobs/slurm-*.sbatch`` as a
normal user with the documented CPU-only overrides, and prints one line per check;
this test asserts on the exit status and on each check by name, so a check that
silently stopped running fails as well.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SLURM_DIR = Path(__file__).parents[1] / "slurm"
COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sacct", "setfacl")

#: The checks of check.sh's two-node part (tests/slurm/two_nodes.sh), by name.
TWO_NODES = (
    ["two nodes up", "two nodes preemptible signal"]
    + [f"two nodes {job} {what}" for job in ("multi-node", "preemptible")
       for what in ("state", "hosts", "across nodes", "identical", "rounds")]
    + ["two nodes preemptible requeued on exit 4", "two nodes preemptible resumed",
       "two nodes preemptible equals the uninterrupted run"]
)


def expected(two_nodes: bool) -> list[str]:
    """Every check check.sh makes, by name (each must print "PASS <name>: ..."); without the two-node part
    (``SKIP two nodes: ...``) the single-node part runs the multi-node script and the scancel --batch flow
    itself."""
    plain = ["slurm-one-node"] + ([] if two_nodes else ["slurm-multi-node"])
    flows = ["natural signal"] + ([] if two_nodes else ["scancel --batch"]) + ["start-up signal"]
    return (
        (TWO_NODES if two_nodes else [])
        + ["stale slab left"]
        + [f"{script} {what}" for script in plain for what in ("state", "world size", "metrics", "checkpoints", "done line")]
        + ["stale slab removed", "natural signal requeue"] + ([] if two_nodes else ["scancel --batch signal"])
        + ["start-up signal"]
        + [f"{flow} {what}" for flow in flows
           for what in ("state", "sacct", "requeued on exit 4", "resumed", "world size", "rounds", "epochs", "checkpoint")]
        + ["start-up signal before training", "bad input state", "bad input not requeued"]
    )


def _skip_reason() -> str | None:
    """None when check.sh can run here (installing Slurm first if needed), else why not."""
    if os.environ.get("FLODL_TEST_SLURM") not in ("1", "require"):
        return ("the real-Slurm test runs only with FLODL_TEST_SLURM=1 (root; it starts Slurm daemons and a test "
                "user, about 3 minutes; .ci/run's Slurm stage runs it)")
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
                       check=False, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"Slurm could not be installed with apt-get (exit {r.returncode}): {last}"
    return None


@pytest.mark.slurm
@pytest.mark.timeout(1080)
def test_job_scripts_under_slurm():
    reason = _skip_reason()
    if reason is not None:
        if os.environ.get("FLODL_TEST_SLURM") == "require":  # CI: a skip would hide a broken install
            pytest.fail(f"FLODL_TEST_SLURM=require but: {reason}")
        pytest.skip(reason)
    env = dict(os.environ, FLODL_VENV=sys.prefix)  # the venv running this test
    proc = subprocess.Popen(["bash", str(SLURM_DIR / "check.sh")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, stdin=subprocess.DEVNULL)
    try:
        out, err = proc.communicate(timeout=960)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: check.sh tears its Slurm down (SIGKILL would leave it running)
        out, err = proc.communicate(timeout=120)
        pytest.fail(f"check.sh did not end within 960 s\n{out}{err}")
    report = out + err
    print(report)  # shown with -s (tests/slurm/ci_stage.sh), and on failure
    passed = {line[5:].split(":", 1)[0] for line in out.splitlines() if line.startswith("PASS ")}
    # Two nodes need namespaces (tests/multinode/cluster.py): where they cannot be made, check.sh says why.
    skipped = [line for line in out.splitlines() if line.startswith("SKIP two nodes: ")]
    names = expected(two_nodes=not skipped)
    missing = [name for name in names if name not in passed]
    assert proc.returncode == 0 and not missing, f"check.sh exit {proc.returncode}; not passed: {missing}\n{report}"
    assert f"slurm checks: {len(names)} passed, 0 failed" in out, report


# ---- the scripts' own logic, without Slurm: stub srun, scontrol and python ----------------------
#
# Each script runs under bash as Slurm would start it (SLURM_JOB_ID, SLURM_SUBMIT_DIR), with
# FLODL_VENV pointing at a stub venv whose activate puts stub commands first on PATH: srun
# records its arguments and environment and then waits for SIGUSR1/SIGTERM (exit 4, like the
# ranks after a stop) or exits with STUB_SRUN_EXIT; scontrol records its arguments; python
# prints STUB_MPI as the MPI library version.

JOBS = Path(__file__).parents[2] / "jobs"

STUB_SRUN = r"""#!/usr/bin/env bash
# STUB_SRUN_DROP=1: drop the first USR1, as srun does before it has launched the ranks.
on_usr1() {
    if [ "${STUB_SRUN_DROP:-0}" = 1 ]; then STUB_SRUN_DROP=0; echo "srun dropped USR1" >> "$STUB_LOG"; return; fi
    echo "srun got USR1" >> "$STUB_LOG"; exit 4
}
trap on_usr1 USR1
trap 'echo "srun got TERM" >> "$STUB_LOG"; exit 4' TERM
echo "srun $*" >> "$STUB_LOG"
echo "SRUN_CPUS_PER_TASK=${SRUN_CPUS_PER_TASK-unset} OMP_NUM_THREADS=${OMP_NUM_THREADS-unset}" >> "$STUB_LOG"
if [ -n "${STUB_SRUN_EXIT:-}" ]; then exit "$STUB_SRUN_EXIT"; fi
touch "$STUB_READY"
for _ in $(seq 120); do sleep 0.1; done
exit 99
"""
STUB_SCONTROL = '#!/usr/bin/env bash\necho "scontrol $*" >> "$STUB_LOG"\n'
STUB_PYTHON = '#!/usr/bin/env bash\necho "$STUB_MPI"\n'
STUB_ACTIVATE = """export PATH="$STUB_BIN:$PATH"
# A stop signal while the environment loads (slow imports on a parallel file system).
if [ -n "${STUB_SIGNAL_IN_ACTIVATE:-}" ]; then kill -"$STUB_SIGNAL_IN_ACTIVATE" $$; fi
"""


def _stub_env(tmp_path: Path, **extra: str) -> dict:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text(STUB_ACTIVATE)
    stub_bin = tmp_path / "stubs"
    stub_bin.mkdir()
    for name, text in (("srun", STUB_SRUN), ("scontrol", STUB_SCONTROL), ("python", STUB_PYTHON)):
        (stub_bin / name).write_text(text)
        (stub_bin / name).chmod(0o755)
    env = {
        "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "SLURM_JOB_ID": "7", "SLURM_SUBMIT_DIR": str(tmp_path),
        "FLODL_VENV": str(venv), "STUB_BIN": str(stub_bin), "STUB_LOG": str(tmp_path / "stub.log"),
        "STUB_READY": str(tmp_path / "srun.ready"), "STUB_MPI": "MPICH Version:      5.0.2",
        "SLURM_CPUS_PER_TASK": "1",
    }
    env.update(extra)
    return env


def _run_script(script: str, tmp_path: Path, env: dict, *args: str, signal_when_ready: int | None = None):
    """Run jobs/SCRIPT under bash; optionally send a signal to it once the stub srun waits.

    Returns (exit status, stdout, the stub log's lines).
    """
    import signal as _signal
    import time

    proc = subprocess.Popen(["bash", str(JOBS / script), *args], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if signal_when_ready is not None:
        deadline = time.monotonic() + 20
        while not Path(env["STUB_READY"]).exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert Path(env["STUB_READY"]).exists(), "the stub srun never started"
        proc.send_signal(_signal.Signals(signal_when_ready))
    out, _ = proc.communicate(timeout=30)
    log = Path(env["STUB_LOG"])
    return proc.returncode, out, log.read_text().splitlines() if log.exists() else []


@pytest.mark.parametrize("sig", ["USR1", "TERM"])
def test_preemptible_stop_while_running_requeues(tmp_path, sig):
    import signal as _signal

    env = _stub_env(tmp_path)
    status, out, log = _run_script("slurm-preemptible.sbatch", tmp_path, env, "--epochs", "3",
                                   signal_when_ready=getattr(_signal, f"SIG{sig}"))
    assert status == 4, out
    assert "srun got USR1" in log, log  # forwarded to srun as USR1 (srun passes it to the ranks)
    assert "scontrol requeue 7" in log, log
    assert f"got SIG{sig}" in out
    assert "stopped and saved in runs/7/checkpoints; requeueing job 7" in out
    assert "srun --mpi=pmi2 --kill-on-bad-exit=1 flodl-mpi train --run-dir runs/7 --resume auto --epochs 3" in log


def test_preemptible_forwards_the_stop_once(tmp_path):
    # A second USR1 would kill a rank that stopped and is exiting (Python no longer handles it then).
    import signal as _signal

    env = _stub_env(tmp_path, STUB_SRUN_DROP="1")
    status, out, log = _run_script("slurm-preemptible.sbatch", tmp_path, env, signal_when_ready=_signal.SIGUSR1)
    assert status == 99, out  # the stub srun ran to its end: the one USR1 was dropped, none followed
    assert "srun dropped USR1" in log and "srun got USR1" not in log, log
    assert not any(line.startswith("scontrol") for line in log), log


@pytest.mark.parametrize("sig", ["USR1", "TERM"])
def test_preemptible_stop_during_startup_requeues(tmp_path, sig):
    # Before the fix the traps came after `source activate`: bash died of the signal (138/143).
    env = _stub_env(tmp_path, STUB_SIGNAL_IN_ACTIVATE=sig)
    status, out, log = _run_script("slurm-preemptible.sbatch", tmp_path, env)
    assert status == 4, out
    assert not any(line.startswith("srun ") for line in log), log  # nothing started, nothing to save
    assert "scontrol requeue 7" in log, log
    assert "stopped and saved in runs/7/checkpoints; requeueing job 7" in out


def test_preemptible_requeues_on_exit_4_without_a_signal_to_the_script(tmp_path):
    # `scancel --signal=USR1 <job>` (no --batch) signals only the ranks: they stop and exit 4.
    env = _stub_env(tmp_path, STUB_SRUN_EXIT="4")
    status, out, log = _run_script("slurm-preemptible.sbatch", tmp_path, env)
    assert status == 4, out
    assert "scontrol requeue 7" in log, log


@pytest.mark.parametrize("code", ["0", "1", "2", "3", "137"])
def test_preemptible_no_requeue_unless_exit_4(tmp_path, code):
    env = _stub_env(tmp_path, STUB_SRUN_EXIT=code)
    status, out, log = _run_script("slurm-preemptible.sbatch", tmp_path, env)
    assert status == int(code), out
    assert not any(line.startswith("scontrol") for line in log), log
    assert ("done: the run in runs/7 is complete" in out) == (code == "0"), out
    assert (f"flodl-mpi failed with exit status {code}: not requeued" in out) == (code != "0"), out


@pytest.mark.parametrize("form", [["--run-dir", "my/run"], ["--run-dir=my/run"]])
def test_preemptible_message_names_the_given_run_dir(tmp_path, form):
    env = _stub_env(tmp_path, STUB_SRUN_EXIT="4")
    status, out, log = _run_script("slurm-preemptible.sbatch", tmp_path, env, *form, "--epochs", "2")
    assert status == 4, out
    assert "stopped and saved in my/run/checkpoints; requeueing job 7" in out
    srun = next(line for line in log if line.startswith("srun "))
    assert srun == f"srun --mpi=pmi2 --kill-on-bad-exit=1 flodl-mpi train --resume auto {' '.join(form)} --epochs 2"  # no runs/7 added


@pytest.mark.parametrize("script", ["slurm-one-node.sbatch", "slurm-multi-node.sbatch", "slurm-preemptible.sbatch"])
@pytest.mark.parametrize("mpi, pmi", [("MPICH Version:      5.0.2", "pmi2"),
                                      ("Open MPI v5.0.11, package: Open MPI", "pmix")])
def test_scripts_choose_pmi_and_pass_cpus_per_task(tmp_path, script, mpi, pmi):
    env = _stub_env(tmp_path, STUB_SRUN_EXIT="0", STUB_MPI=mpi, SLURM_CPUS_PER_TASK="3")
    status, out, log = _run_script(script, tmp_path, env)
    assert status == 0, out
    assert next(line for line in log if line.startswith("srun ")).startswith(f"srun --mpi={pmi} --kill-on-bad-exit=1 flodl-mpi train")
    assert "SRUN_CPUS_PER_TASK=3 OMP_NUM_THREADS=3" in log  # Slurm >= 22.05 does not pass it on itself


@pytest.mark.parametrize("script", ["slurm-one-node.sbatch", "slurm-multi-node.sbatch", "slurm-preemptible.sbatch"])
def test_scripts_without_cpus_per_task_or_with_a_chosen_pmi(tmp_path, script):
    # --cpus-per-task removed: no unbound variable under `set -u`, nothing invented.
    env = _stub_env(tmp_path, STUB_SRUN_EXIT="0", FLODL_SRUN_MPI="pmix", STUB_MPI="MPICH")
    del env["SLURM_CPUS_PER_TASK"]
    status, out, log = _run_script(script, tmp_path, env)
    assert status == 0, out
    assert next(line for line in log if line.startswith("srun ")).startswith("srun --mpi=pmix ")  # honoured
    assert "SRUN_CPUS_PER_TASK=unset OMP_NUM_THREADS=unset" in log


@pytest.mark.parametrize("script", ["slurm-one-node.sbatch", "slurm-multi-node.sbatch", "slurm-preemptible.sbatch"])
def test_scripts_resource_block(script):
    # The one place to edit: every resource line inside the marked block, with the CPU-only override documented.
    text = (JOBS / script).read_text()
    block = text.split("# ---- resources", 1)[1].split("# -----", 1)[0]
    for option in ("--ntasks-per-node", "--gpus-per-task", "--cpus-per-task", "--time"):
        assert f"#SBATCH {option}=" in block, option
        assert f"#SBATCH {option}=" not in text.replace(block, ""), option
    assert "sbatch --gpus-per-task=0 " in text and f"jobs/{script}" in text


# ---- .ci/run's Slurm stage and install.sh, with stub apt-get / apt-cache / id ------------------

def _stub_commands(tmp_path: Path, **scripts: str) -> dict:
    stub_bin = tmp_path / "bin"
    stub_bin.mkdir()
    for name, text in scripts.items():
        (stub_bin / name.replace("_", "-")).write_text("#!/usr/bin/env bash\n" + text)
        (stub_bin / name.replace("_", "-")).chmod(0o755)
    return {"PATH": f"{stub_bin}:/usr/bin:/bin", "HOME": str(tmp_path), "STUB_LOG": str(tmp_path / "stub.log")}


#: What apt-get update prints, exiting 0, when the mirror cannot be reached.
UPDATE_OFFLINE = ("echo \"W: Failed to fetch http://deb.debian.org/debian/dists/bookworm/InRelease  "
                  "Temporary failure resolving 'deb.debian.org'\"")
APT_CACHE = 'echo "$1 $2:"; echo "  Installed: (none)"; echo "  Candidate: ${STUB_CANDIDATE-1.0}"\n'


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="install.sh checks for root first")
@pytest.mark.parametrize("update, install, candidate, status, message", [
    ('echo "$@" >> "$STUB_LOG"', 'echo "$@" >> "$STUB_LOG"', "1.0", 0, ""),
    # apt-get update warns and exits 0 when the mirror cannot be reached
    (UPDATE_OFFLINE, "exit 9", "1.0", 3, "the package mirror is unreachable"),
    ("exit 100", "exit 9", "1.0", 3, "apt-get update failed"),
    ("true", "exit 9", "(none)", 3, "package slurmd is not available from the configured mirror"),
    ("true", 'echo "E: Failed to fetch http://deb.debian.org/x.deb  Could not connect to deb.debian.org"; exit 100',
     "1.0", 3, "the package mirror is unreachable"),
    ("true", 'echo "E: Unable to correct problems, you have held broken packages."; exit 100', "1.0", 1,
     "apt-get install failed"),
])
def test_install_sh(tmp_path, update, install, candidate, status, message):
    apt_get = f'case $1 in update) {update} ;; *) {install} ;; esac\n'
    env = _stub_commands(tmp_path, apt_get=apt_get, apt_cache=APT_CACHE)
    env["STUB_CANDIDATE"] = candidate
    r = subprocess.run(["bash", str(SLURM_DIR / "install.sh")], env=env, capture_output=True, text=True, timeout=30,
                       check=False)
    assert r.returncode == status, r.stderr
    assert message in r.stderr
    if status == 0:
        log = Path(env["STUB_LOG"]).read_text().splitlines()
        assert log == ["update -qq", "install -y -qq --no-install-recommends slurmd slurmctld slurm-client munge acl"]


def test_ci_stage_skips_when_not_root(tmp_path):
    env = _stub_commands(tmp_path, id='echo 1000\n', apt_get='echo "$@" >> "$STUB_LOG"\n')
    r = subprocess.run(["bash", str(SLURM_DIR / "ci_stage.sh")], env=env, capture_output=True, text=True, timeout=30,
                       check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == (".ci/run: Slurm stage skipped: not root (a local Slurm needs root to start slurmd and "
                                "run jobs as a test user)")
    assert not Path(env["STUB_LOG"]).exists()  # nothing installed


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="the stage checks for root first")
def test_ci_stage_skips_when_slurm_cannot_be_installed(tmp_path):
    env = _stub_commands(tmp_path, apt_get="exit 100\n", apt_cache=APT_CACHE)
    env["VIRTUAL_ENV"] = sys.prefix
    r = subprocess.run(["bash", str(SLURM_DIR / "ci_stage.sh")], env=env, capture_output=True, text=True, timeout=30,
                       check=False)
    assert r.returncode == 0, r.stderr
    assert "install.sh: apt-get update failed, the package mirror is unreachable" in r.stderr
    assert ".ci/run: Slurm stage skipped: Slurm cannot be installed here (see the line above)" in r.stdout
