"""Kill -9 a live run's ranks from a test: ``flodl-mpi inject-failure`` run beside it, its lines timed.

Test machinery over the product's user tool (:mod:`flodl_mpi.cli.inject_failure`), which finds the
ranks in the run dir's ``ranks.json`` and the moment in its metrics.h5: :func:`start_injector`
starts it on a run dir (before or after the run starts: it waits for both), and :class:`TimedLines`
reads any process's output line by line with the time each line came, so a test can bound how
long the job took to end after each kill.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

__all__ = ["TimedLines", "start_injector", "kill_times"]


class TimedLines:
    """A started process whose stdout and stderr are read as they come: ``lines`` holds
    ``(time.monotonic(), "out" | "err", line)`` in arrival order (per stream)."""

    def __init__(self, argv: list[str], env: dict | None = None) -> None:
        self.started = time.monotonic()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[tuple[float, str, str]] = []
        self._lock = threading.Lock()
        self._readers = [
            threading.Thread(target=self._read, args=(stream, name), daemon=True)
            for stream, name in ((self.proc.stdout, "out"), (self.proc.stderr, "err"))
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, stream, name: str) -> None:
        for line in stream:
            with self._lock:
                self.lines.append((time.monotonic(), name, line.rstrip("\n")))

    def wait(self, timeout: float) -> int:
        """The exit status; the process is killed (and the test fails on the timeout) past ``timeout`` s."""
        try:
            status = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        finally:
            for reader in self._readers:
                reader.join(timeout=10)
            self.proc.stdout.close()
            self.proc.stderr.close()
        return status

    def text(self, stream: str | None = None) -> str:
        """What the process printed (both streams, or ``"out"`` / ``"err"``), one line each."""
        with self._lock:
            return "\n".join(line for _, name, line in self.lines if stream in (None, name))

    def times_of(self, needle: str) -> list[float]:
        """When each line holding ``needle`` came (``time.monotonic()``)."""
        with self._lock:
            return [t for t, _, line in self.lines if needle in line]


def start_injector(run_dir: str | Path, *options: str, env: dict | None = None) -> TimedLines:
    """``python -m flodl_mpi inject-failure RUN_DIR OPTIONS`` (e.g. ``"--epoch", "1", "--times", "3"``), started now."""
    return TimedLines([sys.executable, "-m", "flodl_mpi", "inject-failure", str(run_dir), *options], env=env)


def kill_times(injector: TimedLines) -> list[float]:
    """When the injector said each kill was made (its ``kill K of N: SIGKILL ...`` lines)."""
    return injector.times_of(": SIGKILL to rank ")
