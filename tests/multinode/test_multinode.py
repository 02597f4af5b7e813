"""The product across real hosts on one machine (tests/multinode/cluster.py), under the active MPI's launcher.

Marked ``multinode``; runs when asked for with ``FLODL_TEST_MULTINODE=1`` (``.ci/run``'s multi-node stage sets
``=require``: fail instead of skipping where a cluster cannot be made), as root where ``unshare``, ``nsenter``,
``ip`` and ``tc`` are. Not in tests/run.sh's default suite: each launch across hosts costs 10-40 s here.

What it proves, each host its own UTS, mount (``/dev/shm``) and network namespace, the cross-host traffic over
a veth link:

- the launch: ranks land ``per_host`` to a host in rank order, ``COMM_TYPE_SHARED`` is the host;
- the averaging matrix (tests/multinode/matrix.py, one launch): sync with the node reduce in shared memory or
  MPI, hierarchical on and off, the bf16 wire flat and hierarchical, window, cadence and async: the final model
  the same bits on every rank, and the last round's consensus equal to a float64 numpy reference of every
  rank's pre-round tensors (within one float32 rounding), on the reduce path each option names;
- ``flodl-mpi train``: metrics.h5 names each rank's host; a run resumes on another host count;
- the death of a whole host: the job stops (MPICH: exit non-zero at once; Open MPI: its launcher's message,
  status 0, see ``test_death_of_a_whole_host_stops_the_job_and_loses_no_checkpoint``) and the last checkpoint
  resumes on the hosts left.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from tests.conftest import HOOKED, MPIEXEC, launch_env, launcher_kind
from tests.multinode.cluster import Cluster, host_names, unavailable

HERE = Path(__file__).parent


def _skip_reason() -> str | None:
    if os.environ.get("FLODL_TEST_MULTINODE") not in ("1", "require"):
        return (
            "the multi-host tests run only with FLODL_TEST_MULTINODE=1 (root; namespaces and veth links; "
            ".ci/run's multi-node stage runs them)"
        )
    if MPIEXEC is None:
        return "mpiexec not found"
    return unavailable()


_REASON = _skip_reason()
if _REASON and os.environ.get("FLODL_TEST_MULTINODE") == "require":
    raise RuntimeError(f"FLODL_TEST_MULTINODE=require, but: {_REASON}")
pytestmark = [
    pytest.mark.multinode,
    pytest.mark.launch,
    pytest.mark.slow,
    pytest.mark.skipif(_REASON is not None, reason=_REASON or ""),
]


def _env(extra: dict | None = None) -> dict:
    root = str(HERE.parents[1])
    return launch_env(
        {
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
            **(extra or {}),
        }
    )


def launch(cluster: Cluster, per_host: int, argv: list[str], timeout: float = 240.0, during=None):
    return cluster.launch(launcher_kind(), MPIEXEC, per_host, argv, _env(), timeout, during=during)


def train(cluster: Cluster, per_host: int, run_dir: Path, *args: str, hooks: tuple[str, ...] = (), **kw):
    argv = [sys.executable, HOOKED, *hooks, "--", "train", "--run-dir", str(run_dir), "-q", *args]
    return launch(cluster, per_host, argv, **kw)


def _text(r) -> str:
    return f"exit {r.returncode}\n--- stdout\n{r.stdout[-4000:]}\n--- stderr\n{r.stderr[-4000:]}"


# ---- the launch --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hosts,per_host", [(2, 2), (3, 1), (2, 3)], ids=["2x2", "3x1", "2x3"])
def test_ranks_land_on_their_hosts(hosts, per_host):
    names = host_names(hosts)
    with Cluster(names) as cluster:
        before = [cluster.link_bytes(h) for h in names]
        r = launch(cluster, per_host, [sys.executable, str(HERE / "probe.py")], timeout=120)
        sent = [cluster.link_bytes(h) - b for h, b in zip(names, before)]
    assert r.returncode == 0, _text(r)
    # the probe's 8 MB Allreduce: every host sends at least its share over its link (a ring's 2(H-1)/H · 8 MB
    # among H hosts, any algorithm at least (H-1)/H of it), not through memory shared behind the link's back
    assert all(s >= (hosts - 1) / hosts * (8 << 20) for s in sent), sent
    rows = {}
    # found anywhere in the output: the launcher forwards each rank's stream in chunks, which may meet mid-line
    keys = ("rank", "size", "host", "node", "node_size", "local_rank", "sum")
    pattern = "probe " + " ".join(f"{k}=({'[a-z]+' if k == 'host' else '[0-9]+'})" for k in keys)
    for m in re.finditer(pattern, r.stdout):
        kv = dict(zip(keys, m.groups()))
        rows[int(kv["rank"])] = kv
    W = hosts * per_host
    assert sorted(rows) == list(range(W)), _text(r)
    for rank, kv in rows.items():
        assert kv["host"] == names[rank // per_host]
        assert int(kv["node"]) == (rank // per_host) * per_host  # the node's first world rank
        assert int(kv["node_size"]) == per_host and int(kv["local_rank"]) == rank % per_host
        assert int(kv["size"]) == W and int(kv["sum"]) == W


# ---- the averaging matrix ----------------------------------------------------------------------------------

#: config -> the reduce path of the parameters' plane, on a world of several hosts with several ranks each
PATHS = {
    "sync-auto": "shm+leaders",
    "sync-flat-mpi": "allreduce",
    "sync-hier-mpi": "node-mpi+leaders",
    "sync-hier-shm": "shm+leaders",
    "sync-bf16-hier": "shm+leaders",
    "sync-bf16-flat": "allgather-bf16",
    "window": "shm+leaders",
    "cadence": "shm+leaders",
    "async": "shm+leaders",
}
#: One float32 rounding of a float64 value: relative error at most 2**-24 per element.
TOL = 2.0**-23


def _matrix(hosts: int, per_host: int, names: list[str]) -> dict:
    with Cluster(host_names(hosts)) as cluster:
        r = launch(cluster, per_host, [sys.executable, str(HERE / "matrix.py"), *names], timeout=400)
    assert r.returncode == 0, _text(r)
    reports = {}
    for line in r.stdout.splitlines():
        if line.startswith("MATRIX "):
            rep = json.loads(line[len("MATRIX ") :])
            reports[rep["name"]] = rep
    assert sorted(reports) == sorted(names), _text(r)
    return reports


@pytest.fixture(scope="module")
def matrix_2x2():
    return _matrix(2, 2, list(PATHS))


@pytest.fixture(scope="module")
def matrix_2x3():
    return _matrix(2, 3, ["sync-auto", "sync-hier-mpi", "sync-bf16-hier", "cadence"])


def _check(rep: dict, name: str, hosts: list[str]) -> None:
    assert rep["hosts"] == hosts
    assert rep["identical"], f"{name}: the final model differs across ranks"
    params = rep["planes"][0]
    assert params["path"] == [PATHS[name]], rep
    for plane in rep["planes"]:
        assert plane["realized"], rep
        # one float32 rounding (TOL); across hosts (the leaders' float32 / bf16 node means, issue 25 item 4)
        # also one rounding of each node's mean: matrix.py's ``bound``, computed from the same inputs
        tol = max(TOL, 1.001 * plane["bound"]) if plane["path"][0].endswith("+leaders") else TOL
        assert plane["rel_err"] <= tol, f"{name}: {plane}"


@pytest.mark.parametrize("name", list(PATHS))
def test_averaging_across_two_hosts_of_two(matrix_2x2, name):
    _check(matrix_2x2[name], name, ["nodea"] * 2 + ["nodeb"] * 2)


@pytest.mark.parametrize("name", ["sync-auto", "sync-hier-mpi", "sync-bf16-hier", "cadence"])
def test_averaging_across_two_hosts_of_three(matrix_2x3, name):
    _check(matrix_2x3[name], name, ["nodea"] * 3 + ["nodeb"] * 3)


def test_equal_masses_give_the_reference_bit_for_bit(matrix_2x2):
    # sync: every rank's mass is the same; the float64 sums of four terms, rounded once to float32, met the
    # float32 rounding of numpy's float64 reference on every element here (cadence's unequal masses: 99.4%);
    # across hosts the reference is the leaders' own arithmetic in numpy (node means rounded, then combined)
    for name in ("sync-auto", "sync-flat-mpi", "sync-hier-mpi", "sync-bf16-hier", "sync-bf16-flat"):
        params = matrix_2x2[name]["planes"][0]
        assert params["bits_equal"] >= 0.999, (name, params)


# ---- flodl-mpi train ---------------------------------------------------------------------------------------


def _finals(dump: Path, W: int) -> list[dict]:
    return [dict(np.load(dump / f"rank{r}.npz")) for r in range(W)]


def test_train_names_hosts_and_resumes_on_another_host_count(tmp_path):
    run = tmp_path / "run"
    with Cluster(host_names(2)) as cluster:
        r = train(cluster, 2, run, "--epochs", "1", hooks=("--dump-state", str(tmp_path / "d1")))
    assert r.returncode == 0, _text(r)
    with h5py.File(run / "metrics.h5", "r") as f:
        assert json.loads(f.attrs["hosts"]) == ["nodea", "nodea", "nodeb", "nodeb"]
    finals = _finals(tmp_path / "d1", 4)
    for name, value in finals[0].items():
        if value.dtype.kind == "f":
            assert all(np.array_equal(value, f[name]) for f in finals), name
    log = (run / "train.log").read_text()
    assert "node leaders' MPI Allreduce across nodes (2 nodes" in log

    with Cluster(host_names(3)) as cluster:
        r = train(cluster, 1, run, "--epochs", "2", "--resume", hooks=("--dump-state", str(tmp_path / "d2")))
    assert r.returncode == 0, _text(r)
    log = (run / "train.log").read_text()
    assert "epoch 2/2" in log, log[-2000:]
    with h5py.File(run / "metrics.h5", "r") as f:
        assert json.loads(f.attrs["hosts"]) == ["nodea", "nodeb", "nodec"]
    finals = _finals(tmp_path / "d2", 3)
    for name, value in finals[0].items():
        if value.dtype.kind == "f":
            assert all(np.array_equal(value, f[name]) for f in finals), name


def test_death_of_a_whole_host_stops_the_job_and_loses_no_checkpoint(tmp_path):
    # nodeb's every process (its proxy or daemon and both its ranks) is killed at once, after the first
    # checkpoint is on disk: as its power failing would. The elastic path (issue: membership) has not landed:
    # the job stops. MPICH's Hydra ends at once with a non-zero status; Open MPI's launcher prints that it lost
    # nodeb's daemon and ends the job, but its status is 0 (measured: prterun 5.0.11), so a job script must read
    # train.log's final line, not the status alone. Either way the checkpoint written before is whole and the
    # run resumes from it on the host left.
    run = tmp_path / "run"
    killed = {}

    def kill_nodeb(cluster):
        end = time.monotonic() + 120
        while not glob.glob(str(run / "checkpoints" / "*.h5")) and time.monotonic() < end:
            time.sleep(0.05)
        killed["at"] = time.monotonic()
        killed["pids"] = cluster.kill_host_processes("nodeb")

    with Cluster(host_names(2)) as cluster:
        r = train(cluster, 2, run, "--epochs", "40", "--stall-timeout", "30", during=kill_nodeb, timeout=180)
        ended = time.monotonic()
    assert killed.get("pids"), "nodeb was never killed"
    assert ended - killed["at"] < 60, f"the job outlived its host by {ended - killed['at']:.0f} s"
    if launcher_kind() == "hydra":
        assert r.returncode != 0, _text(r)
    else:
        # which of its two messages depends on when the daemon's end is seen (both seen here); either names nodeb
        said = r.stdout + r.stderr
        assert r.returncode == 0 and "nodeb" in said, _text(r)
        assert (
            "PRTE has lost communication with a remote daemon" in said
            or "A daemon failed to report back after being spawned" in said
        ), _text(r)
    log = (run / "train.log").read_text()
    assert "epoch 40/40" not in log  # it did stop
    saved = sorted(glob.glob(str(run / "checkpoints" / "*.h5")))
    assert saved, "no checkpoint survived"
    with Cluster(host_names(1)) as cluster:
        r = train(cluster, 2, run, "--epochs", "3", "--resume")
    assert r.returncode == 0, _text(r)
    assert "epoch 3/3" in (run / "train.log").read_text()
