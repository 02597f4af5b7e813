"""The language-model benchmark's smallest setting (benchmarks/lm/): its data and model are right, and the
CLI and ``fit`` take the pair (per-position labels, per-token loss).

A correctness check, not a timing. The corpus is Debian's dict-gcide (``apt-get install -y dict-gcide``;
.ci/run installs it); without it these tests skip, saying so.
"""

from __future__ import annotations

import gzip
import json
import math
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from flodl_mpi.outputs.metrics import read_table
from flodl_mpi.training.data import load_dataset
from tests.conftest import fork_flodl, fork_python

LM = Path(__file__).resolve().parents[2] / "benchmarks" / "lm"
sys.path.insert(0, str(LM))
import corpus  # noqa: E402  (benchmarks/lm is a folder of scripts)
import model as lm_model  # noqa: E402

pytestmark = pytest.mark.skipif(not corpus.GCIDE_PATH.is_file(),
                                reason=f"the GCIDE corpus is not installed ({corpus.INSTALL})")

#: The smallest setting: 9 training and 2 validation blocks (every 4th of 11) of 1 KiB, sequences of 16 bytes.
BLOCK, CONTEXT, TRAIN_BYTES, VAL_EVERY = 1024, 16, 9 * 1024, 4


@pytest.fixture(scope="module")
def lm_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("lm") / "gcide.h5"
    info = corpus.write_h5(path, TRAIN_BYTES, CONTEXT, BLOCK, VAL_EVERY)
    assert info["train"] == 9 * (BLOCK // (CONTEXT + 1)) and info["test"] == 2 * (BLOCK // (CONTEXT + 1))
    return path


def test_the_file_holds_next_byte_labels_from_spread_blocks(lm_file):
    text = gzip.open(corpus.GCIDE_PATH).read()
    available, n_blocks = len(text) // BLOCK, 11
    starts = [i * available // n_blocks * BLOCK for i in range(n_blocks)]  # spread over the whole dictionary
    per_block = BLOCK // (CONTEXT + 1)
    with h5py.File(lm_file) as f:
        assert int(f.attrs["num_classes"]) == 256
        x, y, tx, ty = f["train/x"][()], f["train/y"][()], f["test/x"][()], f["test/y"][()]
    assert x.dtype == np.float32 and y.dtype == np.int64 and x.shape == y.shape == (9 * per_block, CONTEXT)
    # training row 0 is the first 17 bytes of block 0; the held-out rows are blocks 3 and 7 (every 4th)
    first = np.frombuffer(text[starts[0] : starts[0] + CONTEXT + 1], dtype=np.uint8)
    assert np.array_equal(x[0], first[:-1]) and np.array_equal(y[0], first[1:])
    held = np.frombuffer(text[starts[3] : starts[3] + CONTEXT + 1], dtype=np.uint8)
    assert np.array_equal(tx[0], held[:-1]) and np.array_equal(ty[0], held[1:])
    row = 3 * per_block  # block 4 of the text is the training split's 4th block
    fourth = np.frombuffer(text[starts[4] : starts[4] + CONTEXT + 1], dtype=np.uint8)
    assert np.array_equal(x[row], fourth[:-1])
    assert np.array_equal(y[:, :-1], x[:, 1:]) and np.array_equal(ty[:, :-1], tx[:, 1:])
    sample = bytes(np.concatenate([x[0], y[0, -1:]]).astype(np.uint8))
    assert sample == text[starts[0] : starts[0] + CONTEXT + 1]
    # the product reads it as per-position labels with the stated vocabulary
    data = load_dataset(lm_file)
    assert data.num_classes == 256 and data.train.y.shape == (9 * per_block, CONTEXT) and data.warnings == ()


def test_model_is_causal_starts_near_ln_vocab_and_learns(lm_file):
    torch.manual_seed(0)
    data = load_dataset(lm_file)
    net = lm_model.tiny(data.input_shape, data.num_classes)
    x, y = torch.from_numpy(data.train.x[:64]), torch.from_numpy(data.train.y[:64])
    with torch.no_grad():
        logits = net(x)
    assert logits.shape == (64, 256, CONTEXT)
    init = float(torch.nn.functional.cross_entropy(logits, y))
    assert abs(init - math.log(256)) < 0.05, init
    # causal: changing the byte at position 9 leaves the logits at positions 0..8 as they were
    x2 = x.clone()
    x2[:, 9] = (x2[:, 9] + 1) % 256
    with torch.no_grad():
        a, b = net(x), net(x2)
    assert torch.equal(a[..., :9], b[..., :9]) and not torch.allclose(a[..., 9:], b[..., 9:])
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    for _ in range(30):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
    assert loss.item() < init - 1.5, (init, loss.item())  # byte unigrams alone are ~3 nats below ln 256


@pytest.mark.in_fork
def test_cli_trains_the_pair_per_token(lm_file, tmp_path):
    run_dir = tmp_path / "run"
    proc = fork_flodl("train", "--model", f"{LM / 'model.py'}:tiny", "--data", str(lm_file), "--epochs", "1",
                      "--lr", "3e-3", "--run-dir", str(run_dir), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "256 classes (attribute num_classes" in proc.stdout
    epochs = read_table(run_dir / "metrics.h5", "epochs")
    loss, acc = float(epochs["test_loss"][-1]), float(epochs["test_accuracy"][-1])
    # per token: below ln 256 and far from T x that (a sum over positions); accuracy a share of tokens
    assert 2.0 < loss < math.log(256) - 0.5 and 0.05 < acc < 1.0, (loss, acc)


@pytest.mark.in_fork
def test_fit_example_trains_the_pair(lm_file, tmp_path):
    proc = fork_python(LM / "fit_lm.py", str(lm_file), "--size", "tiny", "--epochs", "1", "--lr", "3e-3",
                       timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = json.loads(next(s for s in proc.stdout.splitlines() if s.startswith("{")))
    assert 2.0 < row["val_loss"] < math.log(256) - 0.5, row
    assert row["perplexity"] == pytest.approx(math.exp(row["val_loss"]))
    assert "done: tiny GPT" in proc.stdout
