"""``flodl-mpi`` with test hooks, run under mpiexec by the tests (never by users).

    mpiexec -n 2 python tests/hooked_flodl.py [HOOKS] -- train --epochs 2 ...

Hooks (each patches the package in this process only):
  --stop-at-round N     the cohort stops after round N, as if SIGUSR1 had come
                        just before it: deterministic, where a signal is not.
  --save-delay S        every checkpoint the writer thread saves takes S more seconds
                        (not the trial save at setup).
  --scale-bounded-waits F
                        every ``Thread.join(timeout)`` waits timeout / F: a bound
                        of 30 s becomes 30 / F, so a test can outlast it quickly.
  --script-speeds A,B,...
                        the balancer reads rank r's ms per batch as 10 * SPEED[r]
                        (a rank that ran no batch: none), whatever the clock says:
                        timing-driven quotas become a function of the round.
  --script-round-ms X   ... and each round's overhead time as X ms.
  --record-indices DIR  each rank writes DIR/rank<r>.npz at exit: per epoch, the
                        training sample indices it read (``e<epoch>``), in order.
  --count-reads DIR     each rank writes DIR/reads<r>.npz at exit: every read of a streamed
                        dataset (--data-loading stream), in order: its rows
                        (``rows``, start and stop), its dataset (``train``: 1 for the
                        training features) and whether the read-ahead thread made it.
  --dump-final DIR      each rank writes DIR/final<launch rank>.npz at exit: its final
                        parameters (``p<i>``, named_parameters order), and per batch
                        it trained ``trained``: (epoch, global batch, round then).
  --dump-state DIR      each rank writes DIR/rank<r>.npz when its training ends:
                        its model's state dict (name -> array) as it holds it.
  --fault KIND@RANK:ROUND
                        inject that fault (tests/faults.py) on the product's hooks
                        (flodl_mpi.runtime.hooks): e.g. ``bridge@1:3``.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

from flodl_mpi.transport import bridge
from flodl_mpi.outputs import checkpoint
from flodl_mpi.cli import main as cli
from flodl_mpi.training import worker  # noqa: F401  (binds the plain write_checkpoint for the setup's trial save)


def install_hooks(argv: list[str]) -> tuple[list[str], list]:
    """Install the hooks ``argv`` names (the options above, then ``--`` and flodl-mpi's arguments) in this
    process; returns flodl-mpi's arguments and what to call at exit (:func:`main` registers it with
    :mod:`atexit`; ``tests.conftest.fork_flodl``'s child calls it before its ``os._exit``)."""
    at_exit = []
    p = argparse.ArgumentParser(prog="hooked_flodl")
    p.add_argument("--stop-at-round", type=int)
    p.add_argument("--save-delay", type=float, default=0.0)
    p.add_argument("--scale-bounded-waits", type=float, default=1.0)
    p.add_argument("--script-speeds")
    p.add_argument("--script-round-ms", type=float)
    p.add_argument("--record-indices")
    p.add_argument("--dump-final")
    p.add_argument("--count-reads")
    p.add_argument("--fault")
    p.add_argument("--dump-state")
    opts, rest = p.parse_known_args(argv)
    if rest[:1] == ["--"]:
        rest = rest[1:]

    if opts.fault is not None:
        try:
            from tests.faults import install, parse_fault  # imported as tests.hooked_flodl (fork_flodl)
        except ImportError:
            from faults import install, parse_fault  # run as a script: its folder, tests/, is sys.path[0]

        try:
            fault = parse_fault(opts.fault)
        except ValueError as exc:
            p.error(str(exc))
        install(fault)

    if opts.stop_at_round is not None:
        plain_submit = bridge.Bridge.submit  # round() submits too

        def submit(self, steps, window, stop=False, *args, **kwargs):
            return plain_submit(self, steps, window, stop or self.version + 1 == opts.stop_at_round, *args, **kwargs)

        bridge.Bridge.submit = submit

    if opts.script_speeds is not None or opts.script_round_ms is not None:
        import dataclasses

        import numpy as np

        from flodl_mpi.policy import policies as policy

        speeds = None if opts.script_speeds is None else np.array([float(v) for v in opts.script_speeds.split(",")])
        plain_observe = policy.CadencePolicy.observe

        def observe(self, facts):
            changes = {}
            if speeds is not None:
                changes["batch_ms"] = np.where(np.isfinite(facts.batch_ms), 10.0 * speeds[: len(facts.batch_ms)],
                                               np.nan)
            if opts.script_round_ms is not None and np.isfinite(facts.round_ms):
                changes["round_ms"] = opts.script_round_ms
            return plain_observe(self, dataclasses.replace(facts, **changes))

        policy.CadencePolicy.observe = observe

    if opts.record_indices is not None:
        from pathlib import Path

        import numpy as np

        from flodl_mpi.training.data import batch_indices

        read: dict[str, list] = {}
        plain_batch = worker.Trainer._train_batch

        def train_batch(self, perm, b, epoch, report, *args):
            idx = batch_indices(perm, self.cfg.step_samples, b, self.cfg.drop_last)
            read.setdefault(f"e{epoch}", []).append(np.asarray(idx))
            read["rank"] = [np.array([self.rank])]
            return plain_batch(self, perm, b, epoch, report, *args)

        worker.Trainer._train_batch = train_batch

        def dump():
            if "rank" in read:  # a rank that read nothing writes nothing
                out = Path(opts.record_indices)
                out.mkdir(parents=True, exist_ok=True)
                np.savez(out / f"rank{int(read['rank'][0][0])}.npz", **{k: np.concatenate(v) for k, v in read.items()})

        at_exit.append(dump)

    if opts.dump_final is not None:
        from pathlib import Path

        import numpy as np
        from mpi4py import MPI

        trained: list[tuple[int, int, int]] = []
        held: list = []
        plain_step = worker.Trainer._train_batch

        def train_batch_seen(self, perm, b, epoch, report, *args):
            trained.append((epoch, int(b), self.bridge.version))
            held[:] = [self]
            return plain_step(self, perm, b, epoch, report, *args)

        worker.Trainer._train_batch = train_batch_seen

        def dump_final():
            if held:
                out = Path(opts.dump_final)
                out.mkdir(parents=True, exist_ok=True)
                params = {f"p{i}": p.detach().cpu().numpy() for i, p in enumerate(held[0].replica.params)}
                np.savez(out / f"final{MPI.COMM_WORLD.rank}.npz", trained=np.array(trained, np.int64), **params)

        at_exit.append(dump_final)

    if opts.count_reads is not None:
        from pathlib import Path

        import numpy as np
        from mpi4py import MPI

        from flodl_mpi.training import stream

        reads: list[tuple] = []
        plain_read = stream.H5Rows._read_into

        def read_into(self, out, start, stop):
            ahead = threading.current_thread().name == "flodl-read-ahead"
            reads.append((start, stop, int(self._ds.name == "/train/x"), int(ahead)))
            return plain_read(self, out, start, stop)

        stream.H5Rows._read_into = read_into

        def dump_reads():
            out = Path(opts.count_reads)
            out.mkdir(parents=True, exist_ok=True)
            table = np.array(reads, dtype=np.int64).reshape(-1, 4)
            np.savez(out / f"reads{MPI.COMM_WORLD.rank}.npz", rows=table[:, :2], train=table[:, 2],
                     ahead=table[:, 3])

        at_exit.append(dump_reads)

    if opts.dump_state is not None:
        from pathlib import Path

        import numpy as np

        plain_fit = worker.Trainer.fit

        def fit(self, *args, **kwargs):
            history = plain_fit(self, *args, **kwargs)
            out = Path(opts.dump_state)
            out.mkdir(parents=True, exist_ok=True)
            state = {k: v.detach().cpu().numpy() for k, v in self.replica.model.state_dict().items()}
            np.savez(out / f"rank{self.rank}.npz", **state)
            return history

        worker.Trainer.fit = fit

    if opts.save_delay:
        plain_write = checkpoint.write_checkpoint

        def slow_write(*args, **kwargs):
            time.sleep(opts.save_delay)
            return plain_write(*args, **kwargs)

        checkpoint.write_checkpoint = slow_write  # the writer thread calls it through the module

    if opts.scale_bounded_waits != 1.0:
        plain_join = threading.Thread.join

        def join(self, timeout=None):
            return plain_join(self, None if timeout is None else timeout / opts.scale_bounded_waits)

        threading.Thread.join = join

    return rest, at_exit


def main() -> int:
    import atexit

    rest, at_exit = install_hooks(sys.argv[1:])
    for fn in at_exit:
        atexit.register(fn)
    return cli.main(rest)


if __name__ == "__main__":
    sys.exit(main())
