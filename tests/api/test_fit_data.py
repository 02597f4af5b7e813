"""flodl_mpi.fit on map-style torch Datasets and with a validation set (issue 22 items 1-3).

A Dataset wrapping the built-in digits trains to the very parameters the same arrays give (one
process, with DataLoader workers too, and at the multi-rank stage's world size); each rank's
loader workers read exactly its batches of the plan (`flodl_mpi.shard`), every sample once per
epoch across the ranks; ``val_fraction`` / a validation Dataset / ``keep_best`` / ``early_stop``
give the CLI's records (epochs table ``val_loss``, ``val_accuracy``, the best checkpoint).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tests.conftest import fork_python

#: The digits as a map-style Dataset; ``reads`` (shared memory, so the loader's worker processes count
#: into it) counts the items read by workers: the read-ahead of the trainer's batches only.
COMMON = r"""
import numpy as np, torch, flodl_mpi
from flodl_mpi.training.data import ensure_digits, load_dataset
digits = load_dataset(ensure_digits())
class Rows(torch.utils.data.Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y
        self.reads = torch.zeros(len(x), dtype=torch.int64).share_memory_()
    def __len__(self):
        return len(self.x)
    def __getitem__(self, i):
        if torch.utils.data.get_worker_info() is not None:
            self.reads[i] += 1
        return torch.from_numpy(self.x[i].astype(np.float64)), int(self.y[i])   # float64 x: cast as arrays are
class Labelled(Rows):  # torchvision's convention: the labels as an attribute, no pass over the items to read them
    @property
    def targets(self):
        return self.y
arrays = {"train": (digits.train.x, digits.train.y), "test": (digits.test.x, digits.test.y)}
def params(run):
    run.wait()
    return [p.detach().clone() for p in run.model.parameters()]
def same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a, b))
KW = dict(epochs=2, batch_size=32, lr=0.01, seed=3)
"""

SERIAL = (
    COMMON
    + r"""
import json, sys
from flodl_mpi.outputs.metrics import read_table
from flodl_mpi.outputs.best_checkpoint import best_checkpoint
from flodl_mpi.outputs.checkpoint import read_checkpoint
out = {}
ref = params(flodl_mpi.fit(data=arrays, **KW))
sets = {"train": Rows(*arrays["train"]), "test": Rows(*arrays["test"])}
out["dataset"] = same(ref, params(flodl_mpi.fit(data=sets, **KW)))
sets = {"train": Labelled(*arrays["train"]), "test": Labelled(*arrays["test"])}
out["workers"] = same(ref, params(flodl_mpi.fit(data=sets, num_workers=2, pin_memory=False, **KW)))
out["worker reads"] = sorted(set(sets["train"].reads.tolist()))      # each sample once per epoch, 2 epochs
# a stop in epoch 2 (SIGUSR1 from the train step, riding the next round), then resume=True: the same run
import os, signal
calls = [0]
def stopping_step(model, batch):
    calls[0] += 1
    if calls[0] == 60:  # fit's one check call, then 45 steps an epoch: step 14 of epoch 2
        os.kill(os.getpid(), signal.SIGUSR1)
    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
sets = {"train": Labelled(*arrays["train"]), "test": Labelled(*arrays["test"])}
try:
    flodl_mpi.fit(data=sets, num_workers=2, train_step=stopping_step, run_dir=sys.argv[1] + "/s", **KW).wait()
except flodl_mpi.Stopped:
    out["stopped"] = True
sets = {"train": Labelled(*arrays["train"]), "test": Labelled(*arrays["test"])}
out["resumed"] = same(ref, params(flodl_mpi.fit(data=sets, num_workers=2, run_dir=sys.argv[1] + "/s", resume=True,
                                                **KW)))
# validation: val_fraction, keep_best, early_stop, in a run dir
run = flodl_mpi.fit(data=arrays, epochs=6, batch_size=32, lr=0.05, val_fraction=0.2, keep_best="val_accuracy",
                    early_stop=2, run_dir=sys.argv[1] + "/v", keep_checkpoints=1)
hist = run.wait()
t = read_table(sys.argv[1] + "/v/metrics.h5", "epochs")
out["table"] = {k: t[k].tolist() for k in ("epoch", "val_loss", "val_accuracy", "test_accuracy")}
out["history"] = [[h.epoch, h.summary.val_loss, h.summary.val_accuracy, h.metrics.get("val_accuracy"),
                   h.metrics.get("accuracy")] for h in hist]
out["best"] = read_checkpoint(best_checkpoint(run.run_dir / "checkpoints")).meta["epoch"]
# a validation split of its own, as a Dataset: the same numbers as the same rows split off by val_fraction
from flodl_mpi.training.validation import split_validation
from flodl_mpi.config import TrainConfig
held = split_validation(digits, 0.2, KW["seed"])
own = {"train": Rows(held.train.x, held.train.y), "val": Rows(held.val.x, held.val.y), "test": sets["test"]}
a = flodl_mpi.fit(data=arrays, val_fraction=0.2, **KW).wait()
b = flodl_mpi.fit(data=own, **KW).wait()
out["own val"] = [[h.summary.val_loss, h.summary.val_accuracy] for h in a] == \
                 [[h.summary.val_loss, h.summary.val_accuracy] for h in b]
try:
    flodl_mpi.fit(data=own, val_fraction=0.2, **KW)
except flodl_mpi.InputError as exc:
    out["both"] = str(exc)
try:
    flodl_mpi.fit(data=arrays, keep_best="val_loss", **KW)
except flodl_mpi.InputError as exc:
    out["none"] = str(exc)
print(json.dumps(out))
"""
)


def _run_script(tmp_path, script: str) -> dict:
    """Run ``script`` in a fresh interpreter (its argv[1]: ``tmp_path``); it exits 0 and its last line is JSON: that."""
    (tmp_path / "script.py").write_text(script)
    proc = fork_python(tmp_path / "script.py", str(tmp_path), cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.in_fork
def test_fit_on_a_dataset_and_with_validation(tmp_path):
    out = _run_script(tmp_path, SERIAL)
    assert out["dataset"] and out["workers"]  # bit-identical to the arrays, read in process or by 2 workers
    assert out["worker reads"] == [2]  # the workers read every training sample once per epoch, nothing else
    assert out["stopped"] and out["resumed"]  # stopped mid-epoch 2 and resumed: bit-identical still
    t, hist = out["table"], out["history"]
    # early stop: the run ends after the first 2 epochs in a row without a better val_accuracy
    best, bad, stop = -1.0, 0, None
    for e, acc in zip(t["epoch"], t["val_accuracy"]):
        if acc > best:
            best, bad = acc, 0
        else:
            bad += 1
        if bad == 2:
            stop = e
            break
    assert t["epoch"] == list(range(1, (stop or 6) + 1))
    assert out["best"] == t["epoch"][int(np.argmax(t["val_accuracy"]))]  # the first best (strictly better)
    assert all(0.5 < v <= 1 for v in t["val_accuracy"]) and all(math.isfinite(v) for v in t["val_loss"])
    # the table's numbers are the history's (the cohort's), and eval_fn's val_ metrics the same ones
    assert [h[1:3] for h in hist] == [[a, b] for a, b in zip(t["val_loss"], t["val_accuracy"])]
    assert [h[3] for h in hist] == t["val_accuracy"]
    # the test set only at the end, or an epoch that may stop early (never chosen on)
    tested = [e for e, v in zip(t["epoch"], t["test_accuracy"]) if not math.isnan(v)]
    assert t["epoch"][-1] in tested and [h[4] is not None for h in hist] == [e in tested for e in t["epoch"]]
    assert out["own val"]
    # one line each (InputError: exit 2 uncaught), the flags as fit()'s keywords
    assert out["both"] == (
        "val_fraction=0.2: 'torch Dataset (Labelled, Rows)' holds a validation set already (287 "
        "samples); use one or the other"
    )
    assert out["none"] == (
        "keep_best needs a validation set: add val_fraction=F or a val/ group to the data (the "
        "test set is not for choosing a model)"
    )


MULTI = (
    COMMON
    + r"""
from mpi4py import MPI
from flodl_mpi import shard
comm = MPI.COMM_WORLD
ref = params(flodl_mpi.fit(data=arrays, **KW))
sets = {"train": Labelled(*arrays["train"]), "test": Labelled(*arrays["test"])}
got = params(flodl_mpi.fit(data=sets, num_workers=1, **KW))
n = len(digits.train.y)
planned = np.zeros(n, np.int64)
for epoch in range(KW["epochs"]):
    for idx in shard(n, epoch, KW["seed"], batch_size=KW["batch_size"], rank=comm.rank, world_size=comm.size):
        np.add.at(planned, idx, 1)
RESULT = (same(ref, got), np.array_equal(sets["train"].reads.numpy(), planned), sets["train"].reads.numpy())
"""
)


@pytest.mark.mpi
def test_fit_on_a_dataset_at_every_rank_reads_only_its_batches():
    from mpi4py import MPI

    scope: dict = {}
    exec(compile(MULTI, "multi", "exec"), scope)
    identical, as_planned, reads = scope["RESULT"]
    assert identical and as_planned
    total = np.sum(MPI.COMM_WORLD.allgather(reads), axis=0)
    assert set(total.tolist()) == {2}  # every sample once per epoch across the ranks


VAL_GROUP = (
    COMMON
    + r"""
import json, sys, h5py
from flodl_mpi.training.validation import split_validation
held = split_validation(digits, 0.2, KW["seed"])   # the rows val_fraction=0.2 holds out, as the file's val/ group
path = sys.argv[1] + "/with-val.h5"
with h5py.File(path, "w") as f:
    for name, split in (("train", held.train), ("val", held.val), ("test", held.test)):
        f[f"{name}/x"], f[f"{name}/y"] = split.x, split.y
def val_run(**kw):
    run = flodl_mpi.fit(keep_best="val_loss", **KW, **kw)
    hist = run.wait()
    return [[h.summary.val_loss, h.summary.val_accuracy] for h in hist], [p.detach().clone() for p in run.model.parameters()]
ref_hist, ref = val_run(data=arrays, val_fraction=0.2)
out = {}
for mode in ("memory", "stream"):
    hist, got = val_run(data=path, data_loading=mode)
    out[mode] = [hist == ref_hist, same(ref, got)]
print(json.dumps(out))
"""
)


@pytest.mark.in_fork
def test_a_val_group_in_the_file_is_the_validation_set_streamed_or_in_memory(tmp_path):
    # the file's val/ group trains and validates as val_fraction's split of the same rows, bit for bit
    assert _run_script(tmp_path, VAL_GROUP) == {"memory": [True, True], "stream": [True, True]}
    # --val-fraction beside the file's own: one line, exit 2, before anything is written
    from tests.conftest import fork_flodl

    refused = fork_flodl(
        "train",
        "--data",
        str(tmp_path / "with-val.h5"),
        "--val-fraction",
        "0.2",
        "--run-dir",
        str(tmp_path / "r"),
        timeout=120,
    )
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert (
        f"--val-fraction 0.2: {str(tmp_path / 'with-val.h5')!r} holds a validation set already (287 samples); "
        "use one or the other"
    ) in refused.stderr
    assert not (tmp_path / "r").exists()
