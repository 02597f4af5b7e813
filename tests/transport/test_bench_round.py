"""The round benchmark's quick mode runs in the suite, so it cannot rot (issue 9).

Both scripts average across ranks (every method's result against the float64 mean of the ranks' inputs,
the consensus bitwise the same on every rank), so they run at 2 ranks: in one launch (the module's
fixture), which starts the ranks (torch, MPI) once and then calls each script's ``main`` with its own
arguments, as ``python SCRIPT ARGS`` would (its status: the largest of the ranks'; what it printed: its
part of rank 0's output, cut at the marker lines the launch prints between the scripts).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import launch_argv, launch_env

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_round.py"
GPU_CHECK = BENCH.parent / "gpu_round_check.py"
MARK = "@@bench-script {}@@"

#: Runs each script's ``main()`` in turn at every rank; rank 0 writes each one's status (the ranks' largest).
DRIVER = '''
import json, runpy, sys
from pathlib import Path
from mpi4py import MPI

scripts, result, mark = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
comm, codes = MPI.COMM_WORLD, []
for i, (path, argv) in enumerate(scripts):
    comm.Barrier()
    if comm.rank == 0:
        for stream in (sys.stdout, sys.stderr):
            print(mark.format(i), file=stream, flush=True)
    sys.argv = [path, *argv]
    sys.path.insert(0, str(Path(path).parent))
    code = runpy.run_path(path, run_name="benchmark")["main"]()
    sys.stdout.flush()
    sys.stderr.flush()
    codes.append(comm.allreduce(int(code or 0), op=MPI.MAX))
if comm.rank == 0:
    Path(result).write_text(json.dumps(codes))
'''


@pytest.fixture(scope="module")
def scripts(tmp_path_factory):
    """``{name: (status, rank 0's stdout, stderr)}`` of the two scripts, run in one 2-rank launch."""
    tmp = tmp_path_factory.mktemp("bench")
    driver, result = tmp / "driver.py", tmp / "codes.json"
    driver.write_text(DRIVER)
    plan = {"bench": (str(BENCH), ["--quick"]),
            "gpu": (str(GPU_CHECK), ["--params", "100000", "--rounds", "1", "--cpu-only"])}
    proc = subprocess.run(launch_argv(2, sys.executable, str(driver), json.dumps(list(plan.values())), str(result),
                                      MARK), capture_output=True, text=True, timeout=300, check=False,
                          env=launch_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and result.exists(), out[-5000:]
    codes = json.loads(result.read_text())

    def part(text, i):
        start = text.index(MARK.format(i)) + len(MARK.format(i))
        end = text.find(MARK.format(i + 1))
        return text[start:] if end < 0 else text[start:end]

    return {name: (code, part(proc.stdout, i), part(proc.stderr, i)) for i, (name, code) in enumerate(zip(plan, codes))}


def test_bench_round_quick_mode_runs_and_every_method_is_correct(scripts):
    code, stdout, stderr = scripts["bench"]
    out = stdout + stderr
    assert code == 0, out
    assert "correctness vs float64 mean (rtol 1e-5; bf16 rows 2**-8): all ok" in stdout, out
    for row in ("ours: bound, shm (shm-in-place, numba pass)", "ours: bound, shm (shm-in-place, numpy pass)",
                "ours: bound, mpi (allreduce)", "raw: Allreduce, 1 MiB pieces",
                "peer: PeriodicModelAverager (gloo)", "where the time goes",
                "ours: bound, shm (shm-in-place, numba pass, NO pre-round check)",
                "ours: bound, shm (shm-in-place, numba pass, --on-non-finite stop: check in the pass)",
                "ours: bound, shm (shm-in-place, numba pass, before: unfused pass)"):
        assert row in stdout, out


def test_gpu_round_check_runs_on_cpu(scripts):
    # The GPU script's code path (Replica.snapshot/adopt with non-blocking copies, the
    # bridge) on CPU ranks: the check it makes on a GPU machine passes here too.
    code, stdout, stderr = scripts["gpu"]
    out = stdout + stderr
    assert code == 0, out
    assert "consensus vs float64 mean: ok; identical on every rank: True" in stdout, out
