"""Every code block of README.rst and docs/ runs (tests/docs/snippets.py finds them).

Each page's blocks run in order in a folder of their own that holds two short runs of the built-in
digits, ``runs/A`` and ``runs/B`` (2 epochs at a world of 1, made once): a ``python`` block as a script
in a forked world of 1 (``fork_python``; one with ``:caption: FILE`` is written to FILE first), each
``flodl-mpi`` command of a ``bash`` block through the entry point (``fork_flodl``; ``mpiexec -n N``
before it: at a world of 1 here, at N ranks where the block is marked ``ranks=2``), a ``toml`` block
written to its caption. Install and test commands must be .ci/run's (which runs them)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from tests.conftest import fork_flodl, fork_python, launch_argv, launch_env, run_flodl
from tests.docs.snippets import ROOT, all_blocks, blocks, ci_commands, commands, sources

pytestmark = pytest.mark.slow

SETUP = ("python3", ".", "pip", "sphinx-build", "bash")  # commands only .ci/run runs (a `ci` block)


def _pip_covered(argv: list[str], ci: list[list[str]]) -> bool:
    """A ``pip install`` whose packages and extras a .ci/run pip command installs too."""
    def parts(a):
        pk, extras = set(), set()
        for w in a[2:]:
            m = re.match(r"^\.\[(.*)\]$", w)
            if m:
                extras |= set(m.group(1).split(","))
            elif w != "-e":
                pk.add(w)
        return pk, extras
    want = parts(argv)
    return any(c[:2] == ["pip", "install"] and want[0] <= parts(c)[0] and want[1] <= parts(c)[1] for c in ci)


def _ci_segments() -> list[list[str]]:
    import shlex
    return [shlex.split(part) for cmd in ci_commands() for part in cmd.split("&&")]


def test_every_block_is_a_kind_the_suite_runs():
    """Every block is python, bash or toml; a bash block's setup commands are .ci/run's; a block not run
    here says why, and a block another test runs names a test file that reads it."""
    ci = _ci_segments()
    seen = 0
    for b in all_blocks():
        seen += 1
        assert b.lang in ("python", "bash", "toml"), f"{b.name}: a {b.lang} block: no test runs it"
        if "not-run" in b.marks:
            assert len(b.marks["not-run"]) > 20, f"{b.name}: not-run needs its reason"
            continue
        if "tested-by" in b.marks:
            assert "Keep your loop: the averager" in (ROOT / b.marks["tested-by"]).read_text(), b.name
            continue
        if b.lang != "bash":
            continue
        for argv in commands(b):
            if argv[0] in SETUP:
                covered = argv in ci or (argv[:2] == ["pip", "install"] and _pip_covered(argv, ci))
                assert covered, f"{b.name}: {' '.join(argv)!r} is not a command .ci/run runs"
    assert seen >= 25


PAGES = [p for p in sources() if any("not-run" not in b.marks and "tested-by" not in b.marks for b in blocks(p))]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """runs/A and runs/B: 2 epochs of the built-in digits each, at a world of 1."""
    base = tmp_path_factory.mktemp("doc_runs")
    for name in ("A", "B"):
        proc = fork_flodl("train", "--epochs", "2", "--run-dir", str(base / "runs" / name), "-q")
        assert proc.returncode == 0, proc.stderr[-2000:]
    return base


def _run_command(argv: list[str], block, where) -> subprocess.CompletedProcess | None:
    """One command of a bash block in ``where`` (the cwd); None for a setup command (.ci/run's)."""
    ranks = 1
    if argv[:2] == ["mpiexec", "-n"]:
        ranks, argv = int(argv[2]), argv[3:]
    if argv[0] in SETUP:
        return None
    if block.marks.get("ranks") != "2":
        ranks = 1
    if argv[0] == "flodl-mpi":
        return run_flodl(ranks, *argv[1:]) if ranks > 1 else fork_flodl(*argv[1:])
    if argv[0] == "python":
        if ranks > 1:
            return subprocess.run(launch_argv(ranks, sys.executable, *argv[1:]), capture_output=True, text=True,
                                  timeout=400, env=launch_env(), cwd=where, check=False)
        return fork_python(where / argv[1], *argv[2:], cwd=where)
    raise AssertionError(f"{block.name}: no way to run {' '.join(argv)!r}")


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_the_page_blocks_run(page, two_runs, tmp_path, monkeypatch):
    """The page's blocks, in order, in a folder of their own; each exits 0."""
    shutil.copytree(two_runs / "runs", tmp_path / "runs")
    monkeypatch.chdir(tmp_path)  # the forked and launched runs inherit it
    for b in blocks(page):
        if "not-run" in b.marks or "tested-by" in b.marks:
            continue
        if b.caption:
            (tmp_path / b.caption).write_text(b.text)
        if b.lang == "python":
            script = tmp_path / (b.caption or f"block_{b.line}.py")
            script.write_text(b.text)
            proc = fork_python(script, cwd=tmp_path)
            assert proc.returncode == 0, f"{b.name}:\n{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}"
            if b.marks.get("ranks") == "2":
                proc = _run_command(["mpiexec", "-n", "2", "python", str(script)], b, tmp_path)
                assert proc.returncode == 0, f"{b.name} at 2 ranks:\n{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}"
                assert len(re.findall(r"^epoch \d+: loss", proc.stdout, re.M)) == 3, proc.stdout  # rank 0 prints
        elif b.lang == "bash":
            for argv in commands(b):
                proc = _run_command(argv, b, tmp_path)
                if proc is not None:
                    assert proc.returncode == 0, f"{b.name}: {argv}:\n{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}"
                    if argv[-2:] == ["flodl-mpi", "train"] and b.marks.get("ranks") == "2":
                        _check_first_run(proc)


def _check_first_run(proc):
    """The first run prints what the tutorial shows: 10 epoch lines, 230 rounds, and its last line
    names the accuracy that metrics.h5 holds."""
    from flodl_mpi import read_table

    m = re.search(r"^(?:\d\d:\d\d:\d\d )?done: test accuracy (\d\.\d{4}) after (\d+) rounds; metrics (\S+)/metrics.h5", proc.stdout, re.M)
    assert m, proc.stdout[-2000:]
    assert int(m.group(2)) == 230
    assert re.search(r"^(?:\d\d:\d\d:\d\d )?epoch 10/10  loss \S+  test_loss \S+  test_acc " + re.escape(m.group(1)) + r"  rounds 230 ",
                     proc.stdout, re.M), proc.stdout[-2000:]
    epochs = read_table(f"{m.group(3)}/metrics.h5", "epochs")
    assert abs(epochs["test_accuracy"][-1] - float(m.group(1))) < 5e-5
    assert epochs["per_rank_batches"].shape[1] == 2
