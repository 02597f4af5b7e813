# Throw-away Slurm clusters on this machine (sourced by tests/slurm/check.sh).
#
#   cluster_up DIR          one node: munged, slurmctld and slurmd with all state under DIR
#   cluster_down DIR        stop the three daemons started by cluster_up (by their pid files)
#   hosts_cluster_up DIR N  N nodes, each a host of its own (nodea, nodeb, ...: the multi-host
#                           harness's namespaces, tests/multinode/cluster.py), one slurmd on each;
#                           returns 3 (the reason on stderr) where no hosts can be made here
#   hosts_cluster_down DIR  stop its daemons, then remove the hosts (what is left on them killed)
#   on_host HOST CMD...     run CMD on that host (its UTS, network and mount namespaces)
#
# Needs root and Debian's `slurmctld slurmd slurm-client munge` (install.sh); the
# hosts also python3, unshare, nsenter and ip. Nothing outside DIR is written: our
# own munge key and socket, a slurm.conf generated from `slurmd -C` (the node as
# slurmd sees it: memory, no GPUs; at least FLODL_SLURM_MIN_CPUS CPUs declared,
# default 2), the ports, and the spool and state directories. Client commands find
# the cluster through SLURM_CONF, which both exports; on the hosts' cluster they
# run on a host (on_host nodea sbatch ...), where slurmctld's address is.
#
# Choices a container forces: proctrack/linuxproc and task/none (no cgroup v2
# delegation to confine or track jobs with), accounting_storage/none (no
# slurmdbd; jobs are read back with `scontrol show job`, which keeps a job for
# MinJobAge seconds after it ends, and jobcomp/filetxt records every attempt,
# which `sacct -c` reads: Slurm 22.05's sacct still has --completion).
#
# Several nodes on one machine: Debian's Slurm 22.05 does run several slurmd side by
# side in one network (`slurmd -N nodea`, `slurmd -N nodeb`, each NodeName with its
# own Port and NodeAddr=127.0.0.1: both idle, `srun -N2` ran tasks on both; tried
# 2026-12-03), but then every node has this machine's host name and /dev/shm, so MPI
# and metrics.h5 see one host. Hence hosts of their own: each slurmd in its host's
# namespaces (own host name, /dev/shm, /etc/hosts and network: 10.77.0.i on a bridge).

# A free TCP port on 127.0.0.1 (the kernel picks it; nothing holds it afterwards).
_free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# munged with its own key and socket under DIR/munge, started through PREFIX... (none, or on_host H).
_munge_up() {
    local dir=$1
    shift
    mkdir -p "$dir"/{munge,spool,state,log}
    chmod 755 "$dir"
    # munged insists on a private key and directories only its owner can write.
    chmod 700 "$dir/munge"
    dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
    chmod 400 "$dir/munge/munge.key"
    "$@" munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.sock" \
        --pid-file="$dir/munge/munged.pid" --log-file="$dir/log/munged.log" \
        --seed-file="$dir/munge/munged.seed"
    # Clients (sbatch as the test user, srun inside jobs) talk to munged through
    # its socket: the socket must be reachable, the key must not.
    chmod 755 "$dir/munge"
    chmod 400 "$dir/munge/munge.key"
}

# "CPUS MEM": `slurmd -C`'s node, at least FLODL_SLURM_MIN_CPUS CPUs (default 2). The checks
# run jobs side by side; config_overrides lets slurmd accept more CPUs than it counts.
_node_size() {
    local node cpus mem
    # e.g. NodeName=vm CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=24105
    node=$(slurmd -C | head -n 1)
    cpus=$(sed -n 's/.* CPUs=\([0-9]*\).*/\1/p' <<<"$node")
    mem=$(sed -n 's/.* RealMemory=\([0-9]*\).*/\1/p' <<<"$node")
    (( cpus >= ${FLODL_SLURM_MIN_CPUS:-2} )) || cpus=${FLODL_SLURM_MIN_CPUS:-2}
    echo "$cpus $mem"
}

# DIR/slurm.conf: _write_conf DIR SLURMCTLD_HOST CTLD_PORT SLURMD_PORT NODE_LINE...
_write_conf() {
    local dir=$1 ctld_host=$2 ctld_port=$3 slurmd_port=$4 line
    shift 4
    cat > "$dir/slurm.conf" <<EOF
ClusterName=flodltest
SlurmctldHost=$ctld_host
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a requeued job may start again only after the old credential
# expired (default 120 s); 10 s keeps the test short.
AuthInfo=socket=$dir/munge/munge.sock,cred_expire=10
StateSaveLocation=$dir/state
# %n: the node's name (the hosts' slurmd share DIR)
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/log/jobcomp.txt
SchedulerType=sched/backfill
# Look at pending jobs every 2 s (default 60 s), so a requeued job starts again
# as soon as it is eligible.
SchedulerParameters=sched_interval=2,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
# Long enough to read every job back at the end of the test.
MinJobAge=600
KillWait=10
MpiDefault=none
MailProg=/bin/true
SlurmdParameters=config_overrides
EOF
    for line in "$@"; do echo "$line" >> "$dir/slurm.conf"; done
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >> "$dir/slurm.conf"
}

# Until N nodes are idle (their slurmd registered with slurmctld), at most 30 s; sinfo runs
# through PREFIX... (none, or on_host nodea).
_wait_idle() {
    local dir=$1 n=$2 i
    shift 2
    for i in $(seq 60); do
        if [ "$("$@" sinfo -h -N -o '%t' 2>/dev/null | grep -cx idle)" = "$n" ]; then
            return 0
        fi
        sleep 0.5
    done
    echo "cluster_up: $n node(s) did not become idle in 30 s:" >&2
    "$@" sinfo -N -l >&2 || true
    tail -n 20 "$dir"/log/slurm*.log >&2 || true
    return 1
}

cluster_up() {
    local dir=$1 name size
    _munge_up "$dir"
    name=$(slurmd -C | head -n 1 | sed -n 's/^NodeName=\([^ ]*\).*/\1/p')
    read -r -a size <<<"$(_node_size)"
    _write_conf "$dir" "$(hostname)(127.0.0.1)" "$(_free_port)" "$(_free_port)" \
        "NodeName=$name CPUs=${size[0]} RealMemory=${size[1]} NodeAddr=127.0.0.1 State=UNKNOWN"
    export SLURM_CONF=$dir/slurm.conf
    slurmctld -f "$SLURM_CONF"
    slurmd -f "$SLURM_CONF"
    _wait_idle "$dir" 1
}

# Stop a daemon by its pid file and wait until it has gone (at most 20 s).
_stop_pidfile() {
    local pidfile=$1 pid i
    [ -s "$pidfile" ] || return 0
    pid=$(cat "$pidfile")
    kill "$pid" 2>/dev/null || return 0
    for i in $(seq 40); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.5
    done
    kill -KILL "$pid" 2>/dev/null || true
}

cluster_down() {
    local dir=$1 f
    for f in "$dir"/slurmd-*.pid; do _stop_pidfile "$f"; done
    _stop_pidfile "$dir/slurmctld.pid"
    _stop_pidfile "$dir/munge/munged.pid"
}

# ---- the hosts' cluster ------------------------------------------------------------
# The hosts are made and held by `python3 -m tests.multinode.cluster N`, which prints
# "HOST PID" for each, then "ready", and removes them when its stdin closes: this shell
# holds the write end of that fifo (fd _hosts_fd), so the hosts go with it however it
# ends. _hosts_pid: HOST -> the pid whose namespaces are that host.
declare -A _hosts_pid=()
_hosts_fd=""
_hosts_holder=""

on_host() {
    local host=$1
    shift
    # {_hosts_fd}>&-: a daemon started here must not keep the holder's fifo open.
    nsenter -t "${_hosts_pid[$host]}" --uts --net --mount --wd="$PWD" -- "$@" {_hosts_fd}>&-
}

hosts_cluster_up() {
    local dir=$1 n=$2 repo host pid i status size nodes=()
    repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
    mkdir -p "$dir"
    mkfifo "$dir/hold.in"
    (cd "$repo" && exec python3 -m tests.multinode.cluster "$n" <"$dir/hold.in" >"$dir/hold.out" 2>"$dir/hold.err") &
    _hosts_holder=$!
    exec {_hosts_fd}>"$dir/hold.in"
    for i in $(seq 120); do
        grep -qx ready "$dir/hold.out" 2>/dev/null && break
        if ! kill -0 "$_hosts_holder" 2>/dev/null; then
            status=0
            wait "$_hosts_holder" || status=$?
            _hosts_holder=""
            exec {_hosts_fd}>&-
            cat "$dir/hold.err" >&2
            [ "$status" = 3 ] && return 3
            return 1
        fi
        sleep 0.25
    done
    grep -qx ready "$dir/hold.out" || { echo "hosts_cluster_up: the hosts were not made in 30 s" >&2; return 1; }
    while read -r host pid; do
        [ "$host" = ready ] && break
        _hosts_pid[$host]=$pid
    done <"$dir/hold.out"
    # munged and slurmctld on the first host, the head node. munged's socket is a file,
    # which every host reaches: they share this machine's file system (only /dev/shm and
    # /etc/hosts are each host's own).
    _munge_up "$dir" on_host nodea
    read -r -a size <<<"$(_node_size)"
    i=0
    for host in $(printf '%s\n' "${!_hosts_pid[@]}" | sort); do
        i=$((i + 1))   # host i is 10.77.0.i (tests/multinode/cluster.py)
        nodes+=("NodeName=$host CPUs=${size[0]} RealMemory=${size[1]} NodeAddr=10.77.0.$i State=UNKNOWN")
    done
    # Each host has a network of its own: Slurm's standard ports are free there.
    _write_conf "$dir" "nodea(10.77.0.1)" 6817 6818 "${nodes[@]}"
    export SLURM_CONF=$dir/slurm.conf
    on_host nodea slurmctld -f "$SLURM_CONF"
    for host in "${!_hosts_pid[@]}"; do
        on_host "$host" slurmd -f "$SLURM_CONF" -N "$host"
    done
    _wait_idle "$dir" "$n" on_host nodea
}

hosts_cluster_down() {
    local dir=$1
    [ -n "$_hosts_holder" ] || return 0
    cluster_down "$dir"
    # On its input's end the holder kills what is left on the hosts (jobs' processes) and
    # removes them; SIGTERM only if it has not ended in 30 s (it ignores signals while closing).
    exec {_hosts_fd}>&-
    local i
    for i in $(seq 120); do
        kill -0 "$_hosts_holder" 2>/dev/null || break
        sleep 0.25
    done
    kill "$_hosts_holder" 2>/dev/null || true
    wait "$_hosts_holder" 2>/dev/null || true
    _hosts_holder=""
    _hosts_pid=()
}
