"""The examples of "Use it from your own code", as a user runs them: ``python`` (a world of 1, no
launcher) and ``mpiexec -n 2``, with the same script.

The world-of-1 cases run the script in a forked child of the pytest process (tests/api/_fork.py:
torch already loaded, as ``python SCRIPT`` would run it otherwise); the 2-rank cases launch it, since
their point is the script under a launcher (and ``[2]`` of the trainer and own-loop examples are the
quick tier's runs of the API's two front ends, tests/_launches.py)."""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from flodl_mpi.outputs.metrics import read_table
from tests.api._fork import fork_script
from tests.conftest import launch_argv, launch_env

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(ranks: int, name, *args: str, timeout: float = 400, cwd=None) -> subprocess.CompletedProcess:
    """``python EXAMPLE ARGS`` (``name``: under examples/, or a script's path; 1 rank: forked, :func:`tests.api._fork.fork_script`) or under ``mpiexec -n RANKS``."""
    if ranks == 1:
        return fork_script(EXAMPLES / name, *args, cwd=cwd, timeout=timeout)
    argv = launch_argv(ranks, sys.executable, str(EXAMPLES / name), *args)
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=launch_env(), check=False,
                          cwd=cwd)


@pytest.mark.parametrize("ranks", [1, 2])
def test_trainer_api_example(tmp_path, ranks):
    proc = run_example(ranks, "trainer_api.py", "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    acc = [float(a) for a in re.findall(r"test accuracy (\d\.\d+)", proc.stdout)]
    assert len(acc) == 5 and acc[-1] >= 0.93  # the CLI's end-to-end bound after 5 epochs
    epochs = read_table(tmp_path / "run" / "metrics.h5", "epochs")
    np.testing.assert_allclose(epochs["test_accuracy"], acc, atol=5e-5)  # the printed numbers are the file's
    assert epochs["per_rank_samples"].shape[1] == ranks
    assert max(p.name[:12] for p in (tmp_path / "run" / "checkpoints").glob("ckpt-*.h5")) == "ckpt-e000005"


@pytest.mark.parametrize("ranks", [1, 2])
def test_own_loop_example(tmp_path, ranks):
    proc = run_example(ranks, "own_loop.py", "--epochs", "3", "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    acc = [float(a) for a in re.findall(r"test accuracy (\d\.\d+)", proc.stdout)]
    assert len(acc) == 3 and acc[-1] > acc[0]
    rounds = read_table(tmp_path / "run" / "metrics.h5", "rounds")
    batches = 1437 // 32 + 1
    assert len(rounds["round"]) == 3 * (batches // ranks)  # sync: a round per step of each rank
    np.testing.assert_array_equal(rounds["steps"], np.ones((len(rounds["round"]), ranks)))


@pytest.mark.parametrize("ranks", [1, 2])
def test_regression_example_beats_its_stated_fraction_of_var_y(tmp_path, ranks):
    """The example asserts test MSE < 0.7 var(y_test) itself (exit 1 otherwise); here the number is read back."""
    proc = run_example(ranks, "regression_diabetes.py", "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    m = re.search(r"test mse (\S+) = (\S+) x var\(y_test\) (\S+) \(must be < 0.7\); (\d) rank", proc.stdout)
    assert m and int(m.group(4)) == ranks
    assert float(m.group(1)) < 0.7 * float(m.group(3))
    scalars = read_table(tmp_path / "run" / "metrics.h5", "scalars")
    names = scalars["name"].tolist()
    assert b"mae" in names and b"eval/mae" in names
    epochs = read_table(tmp_path / "run" / "metrics.h5", "epochs")
    assert epochs["test_loss"][-1] == pytest.approx(float(m.group(1)), abs=5e-5)  # "loss" fills test_loss
    # ... and the checkpoint holds the model, as the CLI's does
    from flodl_mpi.outputs.checkpoint import latest_checkpoint, load_state_dict

    state = load_state_dict(latest_checkpoint(tmp_path / "run" / "checkpoints"))
    assert [tuple(v.shape) for v in state.values()] == [(32, 10), (32,), (1, 32), (1,)]


def readme_block(marker: str) -> str:
    """The first ``.. code-block:: python`` of README.rst after the line holding ``marker``, dedented."""
    import textwrap

    lines = (EXAMPLES.parent / "README.rst").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if marker in line)
    start = next(i for i in range(at, len(lines)) if lines[i].strip() == ".. code-block:: python") + 1
    block = []
    for line in lines[start:]:
        if line.strip() and not line.startswith(" "):
            break
        block.append(line)
    return textwrap.dedent("\n".join(block)).strip() + "\n"


@pytest.mark.parametrize("ranks", [1, 2])
def test_the_readme_averager_snippet_runs(tmp_path, ranks):
    """issue 26 item 12: README's own-loop block, as printed there, runs under python and mpiexec -n 2 (was:
    my_batches, test_loss_sum, n_test undefined). window 4: each epoch's last, short window is closed by
    end_epoch(); at 1 rank a second run with --resume finds the 5 epochs done and trains nothing."""
    script = tmp_path / "readme_own_loop.py"
    script.write_text(readme_block("**Keep your loop: the averager**"))
    proc = run_example(ranks, script, cwd=tmp_path)
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
        again = run_example(1, script, "--resume", cwd=tmp_path)
        assert again.returncode == 0, again.stderr[-3000:]
        assert "resuming from ckpt-e000005-r" in again.stderr and ": 5 epoch(s) done, 0 step() call(s)" in \
            again.stderr, again.stderr[-3000:]
        assert "epoch " not in again.stdout
