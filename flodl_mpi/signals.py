"""Stop requests from signals: SIGUSR1 (Slurm's ``--signal``), SIGTERM, Ctrl-C.

Invariant: a signal only sets a flag; the next round's control gather carries it
to every rank, so all ranks stop after the same round and save (SPEC §2, §6).
Installed first thing, so a signal during a slow setup is not lost.
"""

from __future__ import annotations

import signal

__all__ = ["StopRequest"]


class StopRequest:
    """A flag that SIGUSR1, SIGTERM and SIGINT set; a second Ctrl-C aborts at once."""

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> None:
        """Handle the stop signals in this process (call from the main thread)."""
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.requested:
            raise KeyboardInterrupt  # impatience: the job aborts
        self.requested = True
