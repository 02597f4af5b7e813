"""A streamed run under an address-space limit that loading the file whole exceeds (issue 22, its target).

One fresh interpreter (not a fork of the pytest worker: a fork inherits the worker's heap, whose freed
space inside the address space a later allocation could reuse, so the limit would not bind): a file of 24,000
rows of 1,024 float32 features (94 MiB) is written, one small fit warms torch and MPI up, then the
child's ``RLIMIT_AS`` is set to its address space plus 64 MiB, less than the features. Under it a
``data_loading="stream"`` fit trains an epoch (the rank reads its batches' rows only, at most 8
batches ahead: well under the limit), and ``data_loading="memory"`` is refused at the load, naming
the allocation it could not make. Each rank's peak resident memory at 2 ranks, memory against
stream, is benchmarks/stream_memory.py's.
"""

import json
import subprocess
import sys

SCRIPT = r"""
import json, resource, sys, time, numpy as np, h5py, flodl_mpi
rows, feats = 24000, 1024
rng = np.random.default_rng(0)
with h5py.File("big.h5", "w") as f:
    x = f.create_dataset("train/x", shape=(rows, feats), dtype=np.float32)
    for lo in range(0, rows, 8000):
        x[lo:lo + 8000] = rng.standard_normal(size=(8000, feats), dtype=np.float32)
    f["train/y"] = rng.integers(0, 10, size=rows)
    f["test/x"], f["test/y"] = rng.standard_normal(size=(500, feats), dtype=np.float32), rng.integers(0, 10, size=500)
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
small = (np.zeros((64, feats), np.float32), np.zeros(64, np.int64))
flodl_mpi.fit(data=(small, small), epochs=1, batch_size=32).wait()   # torch's and MPI's allocations made
room = 64 << 20
limit = status("VmSize:") + room
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
out = {"room": room, "features": rows * feats * 4}
run = flodl_mpi.fit(data="big.h5", data_loading="stream", epochs=1, batch_size=256)
hist = run.wait()
out["stream"] = [run.done, hist[-1].summary.test_accuracy, len(hist)]
t = time.monotonic()
try:
    flodl_mpi.fit(data="big.h5", data_loading="memory", epochs=1, batch_size=256)
except Exception as exc:
    out["memory"] = [type(exc).__name__, str(exc), time.monotonic() - t]
print(json.dumps(out))
"""


def test_a_streamed_run_trains_under_a_limit_that_whole_file_loading_exceeds(tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    proc = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["room"] < out["features"]  # the limit leaves less room than the features need
    done, accuracy, epochs = out["stream"]
    assert done and epochs == 1 and 0 <= accuracy <= 1  # streamed: the epoch trained and was tested, under the limit
    assert "memory" in out, f"whole-file loading did not fail under the limit: {out}"
    _, message, seconds = out["memory"]
    assert message.startswith("data: MemoryError: Unable to allocate 93.8 MiB for an array with shape (24000, 1024)")
    assert seconds < 30
