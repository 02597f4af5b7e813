"""Under Open MPI's mpiexec a SIGTERM or Ctrl-C ends the job with the launcher's own status: the stop line and
train.log's last line say that this rank exits 4 and the launcher's status may differ (trial7 F10)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from flodl_mpi.config import TrainConfig
from flodl_mpi.runtime.signals import StopRequest
from flodl_mpi.training.run import stop_hint as _stop_hint
from flodl_mpi.training.train import final_line

OPEN_MPI = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}
HYDRA = {"PMI_RANK": "0", "PMI_SIZE": "2", "HYDI_CONTROL_FD": "7"}


def _stop(monkeypatch, env: dict) -> StopRequest:
    for name in (*OPEN_MPI, *HYDRA, "PMIX_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return StopRequest()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_open_mpi_sigterm_and_ctrl_c_say_the_launchers_status_may_differ(monkeypatch, capfd, sig):
    stop = _stop(monkeypatch, OPEN_MPI)
    stop._handle(sig, None)
    err = capfd.readouterr().err
    name = signal.Signals(sig).name
    assert err == (f"flodl-mpi: {name}: stopping after the current round; the checkpoint is saved if Open MPI's "
                   "launcher lets the ranks finish, then this rank exits with status 4 (under Open MPI a "
                   f"{name} usually means its mpiexec is ending the job: signalled itself, or a rank died; it "
                   "returns its own status, 1 or 137); resume with --resume from the newest complete checkpoint\n")
    hint = _stop_hint(stop, Path("R"))
    line = final_line(TrainConfig(epochs=3), False, [], 0, Path("R"), stop_hint=hint)
    assert line == (f"stopped, not done (3 epochs asked); this rank exits with status 4; Open MPI's launcher, which "
                    f"passes a {name} on and ends the job itself, may return its own status (1): to go on, run "
                    "the same command with --resume --run-dir R")


@pytest.mark.parametrize("env, sig", [(OPEN_MPI, signal.SIGUSR1), (HYDRA, signal.SIGTERM), (HYDRA, signal.SIGINT),
                                      ({}, signal.SIGTERM)])
def test_where_the_ranks_status_is_the_jobs_the_lines_say_exit_4(monkeypatch, capfd, env, sig):
    stop = _stop(monkeypatch, env)
    stop._handle(sig, None)
    name = signal.Signals(sig).name
    assert capfd.readouterr().err == (f"flodl-mpi: {name}: stopping after the current round; the checkpoint is "
                                      "saved, then the job exits with status 4 (resume with --resume)\n")
    assert _stop_hint(stop, Path("R")) is None
    assert final_line(TrainConfig(epochs=3), False, [], 0, Path("R"), stop_hint=None) == (
        "stopped, not done (3 epochs asked); exit status 4: to go on, run the same command with --resume "
        "--run-dir R")
