"""Rank 0's progress output: a bar on a terminal (also through mpiexec), one line per epoch in a pipe."""

from __future__ import annotations

import io
import os
import pty
import re
import select
import subprocess
import sys
import time

import pytest

from flodl_mpi.training.progress import EpochProgress, bar_columns, stdout_is_terminal, terminal_columns
from tests.conftest import MPIEXEC, fork_flodl, launch_argv, launch_env

EPOCH_LINE = re.compile(r"^\d\d:\d\d:\d\d epoch (\d+)/(\d+)  loss ", re.MULTILINE)


def test_bar_shows_batches_loss_rounds_per_second_and_eta():
    pytest.importorskip("tqdm")
    out = io.StringIO()
    bar = EpochProgress(enabled=True, stream=out, mininterval=0)
    bar.start("epoch 2/5", total=40, done=0, rounds=7)
    for k in range(1, 5):
        time.sleep(0.01)
        bar.update(10 * k, 0.5, 7 + k)
    bar.close()
    text = out.getvalue()
    assert "epoch 2/5" in text and "40/40" in text and "loss 0.5000" in text
    assert re.search(r"\d+\.\d rounds/s", text) and "batch/s" in text and "<" in text   # tqdm's ETA
    assert "\r" in text


def test_a_log_line_during_an_epoch_goes_above_the_bar_not_into_it(monkeypatch):
    """A mid-epoch line (a quarantine, a warning) is printed on a line of its own while the bar is drawn."""
    import logging

    from flodl_mpi.training.train_log import log, log_to_stdout

    pytest.importorskip("tqdm")
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    before = list(log.handlers)
    # The handler leaves with the test: it is added to a copy of the list, and the list itself is put back at
    # teardown. (Patched after it was added, the list put back was the one it had been appended to: a handler
    # writing to this test's StringIO stayed, and a later run in this process or forked from it, which adds
    # its stdout handler only when none is there, printed its log lines into it.)
    monkeypatch.setattr(log, "handlers", list(before))
    log_to_stdout(0, 0)  # rank 0's stdout handler, as `flodl-mpi train` installs it
    (handler,) = [h for h in log.handlers if h not in before]
    monkeypatch.setattr(log, "handlers", before)  # the lines below are emitted through the handler directly
    line = "round 3: rank(s) 1 had a non-finite loss or NaN/Inf parameters: quarantined (mass 0)"
    record = logging.LogRecord("flodl_mpi", logging.INFO, __file__, 1, line, None, None)
    bar = EpochProgress(enabled=True, stream=out, mininterval=0)
    bar.start("epoch 1/3", total=10, done=0, rounds=0)
    bar.update(4, 0.5, 3)
    handler.emit(record)
    bar.update(6, 0.5, 4)
    bar.close()
    handler.emit(record)  # no bar: a plain line
    segments = re.split(r"[\r\n]", out.getvalue())
    whole = [seg for seg in segments if re.fullmatch(r"\d\d:\d\d:\d\d " + re.escape(line), seg)]
    assert len(whole) == 2, segments                                # whole lines, never glued to the bar
    assert out.getvalue().endswith(line + "\n")


def test_disabled_bar_writes_nothing_and_imports_no_tqdm():
    out = io.StringIO()
    bar = EpochProgress(enabled=False, stream=out)
    bar.start("epoch 1/1", total=3)
    bar.update(3, 0.1, 1)
    bar.close()
    assert out.getvalue() == ""
    code = ("import sys; from flodl_mpi.training.progress import EpochProgress; b = EpochProgress(False); "
            "b.start('x', 3); b.update(3, 0.1, 1); b.close(); assert 'tqdm' not in sys.modules")
    assert subprocess.run([sys.executable, "-c", code], check=False, timeout=60).returncode == 0


def test_stdout_is_terminal_for_a_pty_not_for_a_pipe():
    master, slave = os.openpty()
    try:
        with open(slave, "w", closefd=False) as tty:
            assert stdout_is_terminal(tty)
    finally:
        os.close(master)
        os.close(slave)
    r, w = os.pipe()
    try:
        with open(w, "w", closefd=False) as pipe:
            assert not stdout_is_terminal(pipe)   # our parent is pytest, not an MPI launcher
    finally:
        os.close(r)
        os.close(w)


def _set_columns(fd: int, columns: int) -> None:
    import fcntl
    import struct
    import termios

    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))


def test_the_bar_is_as_wide_as_the_terminal_and_ten_characters_when_that_is_unknown(monkeypatch):
    """issue 26 item 9: under mpiexec the width was shutil's fallback, 80 columns, and the bar one character.

    The terminal's width is asked of the device itself (the launcher's, for a rank); unknown
    (no terminal, no $COLUMNS): tqdm's 10-character bar, the line as long as it needs."""
    pytest.importorskip("tqdm")
    monkeypatch.delenv("COLUMNS", raising=False)
    master, slave = os.openpty()
    try:
        _set_columns(slave, 137)
        assert terminal_columns(os.ttyname(slave)) == 137       # the launcher's terminal, by its name
        with open(slave, "w", closefd=False) as tty:
            assert bar_columns(tty) == 137
    finally:
        os.close(master)
        os.close(slave)
    out = io.StringIO()
    assert bar_columns(out) is None                              # not a terminal, not a launcher's pipe
    bar = EpochProgress(enabled=True, stream=out, mininterval=0)
    bar.start("epoch 3/10", total=45, done=0, rounds=0)
    bar.update(20, 0.4321, 12)
    bar.close()
    drawn = [seg for seg in re.split(r"[\r\n]", out.getvalue()) if "20/45" in seg]
    assert drawn and all(re.search(r" 44%\|[#0-9 ]{10}\| 20/45 ", seg) for seg in drawn), drawn
    assert "rounds/s]" in drawn[-1]                              # the postfix whole, not cut at 80 columns
    monkeypatch.setenv("COLUMNS", "123")
    assert bar_columns(io.StringIO()) == 123


def _train_in_pty(args: list[str], timeout: float = 300, columns: int = 150, ranks: int = 1) -> tuple[int, str]:
    """Run ``mpiexec -n RANKS flodl-mpi train ARGS`` with a pseudo-terminal ``columns`` wide as its stdout and
    stderr (no $COLUMNS: the width is the terminal's own)."""
    master, slave = pty.openpty()
    _set_columns(slave, columns)
    # one torch thread, as each of 2 ranks has on this 2-core machine (a lone rank would take both cores)
    env = {**{k: v for k, v in launch_env().items() if k != "COLUMNS"}, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(launch_argv(ranks, sys.executable, "-m", "flodl_mpi", "train", *args),
                            env=env, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:   # EIO: every writer closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    else:
        proc.kill()
    os.close(master)
    return proc.wait(timeout=60), b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
def test_terminal_gets_a_bar_through_mpiexec(tmp_path):
    """A real launch (``mpiexec -n 1``; was 2 ranks): the bar is rank 0's alone, and what it needs is the
    launcher between the rank and the terminal (the rank's stdout is the launcher's pipe; the width is
    asked of the launcher's terminal), which one rank has as two do."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    # Batches of 2 on 1 rank: an epoch of 719 rounds (1437 / 2) lasts well past the bar's 0.25 s redraw
    # interval (at batch 8 a quiet machine ran its 180 rounds in 0.2 s, within it: no redraw).
    rc, out = _train_in_pty(["--run-dir", str(tmp_path / "r"), "--epochs", "2", "--batch-size", "2"])
    assert rc == 0, out
    assert "\r" in out and "batch/s" in out and "rounds/s" in out and "loss " in out
    assert re.search(r"epoch 1/2: +\d+%", out), out          # the bar's description and percentage
    # issue 26 item 9: the rank learns the launcher's terminal width (150), not shutil's 80
    bars = [seg for seg in re.split(r"[\r\n]", out) if re.search(r"epoch 1/2: +\d+%\|", seg)]
    assert bars and all(len(seg.strip("\x1b[A ")) <= 150 for seg in bars), bars
    assert any(len(seg.rstrip()) > 100 and re.search(r"\|[^|]{20,}\|", seg) for seg in bars), bars
    assert [m.group(1) for m in EPOCH_LINE.finditer(out.replace("\r", "\n"))] == ["1", "2"]


@pytest.mark.slow
def test_pipe_gets_one_line_per_epoch_and_says_what_happens(tmp_path):
    """A world of 1 in a fork (was a 2-rank launch): its stdout is a file, not a terminal, which rank 0 treats
    as a pipe (`stdout_is_terminal`: test_stdout_is_terminal_for_a_pty_not_for_a_pipe); the lines are rank 0's.
    Through a launcher's pipe at 2 ranks (its first line "2 rank(s) up", no bar):
    tests/cli/test_cli.py::test_a_warning_is_printed_once."""
    proc = fork_flodl("train", "--run-dir", str(tmp_path / "r"), "--epochs", "2", "-v", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "\r" not in out and "batch/s" not in out
    assert [m.group(1) for m in EPOCH_LINE.finditer(out)] == ["1", "2"]
    lines = out.splitlines()
    # start-up and shutdown each say what they are doing before the slow part
    assert lines[0] == "flodl-mpi: 1 rank(s) up; loading PyTorch"
    finishing = next(i for i, line in enumerate(lines) if " finishing: writing the last checkpoint" in line)
    assert finishing < next(i for i, line in enumerate(lines) if " done: " in line)
    assert sum(" per rank: r0 " in line for line in lines) == 2                      # -v: a detail line per epoch
    log = (tmp_path / "r" / "train.log").read_text()
    assert " per rank: " not in log and len(EPOCH_LINE.findall(log)) == 2             # train.log: the default lines


@pytest.mark.slow
def test_quiet_prints_nothing_on_success(tmp_path):
    """A world of 1 in a fork (was a 2-rank launch): only rank 0 prints, and -q silences it (the other ranks'
    copies never reaching the console: tests/cli/test_cli.py::test_a_warning_is_printed_once)."""
    proc = fork_flodl("train", "--run-dir", str(tmp_path / "r"), "--epochs", "1", "-q", "--progress", "bar",
                      timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    assert len(EPOCH_LINE.findall((tmp_path / "r" / "train.log").read_text())) == 1
