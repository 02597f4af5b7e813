"""A tensor the model replaces is still averaged, end to end (issue 5 item 6).

The bridge-level cases (a re-assigned buffer, a replaced ``p.data``, bound and
copied params, a shape change) are in ``tests/transport/test_bridge.py``; here the command
runs a model whose ``forward`` re-assigns a registered buffer and whose bias
``.data`` is replaced at every training step, and the checkpoint must hold the
cohort's consensus of that buffer, not rank 0's own value: 2 ranks, launched. A buffer replaced with
another shape is refused by the rank's own binding check, no peer needed: a world of 1 in a fork
(``fork_flodl``; was a 2-rank launch).
"""

import time

import numpy as np

from flodl_mpi.policy.cadence import fixed_quotas, plan_window
from flodl_mpi.outputs.checkpoint import latest_checkpoint, read_checkpoint
from flodl_mpi.training.data import batch_indices, ensure_digits, epoch_permutation, load_dataset, num_batches
from flodl_mpi.errors import EXIT_ERROR
from tests.conftest import fork_flodl, run_flodl

MODEL = """
import torch

class Reassigning(torch.nn.Module):
    def __init__(self, d, k, shape_change):
        super().__init__()
        self.fc = torch.nn.Linear(d, k)
        self.register_buffer("stat", torch.zeros(d))
        self.shape_change = shape_change

    def forward(self, x):
        if self.training:
            self.stat = x.mean(1).detach() if self.shape_change else x.mean(0).detach()
            self.fc.bias.data = self.fc.bias.data.clone()  # p.data replaced: a new storage
        return self.fc(x)

def make(input_shape, num_classes):
    return Reassigning(input_shape[0], num_classes, False)

def make_bad(input_shape, num_classes):
    return Reassigning(input_shape[0], num_classes, True)
"""


def last_batch_means(batch_size: int, world_size: int) -> list[np.ndarray]:
    """Each rank's x.mean(0) over its last batch of epoch 0 (sync policy), in float64."""
    train = load_dataset(ensure_digits()).train
    perm = epoch_permutation(train.n, 0, 0)
    n_batches = num_batches(train.n, batch_size)
    cursor, last = 0, None
    while cursor < n_batches:
        last = plan_window(fixed_quotas(world_size, 1), cursor, n_batches)
        cursor = last.end
    assert all(c == 1 for c in last.counts), "pick a batch size where every rank trains in the last window"
    return [train.x[batch_indices(perm, batch_size, s)].astype(np.float64).mean(0) for s in last.starts]


def test_a_re_assigned_buffer_is_averaged_into_the_checkpoint(tmp_path):
    (tmp_path / "reassigning.py").write_text(MODEL)
    batch_size = 30  # 48 batches: both ranks train in the epoch's last window
    means = last_batch_means(batch_size, 2)
    assert np.abs(means[0] - means[1]).max() > 0.1  # rank 0's own value would be visibly wrong
    run_dir = tmp_path / "r"
    proc = run_flodl(2, "train", "--epochs", "1", "--batch-size", str(batch_size), "--model", "reassigning:make",
                     "--run-dir", str(run_dir), timeout=400, env={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    ckpt = read_checkpoint(latest_checkpoint(run_dir / "checkpoints"))
    # Buffers are averaged with equal weight among the ranks that moved (SPEC §1).
    np.testing.assert_allclose(ckpt.buffers["stat"], (means[0] + means[1]) / 2, rtol=1e-5, atol=1e-6)


def test_a_buffer_replaced_with_another_shape_ends_the_job_naming_it(tmp_path, monkeypatch):
    """A world of 1 in a fork (see the module's docstring); the model's module is found on sys.path, as the
    launched ranks found it on their PYTHONPATH."""
    (tmp_path / "reassigning.py").write_text(MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))  # the fork's child imports "reassigning" from there
    t0 = time.monotonic()
    proc = fork_flodl("train", "--epochs", "1", "--model", "reassigning:make_bad", "--run-dir",
                      str(tmp_path / "r"), timeout=400)
    assert time.monotonic() - t0 < 300  # no hang, no 600 s stall (generous: a loaded machine)
    assert proc.returncode == EXIT_ERROR, proc.stderr
    assert ("ReplacedTensorError: model buffer 'stat' was replaced by a (32,) torch.float32 tensor; it was (64,) "
            "torch.float32 when training started") in proc.stderr
