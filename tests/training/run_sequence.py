"""Several ``flodl-mpi`` runs in one multi-rank launch: the ranks start (import torch, MPI, ``torch._dynamo``)
once, then call the CLI's entry point once per run, each with its own hooks (tests/hooked_flodl.py's options).

    run_sequence(2, [((), ("train", "--epochs", "1", "--run-dir", a)),
                     (("--stop-at-round", "8"), ("train", "--epochs", "2", "--run-dir", b))], tmp_path)

Why: a rank's start-up costs about 4.5 CPU seconds (torch, and ``torch._dynamo`` at the first optimizer),
so a 2-rank launch costs about 9 CPU seconds for runs of a fraction of a second. The tests whose point is
averaging across ranks keep their 2-rank launches, but a module's runs share them. Each run is
``flodl_mpi.cli.main.main(ARGS)``, what the ``flodl-mpi`` script calls (MPI, started by the first, runs on:
the entry point then checks only the world size); the hooks a run names are installed before it and the
patched attributes put back after it, so the next run is a plain one unless it names its own. What stays in
the process from an earlier run is the process's imports and MPI. A resume is therefore never put in the
launch of the run it resumes (a test's stop run and its resume: two launches), so what the resume restores
comes from the checkpoint, never from the memory of the run that wrote it.

What each run printed is split out by marker lines (rank 0 prints one before each run, on stdout and on
stderr); the other ranks' lines reach the launcher's streams when they do.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve()
MARK = "@@flodl-run-sequence run {}@@"


def run_sequence(n: int, runs, tmp: Path, timeout: float = 600.0) -> list[subprocess.CompletedProcess]:
    """Launch ``n`` ranks that make ``runs`` (``(hooks, args)`` pairs) one after the other; one finished process
    per run (its exit status, and its part of the launcher's stdout and stderr). The launch itself must end 0
    (a run that aborts the job ends it: the assertion shows the launcher's output). Each has ``seconds``
    too: the wall time of its ``main`` on rank 0."""
    from tests.conftest import launch_argv, launch_env

    runs = [(tuple(map(str, hooks)), tuple(map(str, args))) for hooks, args in runs]
    assert not any("--fault" in hooks for hooks, _ in runs), "a fault cannot be put back: launch it alone"
    tmp.mkdir(parents=True, exist_ok=True)
    k = len(list(tmp.glob("sequence-*.json")))
    spec, result = tmp / f"sequence-{k}.json", tmp / f"sequence-{k}.out.json"
    spec.write_text(json.dumps({"runs": runs, "result": str(result)}))
    proc = subprocess.run(launch_argv(n, sys.executable, str(SCRIPT), str(spec)), capture_output=True, text=True,
                          timeout=timeout, check=False, env=launch_env(), cwd=str(ROOT))
    assert proc.returncode == 0 and result.exists(), proc.stdout[-3000:] + proc.stderr[-5000:]
    codes, seconds = json.loads(result.read_text())
    assert len(codes) == len(runs), codes
    outs = _split(proc.stdout, len(runs))
    errs = _split(proc.stderr, len(runs))
    done = []
    for (_, args), code, out, err, wall in zip(runs, codes, outs, errs, seconds):
        done.append(subprocess.CompletedProcess(["flodl-mpi", *args], code, out, err))
        done[-1].seconds = wall
    return done


def _split(text: str, count: int) -> list[str]:
    parts = []
    for i in range(count):
        start = text.find(MARK.format(i))
        assert start >= 0, f"no marker for run {i}: {text[-3000:]}"
        end = text.find(MARK.format(i + 1))
        parts.append(text[start + len(MARK.format(i)):] if end < 0 else text[start + len(MARK.format(i)):end])
    return parts


def _patched():
    """What tests/hooked_flodl.py's hooks (all but ``--fault``) replace: (owner, attribute) pairs."""
    import threading

    from flodl_mpi.outputs import checkpoint
    from flodl_mpi.policy import policies
    from flodl_mpi.training import stream, worker
    from flodl_mpi.transport import bridge

    return [(bridge.Bridge, "submit"), (policies.CadencePolicy, "observe"), (worker.Trainer, "_train_batch"),
            (checkpoint, "write_checkpoint"), (threading.Thread, "join"), (stream.H5Rows, "_read_into")]


def _main(spec_path: str) -> int:
    sys.path.insert(0, str(ROOT))
    from tests.hooked_flodl import install_hooks

    from flodl_mpi.cli.main import main
    from mpi4py import MPI  # started by the hooks' imports (as under tests/hooked_flodl.py)

    spec = json.loads(Path(spec_path).read_text())
    codes, seconds = [], []
    for i, (hooks, args) in enumerate(spec["runs"]):
        MPI.COMM_WORLD.Barrier()  # the previous run is over on every rank
        rank = MPI.COMM_WORLD.rank
        if rank == 0:
            for stream in (sys.stdout, sys.stderr):
                print(MARK.format(i), file=stream, flush=True)
        saved = [(owner, name, vars(owner)[name]) for owner, name in _patched()]
        rest, at_exit = install_hooks([*hooks, "--", *args])
        t0 = time.monotonic()
        try:
            codes.append(main(rest))
        finally:
            seconds.append(time.monotonic() - t0)
            for fn in at_exit:
                fn()
            for owner, name, value in saved:
                setattr(owner, name, value)
        sys.stdout.flush()
        sys.stderr.flush()
    if MPI.COMM_WORLD.rank == 0:
        Path(spec["result"]).write_text(json.dumps([codes, seconds]))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1]))
