"""Per-position integer labels ``(N, T)`` (a sequence task: a language model's next tokens): read, checked and
evaluated per position, through the file loader, the model-output check and the CLI's evaluation."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch
from torch import nn

from flodl_mpi.training.data import DataError, load_dataset
from flodl_mpi.training.models import ModelSpecError, check_model_output
from flodl_mpi.training.task import evaluate


def _write(path, train_y, test_y, num_classes=None):
    with h5py.File(path, "w") as f:
        f["train/x"], f["train/y"] = np.zeros((len(train_y), 3), np.float32), train_y
        f["test/x"], f["test/y"] = np.zeros((len(test_y), 3), np.float32), test_y
        if num_classes is not None:
            f.attrs["num_classes"] = num_classes


def test_position_labels_are_read_and_counted(tmp_path):
    rng = np.random.default_rng(0)
    _write(tmp_path / "d.h5", rng.integers(0, 5, (6, 3)), rng.integers(0, 5, (4, 3)))
    data = load_dataset(tmp_path / "d.h5")
    assert data.train.y.shape == (6, 3) and data.train.y.dtype == np.int64
    both = np.concatenate([data.train.y.ravel(), data.test.y.ravel()])
    assert data.num_classes == int(both.max()) + 1


def test_a_column_of_labels_and_a_label_over_the_count_are_refused(tmp_path):
    _write(tmp_path / "col.h5", np.zeros((4, 1), np.int64), np.zeros((2, 1), np.int64))
    with pytest.raises(DataError, match=r"'train/y' .* must be 1-D integer class labels, got int64 \(4, 1\) "
                                        r"\(or per-position labels: integers of shape \(N, T\), T >= 2\)"):
        load_dataset(tmp_path / "col.h5")
    y = np.zeros((4, 3), np.int64)
    y[2, 1] = 9  # row 2, its second position
    _write(tmp_path / "over.h5", y, np.zeros((2, 3), np.int64), num_classes=5)
    with pytest.raises(DataError, match=r"'train/y' in .*: label 9 at row 2 is not below the data's num_classes 5"):
        load_dataset(tmp_path / "over.h5")


def test_model_output_must_have_the_positions():
    flat = nn.Linear(3, 5)  # (batch, classes): a label per sample
    with pytest.raises(ModelSpecError, match=r"--model 'm:f': must return logits of shape \(batch, classes, 3\), "
                                             r"got \(2, 5\) for a batch of 2 \(the labels are per position"):
        check_model_output(flat, torch.zeros(2, 3), 5, "m:f", (3,))
    check_model_output(flat, torch.zeros(2, 3), 5, "m:f", ())


class _PerPosition(nn.Module):
    """Logits (B, 4, T) that depend on the position only: softmax rows known in advance."""

    def __init__(self, table: np.ndarray) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.from_numpy(table))  # (4, T)

    def forward(self, x):
        return self.table.expand(x.shape[0], -1, -1)


def test_evaluation_is_per_token_against_a_float64_reference(tmp_path):
    rng = np.random.default_rng(1)
    T, n = 3, 7
    table = rng.normal(size=(4, T)).astype(np.float32)
    y = rng.integers(0, 4, (n, T))
    _write(tmp_path / "e.h5", y, y)
    data = load_dataset(tmp_path / "e.h5")
    loss_sum, correct, count = evaluate(_PerPosition(table), data.test, 0, 1, torch.device("cpu"), 4)
    t = table.astype(np.float64)
    logp = t - np.log(np.exp(t).sum(axis=0, keepdims=True))  # (4, T)
    ref = -sum(logp[y[i, j], j] for i in range(n) for j in range(T))
    assert count == n * T and loss_sum == pytest.approx(ref, rel=1e-6)
    assert correct == int((y == table.argmax(axis=0)[None, :]).sum())
