"""flodl_mpi.fit on targets a user gets wrong, in one world-of-1 process: float class labels (issue 26
item 6), labels training never targets (item 9), and AdamW's own weight decay (item 11). The script runs in a
forked child of the pytest process (tests/conftest.py's ``fork_python``: ``python SCRIPT`` with torch loaded)."""

from __future__ import annotations

import json

import numpy as np

from tests.conftest import fork_python

SCRIPT = r"""
import json, numpy as np, torch, flodl_mpi
from torch import nn
from flodl_mpi.errors import InputError
rng = np.random.default_rng(0)
x = rng.normal(size=(60, 4)).astype(np.float32)
labels = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.5)          # 0, 1, 2
floats = labels.astype(np.float64)                                   # the same labels as floats
seen = {}
def net(input_shape, num_classes):
    seen["num_classes"] = num_classes
    return nn.Linear(input_shape[0], max(num_classes, 1))
out = {}
def fit(y, **kw):
    return flodl_mpi.fit(net, data=((x[:48], y[:48]), (x[48:], y[48:])), batch_size=16, epochs=1, **kw)
try:
    fit(floats)
    out["floats"] = "trained"
except InputError as exc:
    out["floats"] = str(exc)
for task in ("classification", "regression"):
    run = fit(floats, task=task)
    out[task] = [seen["num_classes"], sorted(run.wait()[-1].metrics)]
try:
    fit(labels, task="ranking")
except InputError as exc:
    out["bad task"] = str(exc)
decay = {}
for name, kw in (("adamw", {}), ("adamw explicit 0", {"weight_decay": 0.0}), ("adam", {}), ("sgd", {})):
    run = fit(labels, optimizer=name.split()[0], **kw)
    decay[name] = run.optimizer.param_groups[0]["weight_decay"]
    run.close()
out["decay"] = decay
shifted = labels + 1                                  # 1-based: no 0
test = labels.copy(); test[-1] = 5                    # a test label training never has
flodl_mpi.fit(net, data=((x[:48], shifted[:48]), (x[48:], shifted[48:])), batch_size=16, epochs=1).close()
flodl_mpi.fit(net, data=((x[:48], labels[:48]), (x[48:], test[48:])), batch_size=16, epochs=1).close()
print(json.dumps(out))
"""


def test_fit_on_float_labels_unseen_labels_and_adamw_decay(tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    proc = fork_python(tmp_path / "script.py", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    # issue 26 item 6: float labels 0., 1., 2. were a silent regression (MSE, no accuracy)
    assert out["floats"] == ("the targets in 'in-memory arrays' are floats that look like class labels (whole "
                             "numbers, 3 distinct: 0, 1, 2): fit() would regress on them (mean squared error, no "
                             "accuracy); pass task='classification' (or integer labels, y.astype('int64')) to "
                             "classify, or task='regression' to regress on them")
    assert out["classification"] == [3, ["accuracy", "loss"]]   # 3 classes, and accuracy measured
    assert out["regression"] == [0, ["loss"]]                   # the regression, asked for
    assert out["bad task"] == "task='ranking': must be one of 'classification', 'regression' or None (from the targets)"
    # issue 26 item 11: the optimizer's own default unless given (torch.optim.AdamW's is 0.01)
    assert out["decay"] == {"adamw": 0.01, "adamw explicit 0": 0.0, "adam": 0.0, "sgd": 0.0}
    # issue 26 item 9: labels that add classes training never targets are said, once each, on stderr
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("flodl-mpi: warning:")]
    assert warnings == [
        "flodl-mpi: warning: no label is 0 in 'train y' or 'test y' of 'in-memory arrays' (labels 1..3): class 0 "
        "gets an output that training never targets; 1-based labels? subtract 1 (labels are 0..C-1)",
        "flodl-mpi: warning: 'test y' in 'in-memory arrays' holds label 5 that 'train y' never has (1 test row, the "
        "first at row 11): the model gets an output for it that training never targets, and those rows count as "
        "errors; check the labels of both splits"], proc.stderr


def test_float_targets_that_are_not_labels_still_regress():
    """issue 26 item 6: only whole-number float targets with few values are refused without task=."""
    from flodl_mpi.training.data import dataset_from_arrays, for_task

    x = np.zeros((40, 2), np.float32)
    for y in (np.linspace(0, 1, 40), np.arange(40.0) - 20, np.arange(400.0)[:40].reshape(40, 1) * 0.5,
              np.ones((40, 3))):
        data = dataset_from_arrays((x, y), (x[:4], y[:4]))
        assert for_task(data, None) is data and data.num_classes == 0
    y = np.arange(40) % 3
    data = dataset_from_arrays((x, y), (x[:4], y[:4]))
    assert for_task(data, None) is data and for_task(data, "classification") is data
    reg = for_task(data, "regression")
    assert reg.num_classes == 0 and reg.train.y.dtype == np.float32 and np.array_equal(reg.train.y, y)
