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
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

from flodl_mpi import (
    bridge,
    checkpoint,
    cli,
    worker,  # noqa: F401  (binds the plain write_checkpoint for the setup's trial save)
)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--stop-at-round", type=int)
    p.add_argument("--save-delay", type=float, default=0.0)
    p.add_argument("--scale-bounded-waits", type=float, default=1.0)
    opts, rest = p.parse_known_args()
    if rest[:1] == ["--"]:
        rest = rest[1:]

    if opts.stop_at_round is not None:
        plain_round = bridge.Bridge.round

        def round_(self, steps, window, stop=False, **kwargs):
            return plain_round(self, steps, window, stop=stop or self.version + 1 == opts.stop_at_round, **kwargs)

        bridge.Bridge.round = round_

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

    return cli.main(rest)


if __name__ == "__main__":
    sys.exit(main())
