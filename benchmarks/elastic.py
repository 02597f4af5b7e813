"""What a rank's death costs: shrink and go on (ULFM) against stop and restart from the last checkpoint (issue 21).

Run under the Open MPI wheel's environment (its ``mpiexec --with-ft ulfm``; the MPICH wheel
has no fault tolerance, refused with one line)::

    python benchmarks/elastic.py [--epochs 4] [--ranks 3] [--kill-round 20] [--rank 1] [--repeats 1]
                                 [--policy sync] [--window N] [--batch-size 32]

Each repeat makes three runs of the same training (the built-in digits and MLP, the given
policy, ``--epochs`` epochs, a checkpoint every epoch), one after the other:

- ``fault-free``: ``mpiexec --with-ft ulfm -n RANKS flodl-mpi train --on-rank-failure shrink``,
  nothing killed (the baseline; the same launcher and flags as the next run, so the only
  difference is the death);
- ``shrink``: the same, with ``flodl-mpi inject-failure RUN --round K --rank R`` beside it: rank R
  is killed (SIGKILL) once metrics.h5 holds round K, the survivors shrink and finish at RANKS - 1;
- ``restart`` (the peer: what plain MPI gives, and what ``jobs/workstation.sh --restarts 1
  --restart-world-size RANKS-1`` does): ``--on-rank-failure stop`` under the same launcher without
  ``--with-ft``, the same kill; the job ends, and is relaunched at RANKS - 1 ranks with ``--resume
  auto`` from the last checkpoint (the script's restart loop itself, so its costs are the user's).

Per run it reports the wall time (launch to exit, every launch), the final test accuracy
(metrics.h5's last ``epochs`` row) and the rounds in metrics.h5; for ``shrink`` the ledger's row
(metrics.h5 ``membership``: detection ms, recovery ms, the dead rank's steps lost); for
``restart`` the rounds trained twice (the kill's round less the resumed checkpoint's round: the
work since the last checkpoint, redone) and the time from the kill to the relaunch's first round
(train.log's lines). The comparison: the time each run lost to the death (its wall time less the
fault-free run's) and their ratio, restart / shrink. The machine's load is printed beside it: on a
shared 2-core machine RANKS ranks oversubscribe the cores, and the shrunk and restarted worlds of
RANKS - 1 ranks train each batch faster than RANKS did, which both runs gain alike.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.runs import MPIEXEC  # noqa: E402
from benchmarks.runs import _env as _bench_env  # noqa: E402

RUN_TIMEOUT_S = 900.0


def _env() -> dict:
    """The benchmarks' environment (`benchmarks.runs`), less a launcher's leftovers, plus what Open MPI needs."""
    env = {k: v for k, v in _bench_env().items() if not k.startswith(("OMPI_COMM_WORLD", "PMI_", "PMIX_"))}
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.setdefault("OMPI_MCA_osc", "sm")  # one node: the shared-memory one-sided component, silently
    return env


def _is_open_mpi() -> bool:
    out = subprocess.run([MPIEXEC, "--version"], capture_output=True, text=True, check=False, env=_env()).stdout
    return "open mpi" in out.lower() or "open-mpi" in out.lower()


def _launch(ranks: int, train: list[str], ft: bool) -> list[str]:
    flags = ["--oversubscribe", "--bind-to", "none", *(["--with-ft", "ulfm"] if ft else [])]
    return [MPIEXEC, *flags, "-n", str(ranks), sys.executable, "-m", "flodl_mpi", "train", *train]


class Injector:
    """``flodl-mpi inject-failure RUN --round K --rank R`` beside a run; its lines kept with the wall clock
    (``time.time()``) each came at."""

    def __init__(self, run_dir: Path, kill_round: int, rank: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "flodl_mpi", "inject-failure", str(run_dir), "--round",
                                      str(kill_round), "--rank", str(rank), "--timeout", str(RUN_TIMEOUT_S)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))

    def finish(self) -> tuple[float, int]:
        """The kill's wall clock and the round metrics.h5 showed then. Raises RuntimeError: no kill made."""
        self.proc.wait(timeout=60)
        self._reader.join(timeout=10)
        kills = [(t, line) for t, line in self.lines if "SIGKILL to rank" in line]
        if self.proc.returncode != 0 or not kills:
            said = " ".join(line for _, line in self.lines)
            raise RuntimeError(f"the injector made no kill (exit {self.proc.returncode}): {said}")
        t, line = kills[0]
        return t, int(re.search(r"at round (-?\d+)", line).group(1))


def _outcome(run_dir: Path) -> dict:
    from flodl_mpi.outputs.metrics import read_table
    from flodl_mpi.outputs.run_reader import read_membership

    epochs = read_table(run_dir / "metrics.h5", "epochs")
    rounds = read_table(run_dir / "metrics.h5", "rounds")
    return {"test_accuracy": float(epochs["test_accuracy"][-1]), "epochs": int(len(epochs["epoch"])),
            "rounds": int(len(rounds["round"])), "membership": read_membership(run_dir / "metrics.h5")}


def _run(argv: list[str], what: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False, env=_env())
    proc.what = what
    return proc


def fault_free(ranks: int, train: list[str], run_dir: Path) -> dict:
    """The baseline run: no death. Returns wall ``seconds`` and `_outcome`'s keys."""
    t0 = time.monotonic()
    proc = _run(_launch(ranks, [*train, "--on-rank-failure", "shrink", "--run-dir", str(run_dir)], ft=True),
                "fault-free")
    seconds = time.monotonic() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"the fault-free run exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return {"seconds": seconds, **_outcome(run_dir)}


def shrink(ranks: int, train: list[str], run_dir: Path, kill_round: int, rank: int) -> dict:
    """The death under ``--on-rank-failure shrink``: the run goes on at ``ranks - 1``. Adds the ledger's row."""
    injector = Injector(run_dir, kill_round, rank)
    t0 = time.monotonic()
    proc = _run(_launch(ranks, [*train, "--on-rank-failure", "shrink", "--run-dir", str(run_dir)], ft=True),
                "shrink")
    seconds = time.monotonic() - t0
    _, killed_round = injector.finish()
    if proc.returncode != 0:
        raise RuntimeError(f"the shrink run exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    out = {"seconds": seconds, **_outcome(run_dir)}
    (change,) = out["membership"]
    out.update(detection_ms=change.detection_ms, recovery_ms=change.recovery_ms,
               steps_lost=int(sum(change.steps_lost)), world_after=change.world_size, change_round=change.round,
               killed_round=killed_round)
    return out


_RESUMED = re.compile(r"^(\d\d):(\d\d):(\d\d) resuming from \S+: .* round (\d+)$", re.M)


def restart(ranks: int, train: list[str], run_dir: Path, kill_round: int, rank: int) -> dict:
    """The death under ``--on-rank-failure stop`` (no ``--with-ft``): the job ends; one relaunch at ``ranks - 1``
    with ``--resume auto``, as ``jobs/workstation.sh --restarts 1 --restart-world-size ranks-1`` makes it.

    Adds ``redone_rounds`` (the round metrics.h5 showed at the kill less the resumed checkpoint's round: the
    work since the last checkpoint, trained again) and ``down_s`` (from the kill to the relaunch's resume
    line in train.log, whose clock has whole seconds)."""
    injector = Injector(run_dir, kill_round, rank)
    t0 = time.monotonic()
    first = _run(_launch(ranks, [*train, "--on-rank-failure", "stop", "--run-dir", str(run_dir)], ft=False),
                 "restart: first launch")
    killed_at, killed_round = injector.finish()
    if first.returncode == 0:
        raise RuntimeError("the first launch of the restart run finished: the kill came too late")
    second = _run(_launch(ranks - 1, [*train, "--on-rank-failure", "stop", "--run-dir", str(run_dir), "--resume",
                                      "auto"], ft=False), "restart: relaunch")
    seconds = time.monotonic() - t0
    if second.returncode != 0:
        raise RuntimeError(f"the relaunch exited {second.returncode}:\n{second.stderr[-2000:]}")
    out = {"seconds": seconds, **_outcome(run_dir)}
    resumed = _RESUMED.findall((run_dir / "train.log").read_text())
    if not resumed:
        raise RuntimeError(f"{run_dir / 'train.log'} has no resume line")
    h, m, sec, resumed_round = map(int, resumed[-1])
    local = time.localtime(killed_at)
    killed_s = 3600 * local.tm_hour + 60 * local.tm_min + local.tm_sec + (killed_at % 1)
    down = (3600 * h + 60 * m + sec - killed_s) % 86400  # across midnight too
    out.update(redone_rounds=killed_round - resumed_round, down_s=down, killed_round=killed_round)
    return out


def _load() -> float:
    return os.getloadavg()[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--kill-round", type=int, default=20, help="the round at which the rank is killed")
    p.add_argument("--rank", type=int, default=1, help="the rank killed")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--policy", default="sync")
    p.add_argument("--window", type=int)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--json", metavar="FILE", help="also write every run's figures to FILE")
    args = p.parse_args(argv)
    if not _is_open_mpi():
        print("benchmarks/elastic.py: error: needs Open MPI's mpiexec (--with-ft ulfm): run it in the Open MPI "
              "wheel's environment; the MPICH wheel has no fault tolerance", file=sys.stderr)
        return 2
    if not 0 <= args.rank < args.ranks or args.ranks < 2:
        print("benchmarks/elastic.py: error: --rank must be a rank of --ranks (>= 2)", file=sys.stderr)
        return 2
    train = ["--epochs", str(args.epochs), "--policy", args.policy, "--batch-size", str(args.batch_size), "-q",
             *(["--window", str(args.window)] if args.window else [])]
    results = []
    for r in range(args.repeats):
        base = Path(tempfile.mkdtemp(prefix="flodl-elastic-"))
        try:
            load = _load()
            row = {"fault-free": fault_free(args.ranks, train, base / "free"),
                   "shrink": shrink(args.ranks, train, base / "shrink", args.kill_round, args.rank),
                   "restart": restart(args.ranks, train, base / "restart", args.kill_round, args.rank),
                   "load": (load, _load())}
        finally:
            shutil.rmtree(base, ignore_errors=True)
        for name in ("fault-free", "shrink", "restart"):
            row[name].pop("membership")
        results.append(row)
        free, s, rs = row["fault-free"], row["shrink"], row["restart"]
        print(f"repeat {r + 1}: load {row['load'][0]:.1f}-{row['load'][1]:.1f}")
        for name, res in (("fault-free", free), ("shrink", s), ("restart", rs)):
            print(f"  {name:10s} {res['seconds']:7.1f} s  test accuracy {res['test_accuracy']:.4f}  "
                  f"{res['rounds']} rounds in metrics.h5, {res['epochs']} epochs")
        print(f"  shrink:  rank {args.rank} killed at round {s['killed_round']} (the ledger's round "
              f"{s['change_round']}): detection {s['detection_ms']:.0f} ms, "
              f"recovery {s['recovery_ms']:.0f} ms, {s['steps_lost']} step(s) lost, {s['world_after']} ranks go on")
        print(f"  restart: rank {args.rank} killed at round {rs['killed_round']}: {rs['redone_rounds']} round(s) "
              f"since the last checkpoint trained again, {rs['down_s']:.0f} s (+-1) from the kill to the relaunch's resume")
    lost_shrink = [row["shrink"]["seconds"] - row["fault-free"]["seconds"] for row in results]
    lost_restart = [row["restart"]["seconds"] - row["fault-free"]["seconds"] for row in results]
    ms, mr = statistics.median(lost_shrink), statistics.median(lost_restart)
    print(f"time lost to the death (the run's wall time less the fault-free run's; median of {len(results)}): "
          f"shrink {ms:.1f} s, restart {mr:.1f} s" + (f"; ratio restart / shrink {mr / ms:.2f}" if ms > 0 else
                                                      " (shrink lost none: its smaller world ran faster)"))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
