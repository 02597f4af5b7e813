#!/usr/bin/env bash
# .ci/run's Slurm stage: bash tests/slurm/ci_stage.sh   (with the project's venv active)
#
# Where Slurm can be had (root, apt-get, the package mirror reachable), installs
# Debian's packages (tests/slurm/install.sh) and runs tests/runtime/test_slurm.py with
# FLODL_TEST_SLURM=require: the job scripts under a real Slurm, two nodes (each a
# host of its own in namespaces, where they can be made) and one (tests/slurm/check.sh),
# jobs run as a normal user. Elsewhere it prints why the
# stage is skipped and exits 0. Prints how long the install and the test took.
set -euo pipefail
cd "$(dirname "$0")/../.."
skip() { echo ".ci/run: Slurm stage skipped: $*"; exit 0; }
[ "$(id -u)" = 0 ] || skip "not root (a local Slurm needs root to start slurmd and run jobs as a test user)"
[ -n "${VIRTUAL_ENV:-}" ] || { echo ".ci/run: Slurm stage: activate the project's virtual environment first" >&2; exit 1; }
start=$SECONDS
status=0
bash tests/slurm/install.sh || status=$?
case $status in
    0) echo ".ci/run: Slurm installed in $((SECONDS - start)) s (slurmd $(dpkg-query -W -f='${Version}' slurmd))" ;;
    3) skip "Slurm cannot be installed here (see the line above)" ;;
    *) echo ".ci/run: installing Slurm failed (exit $status)" >&2; exit "$status" ;;
esac
start=$SECONDS
# -s: check.sh's report (one line per check) is printed, passed or not.
FLODL_TEST_SLURM=require python -m pytest -q -s -p no:cacheprovider -m slurm tests/runtime/test_slurm.py
echo ".ci/run: Slurm test took $((SECONDS - start)) s"
