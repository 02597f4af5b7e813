"""The round benchmark's quick mode runs in the suite, so it cannot rot (issue 9)."""

import subprocess
import sys
from pathlib import Path

from tests.conftest import launch_argv, launch_env

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_round.py"


def test_bench_round_quick_mode_runs_and_every_method_is_correct():
    proc = subprocess.run(launch_argv(2, sys.executable, str(BENCH), "--quick"), capture_output=True, text=True,
                          timeout=300, check=False, env=launch_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "correctness vs float64 mean (rtol 1e-5; bf16 rows 2**-8): all ok" in proc.stdout, out
    for row in ("ours: bound, shm (shm-in-place, numba pass)", "ours: bound, shm (shm-in-place, numpy pass)",
                "ours: bound, mpi (allreduce)", "raw: Allreduce, 1 MiB pieces",
                "peer: PeriodicModelAverager (gloo)", "where the time goes",
                "ours: bound, shm (shm-in-place, numba pass, NO pre-round check)",
                "ours: bound, shm (shm-in-place, numba pass, --on-non-finite stop: check in the pass)",
                "ours: bound, shm (shm-in-place, numba pass, before: unfused pass)"):
        assert row in proc.stdout, out


def test_gpu_round_check_runs_on_cpu():
    # The GPU script's code path (Replica.snapshot/adopt with non-blocking copies, the
    # bridge) on CPU ranks: the check it makes on a GPU machine passes here too.
    script = BENCH.parent / "gpu_round_check.py"
    proc = subprocess.run(launch_argv(2, sys.executable, str(script), "--params", "100000", "--rounds", "1",
                                      "--cpu-only"),
                          capture_output=True, text=True, timeout=300, check=False, env=launch_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "consensus vs float64 mean: ok; identical on every rank: True" in proc.stdout, out
