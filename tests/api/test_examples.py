"""The examples of "Use it from your own code", as a user runs them: ``python`` (a world of 1, no
launcher) and ``mpiexec -n 2``, with the same script.

The world-of-1 cases run the script in a forked child of the pytest process (tests/conftest.py's fork_python:
torch already loaded, as ``python SCRIPT`` would run it otherwise). The 2-rank cases launch, since
their point is the script under a launcher; two scripts share each launch (`RUNNER`: each rank runs
them one after another, each with its own argv, working directory and output files), the trainer and
own-loop examples (``[2]`` of each: the quick tier's runs of the API's two front ends,
tests/_launches.py) in one, the regression example and README's block in the other."""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from flodl_mpi.outputs.metrics import read_table
from tests.conftest import launch_argv, launch_env, fork_python

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(name, *args: str, timeout: float = 400, cwd=None) -> subprocess.CompletedProcess:
    """``python EXAMPLE ARGS`` at a world of 1, forked (:func:`tests.conftest.fork_python`); ``name``: under
    examples/, or a script's path."""
    return fork_python(EXAMPLES / name, *args, cwd=cwd, timeout=timeout)


#: What each rank of a shared launch runs: the jobs of the JSON file ``argv[1]`` in order, each as ``python
#: SCRIPT ARGV`` would (``__main__``, its argv, in its cwd), its stdout, stderr and exit status to
#: ``OUT.r<rank>.out`` / ``.err`` / ``.rc``; a job that fails ends the launch (an exit status: this rank
#: exits with it; an exception: flodl_mpi's hook, which aborts the job).
RUNNER = """
import json, os, runpy, sys
from flodl_mpi.runtime.launcher import launcher_rank
rank = launcher_rank()
for job in json.load(open(sys.argv[1])):
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(job["out"] + f".r{rank}.out", "w") as out, open(job["out"] + f".r{rank}.err", "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        os.chdir(job["cwd"])
        sys.argv = [job["script"], *job["argv"]]
        sys.path[0] = os.path.dirname(job["script"])
        code = 0
        try:
            runpy.run_path(job["script"], run_name="__main__")
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if not isinstance(exc.code, (int, type(None))):
                print(exc.code, file=sys.stderr)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
    with open(job["out"] + f".r{rank}.rc", "w") as fh:
        fh.write(str(code))
    if code:
        sys.exit(code)
"""


def _shared_launch(tmp, jobs: dict, ranks: int = 2) -> dict:
    """``mpiexec -n RANKS python RUNNER`` for ``jobs`` (name -> (script, argv, cwd)): name -> a CompletedProcess
    as the script's own launch would give (every rank's stdout and stderr, the launcher's included; its exit
    status: rank 0's, or the launch's where the job did not finish on every rank)."""
    runner, listing = tmp / "runner.py", tmp / "jobs.json"
    runner.write_text(RUNNER)
    listing.write_text(json.dumps([{"script": str(EXAMPLES / script), "argv": list(argv), "cwd": str(cwd),
                                    "out": str(tmp / name)} for name, (script, argv, cwd) in jobs.items()]))
    launch = subprocess.run(launch_argv(ranks, sys.executable, str(runner), str(listing)), capture_output=True,
                            text=True, timeout=800, env=launch_env(), check=False)
    procs = {}
    for name in jobs:
        files = {ext: [tmp / f"{name}.r{r}.{ext}" for r in range(ranks)] for ext in ("out", "err", "rc")}
        read = lambda paths: "".join(p.read_text() for p in paths if p.exists())  # noqa: E731
        done = all(p.exists() for p in files["rc"])
        code = int(files["rc"][0].read_text()) if done else (launch.returncode or 1)
        procs[name] = subprocess.CompletedProcess(launch.args, code, launch.stdout + read(files["out"]),
                                                  launch.stderr + read(files["err"]))
    return procs


@pytest.fixture(scope="module")
def front_ends(tmp_path_factory):
    """The trainer and own-loop examples at 2 ranks, in one launch: name -> (process, run dir)."""
    tmp = tmp_path_factory.mktemp("front_ends")
    jobs = {"trainer": ("trainer_api.py", ("--run-dir", str(tmp / "trainer-run")), tmp),
            "own_loop": ("own_loop.py", ("--epochs", "2", "--run-dir", str(tmp / "own_loop-run")), tmp)}
    return {name: (proc, tmp / f"{name}-run") for name, proc in _shared_launch(tmp, jobs).items()}


@pytest.fixture(scope="module")
def regression_and_readme(tmp_path_factory):
    """The regression example and README's own-loop block at 2 ranks, in one launch: name -> (process, dir)."""
    tmp = tmp_path_factory.mktemp("regression_and_readme")
    (tmp / "readme").mkdir()
    script = tmp / "readme" / "readme_own_loop.py"
    script.write_text(readme_block("**Keep your loop: the averager**"))
    jobs = {"regression": ("regression_diabetes.py", ("--run-dir", str(tmp / "regression-run")), tmp),
            "readme": (script, (), tmp / "readme")}
    procs = _shared_launch(tmp, jobs)
    return {"regression": (procs["regression"], tmp / "regression-run"), "readme": (procs["readme"], tmp / "readme")}


@pytest.mark.parametrize("ranks", [1, 2])
def test_trainer_api_example(tmp_path, request, ranks):
    """1 rank: forked; 2: the `front_ends` launch."""
    if ranks == 1:
        run_dir = tmp_path / "run"
        proc = run_example("trainer_api.py", "--run-dir", str(run_dir))
    else:
        proc, run_dir = request.getfixturevalue("front_ends")["trainer"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    acc = [float(a) for a in re.findall(r"test accuracy (\d\.\d+)", proc.stdout)]
    assert len(acc) == 5 and acc[-1] >= 0.93  # the CLI's end-to-end bound after 5 epochs
    epochs = read_table(run_dir / "metrics.h5", "epochs")
    np.testing.assert_allclose(epochs["test_accuracy"], acc, atol=5e-5)  # the printed numbers are the file's
    assert epochs["per_rank_samples"].shape[1] == ranks
    assert max(p.name[:12] for p in (run_dir / "checkpoints").glob("ckpt-*.h5")) == "ckpt-e000005"


@pytest.mark.parametrize("ranks", [1, 2])
def test_own_loop_example(tmp_path, request, ranks):
    """1 rank: forked; 2: the `front_ends` launch. 2 epochs (was 3): enough for the second to end above the first,
    and the rounds' count is per epoch."""
    if ranks == 1:
        run_dir = tmp_path / "run"
        proc = run_example("own_loop.py", "--epochs", "2", "--run-dir", str(run_dir))
    else:
        proc, run_dir = request.getfixturevalue("front_ends")["own_loop"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    acc = [float(a) for a in re.findall(r"test accuracy (\d\.\d+)", proc.stdout)]
    assert len(acc) == 2 and acc[-1] > acc[0]
    rounds = read_table(run_dir / "metrics.h5", "rounds")
    batches = 1437 // 32 + 1
    assert len(rounds["round"]) == 2 * (batches // ranks)  # sync: a round per step of each rank
    np.testing.assert_array_equal(rounds["steps"], np.ones((len(rounds["round"]), ranks)))


@pytest.mark.parametrize("ranks", [1, 2])
def test_regression_example_beats_its_stated_fraction_of_var_y(tmp_path, request, ranks):
    """The example asserts test MSE < 0.7 var(y_test) itself (exit 1 otherwise); here the number is read back.
    1 rank: forked; 2: the `regression_and_readme` launch."""
    if ranks == 1:
        run_dir = tmp_path / "run"
        proc = run_example("regression_diabetes.py", "--run-dir", str(run_dir))
    else:
        proc, run_dir = request.getfixturevalue("regression_and_readme")["regression"]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    m = re.search(r"test mse (\S+) = (\S+) x var\(y_test\) (\S+) \(must be < 0.7\); (\d) rank", proc.stdout)
    assert m and int(m.group(4)) == ranks
    assert float(m.group(1)) < 0.7 * float(m.group(3))
    scalars = read_table(run_dir / "metrics.h5", "scalars")
    names = scalars["name"].tolist()
    assert b"mae" in names and b"eval/mae" in names
    epochs = read_table(run_dir / "metrics.h5", "epochs")
    assert epochs["test_loss"][-1] == pytest.approx(float(m.group(1)), abs=5e-5)  # "loss" fills test_loss
    # ... and the checkpoint holds the model, as the CLI's does
    from flodl_mpi.outputs.checkpoint import latest_checkpoint, load_state_dict

    state = load_state_dict(latest_checkpoint(run_dir / "checkpoints"))
    assert [tuple(v.shape) for v in state.values()] == [(32, 10), (32,), (1, 32), (1,)]


def readme_block(marker: str) -> str:
    """The first python block of docs/tutorial/own-loop.rst (README's complete own loop until the README
    became a front page) after the line holding ``marker`` (tests/docs/snippets.py reads the blocks)."""
    from tests.docs.snippets import blocks

    page = EXAMPLES.parent / "docs" / "tutorial" / "own-loop.rst"
    at = next(i for i, line in enumerate(page.read_text().splitlines(), 1) if marker in line)
    return next(b.text for b in blocks(page) if b.lang == "python" and b.line > at)


@pytest.mark.parametrize("ranks", [1, 2])
def test_the_readme_averager_snippet_runs(tmp_path, request, ranks):
    """issue 26 item 12: README's own-loop block, as printed there, runs under python and mpiexec -n 2 (was:
    my_batches, test_loss_sum, n_test undefined). window 4: each epoch's last, short window is closed by
    end_epoch(); at 1 rank a second run with --resume finds the 5 epochs done and trains nothing.
    1 rank: forked; 2: the `regression_and_readme` launch (in a folder of its own: the block writes runs/mine)."""
    if ranks == 1:
        script = tmp_path / "readme_own_loop.py"
        script.write_text(readme_block("**Keep your loop: the averager**"))
        proc = run_example(script, cwd=tmp_path)
    else:
        proc, tmp_path = request.getfixturevalue("regression_and_readme")["readme"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = re.findall(r"^epoch (\d): loss (\S+) test (\S+)$", proc.stdout, re.M)
    assert [int(e) for e, _, _ in printed] == [1, 2, 3, 4, 5], proc.stdout  # rank 0 prints, once per epoch
    run = tmp_path / "runs" / "mine"
    epochs = read_table(run / "metrics.h5", "epochs")
    np.testing.assert_allclose(epochs["avg_loss"], [float(v) for _, v, _ in printed], atol=5e-5)
    per_rank = 960 // ranks // 32  # batches of each rank per epoch
    assert (epochs["per_rank_batches"] == per_rank).all()
    rounds = read_table(run / "metrics.h5", "rounds")
    assert len(rounds["round"]) == 5 * -(-per_rank // 4)  # every 4 steps, and one for the epoch's rest
    assert max(p.name[:12] for p in (run / "checkpoints").glob("ckpt-*.h5")) == "ckpt-e000005"
    if ranks == 1:  # the resume API of the block: nothing left to train
        again = run_example(script, "--resume", cwd=tmp_path)
        assert again.returncode == 0, again.stderr[-3000:]
        assert "resuming from ckpt-e000005-r" in again.stderr and ": 5 epoch(s) done, 0 step() call(s)" in \
            again.stderr, again.stderr[-3000:]
        assert "epoch " not in again.stdout
