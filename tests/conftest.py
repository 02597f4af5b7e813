"""Shared test helpers: running ``flodl-mpi`` under mpiexec as a user would."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")


def run_flodl(n: int, *args: str, timeout: float = 240.0, env: dict | None = None) -> subprocess.CompletedProcess:
    """``mpiexec -n N python -m flodl_mpi ARGS`` with a hard timeout; returns the finished process."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        [MPIEXEC, "-n", str(n), sys.executable, "-m", "flodl_mpi", *args],
        capture_output=True, text=True, timeout=timeout, env=full_env,
    )
