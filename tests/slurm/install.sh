#!/usr/bin/env bash
# Install what tests/slurm/check.sh needs from Debian's packages (root only):
# Slurm's controller, node daemon and client commands, munge, and acl (setfacl).
# 110 s on a Debian 12 machine without them (apt-get update included).
#
# Exit status: 0 installed (or already there), 1 failed, 3 the packages cannot be
# had here (no apt-get, or the package mirror is unreachable or lacks them): the
# caller skips, saying so. Where systemd runs, installing starts Debian's own munge
# service; check.sh does not use it (its cluster has its own key, socket and ports).
set -euo pipefail
packages=(slurmd slurmctld slurm-client munge acl)
unreachable='Failed to fetch|Temporary failure resolving|Could not resolve|Could not connect|Network is unreachable'
[ "$(id -u)" = 0 ] || { echo "install.sh: needs root" >&2; exit 1; }
command -v apt-get >/dev/null || { echo "install.sh: no apt-get (not a Debian-like system)" >&2; exit 3; }
export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# apt-get update may warn and still exit 0 when the mirror cannot be reached.
if ! apt-get update -qq >"$log" 2>&1 || grep -qE "$unreachable" "$log"; then
    echo "install.sh: apt-get update failed, the package mirror is unreachable: $(grep -m1 -E "$unreachable|^E:" "$log")" >&2
    exit 3
fi
for p in "${packages[@]}"; do
    candidate=$(apt-cache policy "$p" | sed -n 's/^ *Candidate: //p')
    if [ -z "$candidate" ] || [ "$candidate" = "(none)" ]; then
        echo "install.sh: package $p is not available from the configured mirror" >&2
        exit 3
    fi
done
if ! apt-get install -y -qq --no-install-recommends "${packages[@]}" >"$log" 2>&1; then
    if grep -qE "$unreachable" "$log"; then
        echo "install.sh: the package mirror is unreachable: $(grep -m1 -E "$unreachable" "$log")" >&2
        exit 3
    fi
    tail -n 20 "$log" >&2
    echo "install.sh: apt-get install failed" >&2
    exit 1
fi
