"""Where a run's memory goes: one process's resident memory at each line the run logs, and its peak.

Issue 24 item 5 ("the memory the averaging adds"). Runs ``flodl-mpi train`` in this process (a world
of one, no launcher) with the given arguments, samples ``VmRSS`` every 20 ms in a thread, and
prints, for each line the run logs, the seconds since the start and the resident MiB then; then
the peak (``ru_maxrss``) and when it came, so each phase's growth can be read off: torch and the
model, the setup's checks, the epoch's training (gradients, the optimizer's state), the epoch's
end and its checkpoint, the final save::

    python benchmarks/lm/corpus.py /tmp/lm.h5 --train-bytes 20000 --context 128
    python benchmarks/lm/memory_phases.py --model benchmarks/lm/model.py:large --data /tmp/lm.h5 \\
        --epochs 1 --batch-size 4 --optimizer adam --threads 1 --run-dir /tmp/memory-run

(any ``flodl-mpi train`` arguments). Linux only (``/proc/self/status``).
"""

from __future__ import annotations

import logging
import resource
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
INTERVAL_S = 0.02


def resident_mib() -> int:
    """This process's resident memory now (``VmRSS``), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class _Lines(logging.Handler):
    def __init__(self, t0: float) -> None:
        super().__init__()
        self.t0, self.lines = t0, []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((time.monotonic() - self.t0, resident_mib(), record.getMessage()))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    t0 = time.monotonic()
    samples: list[tuple[float, int]] = []

    def sample() -> None:
        while True:
            samples.append((time.monotonic() - t0, resident_mib()))
            time.sleep(INTERVAL_S)

    threading.Thread(target=sample, daemon=True, name="rss-sampler").start()
    lines = _Lines(t0)
    logging.getLogger("flodl_mpi").addHandler(lines)
    from flodl_mpi.cli.main import main as flodl_main

    status = flodl_main(["train", *argv])
    print("\nseconds  resident MiB  line")
    for t, mib, text in lines.lines:
        print(f"{t:7.2f}  {mib:12d}  {text[:100]}")
    at, peak = max(samples, key=lambda s: s[1])
    print(f"peak {peak} MiB at {at:.2f} s (sampled every {INTERVAL_S * 1000:.0f} ms); ru_maxrss "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MiB; exit status {status}")
    return status


if __name__ == "__main__":
    sys.exit(main())
