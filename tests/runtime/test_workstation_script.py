"""jobs/workstation.sh under Open MPI sets OMPI_MCA_osc=sm unless the user chose an osc (trial7 F10).

A stand-in ``mpiexec`` first on PATH answers ``--version`` as the MPI under test and prints what
the script hands it, so no MPI starts."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "jobs" / "workstation.sh"
FAKE = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "$FAKE_MPI_VERSION"; exit 0; fi
echo "osc=${OMPI_MCA_osc-<unset>}"
echo "args=$*"
"""
OPEN_MPI = "mpiexec (Open MPI) 5.0.8"
MPICH = "HYDRA build details:\n    Version:                                 4.3.0"


def _run(tmp_path: Path, version: str, extra: dict | None = None) -> str:
    bin_dir = tmp_path / "prefix" / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    fake = bin_dir / "mpiexec"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PRTE_", "PMIX_"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", HOME=str(home), FAKE_MPI_VERSION=version, **(extra or {}))
    proc = subprocess.run(["bash", str(SCRIPT), "2", "--epochs", "1"], env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[1].endswith("-n 2 flodl-mpi train --epochs 1")
    return proc.stdout.splitlines()[0]


def test_open_mpi_gets_the_shared_memory_osc_when_none_is_chosen(tmp_path):
    assert _run(tmp_path, OPEN_MPI) == "osc=sm"


@pytest.mark.parametrize("value", ["ucx", "pt2pt", ""])
def test_a_users_osc_variable_is_honoured(tmp_path, value):
    assert _run(tmp_path, OPEN_MPI, {"OMPI_MCA_osc": value}) == f"osc={value}"


@pytest.mark.parametrize("where", ["home", "install", "listed"])
def test_an_osc_in_a_parameter_file_is_honoured(tmp_path, where):
    extra = {}
    if where == "home":
        conf = tmp_path / "home" / ".openmpi" / "mca-params.conf"
    elif where == "install":
        conf = tmp_path / "prefix" / "etc" / "openmpi-mca-params.conf"
    else:
        conf = tmp_path / "mine" / "b.conf"
        extra["OMPI_MCA_mca_base_param_files"] = f"{tmp_path / 'mine' / 'a.conf'}:{conf}"
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text("# my settings\n btl = self,vader\n  osc = ucx\n")
    assert _run(tmp_path, OPEN_MPI, extra) == "osc=<unset>"


def test_a_commented_osc_line_chooses_nothing(tmp_path):
    conf = tmp_path / "home" / ".openmpi" / "mca-params.conf"
    conf.parent.mkdir(parents=True)
    conf.write_text("# osc = ucx\n")
    assert _run(tmp_path, OPEN_MPI) == "osc=sm"


def test_mpich_is_left_alone(tmp_path):
    assert _run(tmp_path, MPICH) == "osc=<unset>"
