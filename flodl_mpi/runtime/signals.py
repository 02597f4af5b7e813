"""Stop requests from signals: SIGUSR1 (Slurm's ``--signal``), SIGTERM, Ctrl-C (SIGINT).

Invariant: a signal only sets a flag; the next round's control gather carries it
to every rank, so all ranks stop after the same round, save, and exit with
status 4 (``EXIT_STOPPED``; SPEC §2, §6). Installed first thing in the entry
point, before MPI starts and before torch is imported, so a signal during a slow
start-up is kept, not fatal.

Once a stop is under way, further stop signals (a second Ctrl-C included) are
absorbed until the save and the exit are done, said once and counted at the end (a
storm of them is two lines, not one per signal): a preemptible job
that is signalled twice still ends with 4 and is requeued. To end a run at once,
without its save, send SIGKILL.
"""

from __future__ import annotations

import os
import signal

from flodl_mpi.runtime.launcher import launch_env

__all__ = ["StopRequest"]


class StopRequest:
    """A flag that SIGUSR1, SIGTERM and SIGINT set; later stop signals are absorbed.

    Attributes:
        requested: a stop signal arrived.
        signal_name: the first one's name (``"SIGTERM"``...), ``None`` before.
        absorbed: how many further stop signals arrived after the first.
    """

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)

    def __init__(self, resume_hint: str = "--resume") -> None:
        #: How the user continues the run, in their vocabulary (the CLI's flag, the API's keyword).
        self.resume_hint = resume_hint
        self.requested = False
        self.signal_name: str | None = None
        self.absorbed = 0
        self._counted = False  # the count of absorbed signals is said (once, by `close`)
        # Messages come from the process its launcher calls rank 0 only: the
        # launchers (mpiexec, srun, scancel) signal every rank alike.
        env = launch_env()
        self._speak = env.rank == 0
        #: Open MPI's mpiexec answers its own SIGTERM or Ctrl-C, and a rank's death, by
        #: passing SIGTERM on to the ranks and then ending the job itself: the ranks may be
        #: killed before the stop's save, and the launcher returns its own status (1, 137).
        self.launcher_ends_job = env.launcher == "openmpi"

    def install(self) -> None:
        """Handle the stop signals in this process (call from the main thread; again after MPI starts)."""
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)

    def close(self) -> None:
        """The exit status is decided: ignore stop signals from now on (call from the main thread).

        Python's shutdown restores the default action (death by the signal) of
        every signal that has a Python handler, but leaves ignored ones ignored,
        so a late SIGTERM cannot turn a decided exit 4 (or 0) into 15.
        Says how many further stop signals were absorbed, when more than the one already said.
        """
        for sig in self.SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        if self.absorbed > 1 and not self._counted:
            self._counted = True
            self._say(f"{self.absorbed} further stop signals absorbed during the stop (said once, above)")

    def _say(self, text: str) -> None:
        if self._speak:
            try:  # os.write, not print: a handler may run in the middle of a print
                os.write(2, f"flodl-mpi: {text}\n".encode())
            except OSError:
                pass

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if not self.requested:
            self.requested, self.signal_name = True, name
            if self.launcher_ends_job and signum != signal.SIGUSR1:
                self._say(f"{name}: stopping after the current round; the checkpoint is saved if Open MPI's "
                          "launcher lets the ranks finish, then this rank exits with status 4 (under Open MPI a "
                          f"{name} usually means its mpiexec is ending the job: signalled itself, or a rank died; "
                          "it returns its own status, 1 or 137); resume with "
                          f"{self.resume_hint} from the newest complete checkpoint")
                return
            self._say(f"{name}: stopping after the current round; the checkpoint is saved, then the job "
                      f"exits with status 4 (resume with {self.resume_hint})")
            return
        self.absorbed += 1
        if self.absorbed == 1:  # once: a storm of signals is not a line each (issue 26 item 9)
            self._say(f"{name} again: a stop is already under way (saving, then exit status 4); "
                      "signal absorbed, and any more are, silently (SIGKILL ends the run without its save)")
