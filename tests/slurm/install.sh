#!/usr/bin/env bash
# Install what tests/slurm/check.sh needs from Debian's packages (root only):
# Slurm's controller, node daemon and client commands, munge, and acl (setfacl).
#
# Exit status: 0 installed (or already there), 1 failed, 3 the packages cannot be
# had here (no apt-get, or the package mirror is unreachable or lacks them): the
# caller skips, saying so. Where systemd runs, installing starts Debian's own munge
# service; check.sh does not use it (its cluster has its own key, socket and ports).
set -euo pipefail
packages=(slurmd slurmctld slurm-client munge acl)
[ "$(id -u)" = 0 ] || { echo "install.sh: needs root" >&2; exit 1; }
command -v apt-get >/dev/null || { echo "install.sh: no apt-get (not a Debian-like system)" >&2; exit 3; }
export DEBIAN_FRONTEND=noninteractive
if ! apt-get update -qq; then
    echo "install.sh: apt-get update failed: the package mirror is unreachable" >&2
    exit 3
fi
for p in "${packages[@]}"; do
    if [ "$(apt-cache policy "$p" | sed -n 's/^ *Candidate: //p')" = "" ] ||
        [ "$(apt-cache policy "$p" | sed -n 's/^ *Candidate: //p')" = "(none)" ]; then
        echo "install.sh: package $p is not available from the configured mirror" >&2
        exit 3
    fi
done
apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
