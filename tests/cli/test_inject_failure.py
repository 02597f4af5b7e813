"""``flodl-mpi inject-failure`` and ``R/ranks.json`` without MPI: stand-in "ranks" (sleeping processes this test
starts) recorded as a launch, a synthetic metrics.h5, and the tool run in this process (``main([...])``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from flodl_mpi.cli.main import main
from flodl_mpi.runtime.live_ranks import FILE_NAME, LiveRank, process_start, read_launch, write_launch
from tests._runs import write_synthetic


def _sleepers(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) for _ in range(n)]


def _record(run_dir, procs) -> None:
    write_launch(
        run_dir,
        [
            {"rank": r, "host": socket.gethostname(), "pid": p.pid, "start": process_start(p.pid)}
            for r, p in enumerate(procs)
        ],
    )


@pytest.fixture
def ranks():
    procs = _sleepers(2)
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def test_ranks_json_is_written_whole_and_read_back(tmp_path, ranks):
    _record(tmp_path, ranks)
    assert not [p for p in tmp_path.iterdir() if p.name != FILE_NAME]  # no temporary file left
    launch = read_launch(tmp_path)
    assert launch.world_size == 2 and [r.pid for r in launch.ranks] == [p.pid for p in ranks]
    assert launch.launch == f"{socket.gethostname()}:{ranks[0].pid}:{process_start(ranks[0].pid)}"
    assert [r.rank for r in launch.alive()] == [0, 1]
    (tmp_path / FILE_NAME).write_text("{not json")
    assert read_launch(tmp_path) is None
    assert read_launch(tmp_path / "nowhere") is None


def test_a_rank_is_alive_only_as_the_process_it_was(ranks):
    me = LiveRank(0, socket.gethostname(), ranks[0].pid, process_start(ranks[0].pid))
    assert me.alive()
    assert not LiveRank(0, socket.gethostname(), ranks[0].pid, me.start + 1).alive()  # the pid reused by another
    assert not LiveRank(0, socket.gethostname() + "-elsewhere", ranks[0].pid, me.start).alive()
    ranks[0].kill()
    time.sleep(0.2)  # not reaped yet: a zombie is not alive
    assert not me.alive()
    ranks[0].wait()
    assert not me.alive()


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, ranks):
    _record(tmp_path, ranks)
    before = (tmp_path / FILE_NAME).read_text()
    with pytest.raises(OSError):
        write_launch(tmp_path / "missing-dir", [{"rank": 0, "host": "h", "pid": 1, "start": 1}])
    assert (tmp_path / FILE_NAME).read_text() == before and len(list(tmp_path.iterdir())) == 1


def test_kills_the_chosen_rank_once_the_epoch_has_ended(tmp_path, ranks, capsys):
    write_synthetic(tmp_path, epochs=1)
    _record(tmp_path, ranks)

    def second_epoch():  # the run goes on: more epochs in metrics.h5 a moment later
        time.sleep(0.3)
        write_synthetic(tmp_path / "later", epochs=3)
        os.replace(tmp_path / "later" / "metrics.h5", tmp_path / "metrics.h5")

    grower = threading.Thread(target=second_epoch)
    grower.start()
    t0 = time.monotonic()
    assert main(["inject-failure", str(tmp_path), "--epoch", "2", "--rank", "1", "--timeout", "30"]) == 0
    grower.join()
    assert ranks[1].wait(timeout=10) == -signal.SIGKILL and ranks[0].poll() is None
    assert time.monotonic() - t0 >= 0.3  # not before the epoch came
    out = capsys.readouterr().out
    assert out == (
        f"flodl-mpi inject-failure: kill 1 of 1: SIGKILL to rank 1 (pid {ranks[1].pid}) of 2 at round 19 "
        "(epochs done: 3) as metrics.h5 shows\n"
    )


def test_waits_for_each_launch_and_gives_up_at_the_timeout(tmp_path, ranks, capsys):
    _record(tmp_path, ranks)
    t0 = time.monotonic()
    assert (
        main(["inject-failure", str(tmp_path), "--stage", "setup", "--times", "2", "--seed", "0", "--timeout", "1"])
        == 1
    )
    assert 1.0 <= time.monotonic() - t0 < 5
    captured = capsys.readouterr()
    assert captured.out.count("SIGKILL") == 1  # the one launch there was; the second never came
    assert captured.err == "flodl-mpi inject-failure: --timeout 1 s passed after 1 of 2 kill(s)\n"
    killed = [p for p in ranks if f"(pid {p.pid})" in captured.out]
    assert len(killed) == 1 and killed[0].wait(timeout=10) == -signal.SIGKILL
    assert [p.poll() for p in ranks if p is not killed[0]] == [None]


def test_a_finished_run_ends_the_wait(tmp_path, capsys):
    (tmp_path / "train.log").write_text("12:00:00 epoch 1/1 ...\n12:00:01 done: test accuracy 0.9 after 23 rounds\n")
    assert main(["inject-failure", str(tmp_path), "--round", "5", "--timeout", "30"]) == 1
    assert (
        capsys.readouterr().err == "flodl-mpi inject-failure: the run finished (train.log: done) after 0 of 1 kill(s)\n"
    )


@pytest.mark.parametrize(
    "args, line",
    [
        (["--round", "3", "--rank", "2"], "flodl-mpi inject-failure: error: --rank 2: the run has 2 rank(s)"),
        (
            ["--stage", "setup", "--every", "2"],
            "flodl-mpi inject-failure: error: --every applies to --round and --epoch",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, ranks, capsys, args, line):
    write_synthetic(tmp_path)
    _record(tmp_path, ranks)
    assert main(["inject-failure", str(tmp_path), *args, "--timeout", "10"]) == 2
    assert capsys.readouterr().err == line + "\n"
    assert all(p.poll() is None for p in ranks)  # nothing killed


def test_a_file_for_the_run_dir_is_refused(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    assert main(["inject-failure", str(tmp_path / "f"), "--after", "1"]) == 2
    assert capsys.readouterr().err == f"flodl-mpi inject-failure: error: {tmp_path / 'f'}: not a directory\n"


def test_a_killed_write_of_ranks_json_is_a_stale_temporary_for_the_next_resume(tmp_path):
    from flodl_mpi.outputs.stale_files import stale_temporaries

    (tmp_path / ".ranks.json.tmp-4242").write_text('{"version": 1')
    (tmp_path / FILE_NAME).write_text("{}")
    assert stale_temporaries(tmp_path) == [tmp_path / ".ranks.json.tmp-4242"]
