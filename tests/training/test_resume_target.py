"""A plain ``--resume`` never starts a run; ``--resume auto`` is the requeue's "resume, or start" (issue 26 item 1).

The CLI's refusals come before MPI starts (cheap launches: no torch is loaded); ``fit``'s and the
``Averager``'s in one process per rank (the multi-rank stage), the survey's refusal of a run dir whose
only checkpoint is damaged included.
"""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from flodl_mpi.errors import EXIT_INPUT
from tests.conftest import launch_env, run_flodl

#: Seconds a refusal made before MPI starts may take here (a loaded machine: no torch import, no training).
PROMPT_S = 60.0


def _snapshot(root: Path) -> dict:
    """Every path under ``root`` with its bytes and modification time (a file), or None (a directory)."""
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns) if p.is_file() else None
            for p in sorted(root.rglob("*"))}


def _stopped_before_its_first_checkpoint(run_dir: Path) -> None:
    """A run dir as a run killed before its first checkpoint leaves it, and a stale temporary file
    (which a resume that goes on would remove: its presence after the refusal shows nothing was cleaned)."""
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.json").write_text('{"epochs": 3}\n')
    (run_dir / "train.log").write_text("12:00:00 epoch 1/3 ...\n")
    (run_dir / "metrics.h5").write_bytes(b"not read")
    (run_dir / ".lock").write_bytes(b"")
    (run_dir / "checkpoints" / "ckpt-e000001-r000023.h5.tmp-1").write_bytes(b"a killed write")


def _error_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if "error:" in line]


def test_a_plain_resume_of_a_missing_run_dir_is_refused_before_mpi_and_creates_nothing(tmp_path):
    """issue 26 item 1: was exit 0, a new run trained in the misspelled directory."""
    typo = tmp_path / "runs" / "7"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "flodl_mpi", "train", "--run-dir", str(typo), "--resume"],
                          capture_output=True, text=True, timeout=PROMPT_S, env=launch_env(), check=False)
    assert time.monotonic() - t0 < PROMPT_S
    assert proc.returncode == EXIT_INPUT, proc.stdout + proc.stderr[-2000:]
    assert _error_lines(proc) == [
        f"flodl-mpi: error: --resume: --run-dir '{typo}' does not exist, so there is no run to continue; check "
        "the path, or use --resume auto to start the run when it has none (a requeued job's first start)"]
    assert "loading PyTorch" not in proc.stdout and "Traceback" not in proc.stderr  # refused before MPI and torch
    assert not (tmp_path / "runs").exists()


def test_a_plain_resume_of_a_run_dir_without_a_checkpoint_is_refused_on_every_rank_and_touches_nothing(tmp_path):
    """issue 26 item 1: a run killed before its first checkpoint (a requeue's run dir, resumed by hand)."""
    run_dir = tmp_path / "r"
    _stopped_before_its_first_checkpoint(run_dir)
    before = _snapshot(run_dir)
    t0 = time.monotonic()
    proc = run_flodl(2, "train", "--run-dir", str(run_dir), "--resume", timeout=PROMPT_S)
    assert time.monotonic() - t0 < PROMPT_S
    assert proc.returncode == EXIT_INPUT, proc.stdout + proc.stderr[-2000:]
    assert _error_lines(proc) == [  # one line, from the launcher's rank 0
        f"flodl-mpi: error: --resume: --run-dir '{run_dir}' holds no checkpoint (nothing in its checkpoints/), so "
        "there is nothing to continue and nothing in it was touched; check the path, or use --resume auto to "
        "start the run when it has none (a requeued job's first start)"]
    assert "loading PyTorch" not in proc.stdout
    assert _snapshot(run_dir) == before  # the stale temporary file too: no clean-up ran, train.log unchanged


def test_resume_auto_is_the_config_files_and_the_flags_spelling(tmp_path):
    """issue 26 item 1: ``--resume auto`` / ``resume = "auto"``; anything else is refused naming the key."""
    from flodl_mpi.cli.main import build_parser, config_from_args
    from flodl_mpi.config import ConfigError

    def cfg(*argv):
        return config_from_args(build_parser().parse_args(["train", "--run-dir", "r", *argv]))

    assert cfg("--resume").resume is True and cfg("--resume", "auto").resume == "auto"
    assert cfg("--resume=auto").resume == "auto" and cfg().resume is False
    toml = tmp_path / "run.toml"
    toml.write_text('resume = "auto"\n')
    assert cfg("--config", str(toml)).resume == "auto"
    assert cfg("--config", str(toml), "--resume").resume is True  # the flag overrides the file
    toml.write_text('resume = "yes"\n')
    with pytest.raises(ConfigError, match=f"--config '{toml}': key 'resume': 'yes': must be true, false or 'auto'"):
        cfg("--config", str(toml))


# ---- fit and the Averager: the same rule, in one process per rank -------------------------------------------

@pytest.mark.mpi
def test_fit_and_the_averager_refuse_a_plain_resume_with_nothing_to_continue_and_auto_starts():
    """issue 26 item 1 (and item 9's refused resume: nothing written to train.log)."""
    import tempfile

    import torch
    from mpi4py import MPI
    from torch import nn

    import flodl_mpi
    from flodl_mpi.errors import InputError

    comm = MPI.COMM_WORLD
    root = Path(comm.bcast(tempfile.mkdtemp(prefix="flodl-resume-") if comm.rank == 0 else None, root=0))
    missing, empty, damaged, fresh = (root / n for n in ("missing", "empty", "damaged", "fresh"))
    if comm.rank == 0:
        _stopped_before_its_first_checkpoint(empty)
        _stopped_before_its_first_checkpoint(damaged)
        (damaged / "checkpoints" / "ckpt-e000001-r000023.h5").write_bytes(b"\x89HDF\r\n\x1a\n truncated")
    comm.Barrier()
    before = {d: _snapshot(d) for d in (empty, damaged)} if comm.rank == 0 else None
    x, y = torch.rand(32, 4), torch.randint(0, 3, (32,))
    t0 = time.monotonic()
    with pytest.raises(InputError) as refused:
        flodl_mpi.fit(lambda: nn.Linear(4, 3), data={"train": (x, y), "test": (x, y)}, epochs=1, batch_size=8,
                      run_dir=missing, resume=True)
    assert str(refused.value) == (
        f"resume=True: run_dir='{missing}' does not exist, so there is no run to continue; check the path, or use "
        "resume='auto' to start the run when it has none (a requeued job's first start)")
    with pytest.raises(InputError, match=f"^resume=True: run_dir='{empty}' holds no checkpoint"):
        flodl_mpi.Averager(nn.Linear(4, 3), run_dir=empty, resume=True)
    with pytest.raises(InputError) as refused:  # passes the names, not the survey: refused before any rename
        flodl_mpi.Averager(nn.Linear(4, 3), run_dir=damaged, resume=True)
    assert str(refused.value) == (
        f"resume=True: every checkpoint in {damaged / 'checkpoints'} is damaged (ckpt-e000001-r000023.h5; flodl-mpi "
        f"inspect FILE says why), so there is nothing to continue and nothing in {damaged} was touched; use "
        "resume='auto' to start the run again from epoch 1 (keeping them as *.damaged)")
    assert time.monotonic() - t0 < 120
    assert not missing.exists()
    if comm.rank == 0:
        assert {d: _snapshot(d) for d in (empty, damaged)} == before  # train.log unchanged, nothing renamed
    comm.Barrier()

    with flodl_mpi.Averager(nn.Linear(4, 3), run_dir=fresh, resume="auto") as avg:
        assert avg.epoch == 0
    if comm.rank == 0:
        log = (fresh / "train.log").read_text().splitlines()
        assert log[0].split(" ", 1)[1] == f"no checkpoint in {fresh}: starting a new run", log
        assert sum("no checkpoint in" in line for line in log) == 1
    comm.Barrier()
    if comm.rank == 0:
        import shutil

        shutil.rmtree(root, ignore_errors=True)

