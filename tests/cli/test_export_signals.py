"""flodl-mpi export stopped by SIGTERM or Ctrl-C: the temporary file removed, one line, 128 + the signal;
temporaries a killed export left are removed by the next export of that output (trial7 F8)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from flodl_mpi.outputs.checkpoint import checkpoint_name, write_checkpoint
from flodl_mpi.cli.export import main

#: ``python -c`` body: torch.save writes the whole temporary file, then the process signals itself, so the
#: signal lands while the temporary file exists and before its rename, every time.
SIGNAL_IN_SAVE = textwrap.dedent("""
    import os, signal, sys
    import torch
    SIG = getattr(signal, sys.argv[1])
    plain = torch.save
    def save(obj, f, *args, **kwargs):
        plain(obj, f, *args, **kwargs)
        os.kill(os.getpid(), SIG)
        for _ in range(100):   # the handler runs at the next bytecode; never returns normally
            pass
    torch.save = save
    from flodl_mpi.cli.main import main
    sys.argv = ["flodl-mpi", "export", *sys.argv[2:]]
    sys.exit(main())
""")


def _checkpoint(tmp_path):
    params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    return write_checkpoint(tmp_path / checkpoint_name(1, 3), params, {}, {"epoch": 1, "round": 3}, ["w"])


def _dead_pid() -> int:
    """The id of a process that has ended (and was reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("sig, status", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_stop_signal_removes_the_temp_file_one_line_no_traceback(tmp_path, sig, status):
    ckpt = _checkpoint(tmp_path)
    out = tmp_path / "exp" / "m.pt"
    out.parent.mkdir()
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", SIGNAL_IN_SAVE, sig, str(ckpt), str(out)],
                          capture_output=True, text=True, check=False, timeout=120)
    assert time.monotonic() - start < 60
    assert proc.returncode == status, proc.stderr
    assert proc.stderr == f"flodl-mpi export: {sig}: stopped; {out} not written (its temporary file removed)\n"
    assert proc.stdout == ""
    assert sorted(os.listdir(out.parent)) == []  # no .m.pt.tmp-*, no m.pt


def test_a_later_export_removes_the_temps_a_killed_export_left_and_keeps_live_ones(tmp_path, capsys):
    ckpt = _checkpoint(tmp_path)
    out = tmp_path / "m.pt"
    host, dead = socket.gethostname(), _dead_pid()
    stale = [tmp_path / f".m.pt.tmp-{host}-{dead}", tmp_path / f".m.pt.tmp-{dead}"]  # this and an older flodl-mpi
    live = tmp_path / f".m.pt.tmp-{host}-{os.getppid()}"   # a process alive on this host: maybe an export running
    elsewhere = tmp_path / f".m.pt.tmp-another-node-{dead}"  # its process cannot be checked from here
    other_name = tmp_path / f".n.pt.tmp-{host}-{dead}"      # another output's
    for p in (*stale, live, elsewhere, other_name):
        p.write_bytes(b"partial")
    assert main([str(ckpt), str(out)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert not any(p.exists() for p in stale)
    assert live.exists() and elsewhere.exists() and other_name.exists()
    assert out.is_file()
    assert err[0] == (f"flodl-mpi export: removed {', '.join(sorted(p.name for p in stale))}: left by an export of "
                      f"{out} that was killed")
    left = ", ".join(sorted([elsewhere.name, live.name]))
    assert err[1].startswith(f"flodl-mpi export: note: left {left} in place: its writer may be another export "
                             "still running")
    assert len(err) == 2


def test_a_refused_output_removes_no_temp(tmp_path, capsys):
    ckpt = _checkpoint(tmp_path)
    out = tmp_path / "m.pt"
    out.write_bytes(b"mine")
    stale = tmp_path / f".m.pt.tmp-{socket.gethostname()}-{_dead_pid()}"
    stale.write_bytes(b"partial")
    assert main([str(ckpt), str(out)]) == 2  # exists, no --force: nothing touched
    assert capsys.readouterr().err == f"flodl-mpi export: error: {out} exists; not replaced (pass --force to replace it)\n"
    assert stale.exists() and out.read_bytes() == b"mine"


def test_the_signal_handlers_are_restored(tmp_path):
    ckpt = _checkpoint(tmp_path)
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    assert main([str(ckpt), str(tmp_path / "m.pt")]) == 0
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
