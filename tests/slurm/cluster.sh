# A throw-away single-node Slurm on this machine (sourced by tests/slurm/check.sh).
#
#   cluster_up DIR     munged, slurmctld and slurmd with all state under DIR
#   cluster_down DIR   stop the three daemons started by cluster_up (by their pid files)
#
# Needs root and Debian's `slurmctld slurmd slurm-client munge` (install.sh).
# Nothing outside DIR is written: our own munge key and socket, a slurm.conf
# generated from `slurmd -C` (the node as slurmd sees it: memory, no GPUs; at
# least FLODL_SLURM_MIN_CPUS CPUs declared, default 2), free TCP ports, and the
# spool and state directories. Client commands find the cluster through
# SLURM_CONF, which cluster_up exports.
#
# Choices a container forces: proctrack/linuxproc and task/none (no cgroup v2
# delegation to confine or track jobs with), accounting_storage/none (no
# slurmdbd; jobs are read back with `scontrol show job`, which keeps a job for
# MinJobAge seconds after it ends, and jobcomp/filetxt records every attempt,
# which `sacct -c` reads: Slurm 22.05's sacct still has --completion).

# A free TCP port on 127.0.0.1 (the kernel picks it; nothing holds it afterwards).
_free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

cluster_up() {
    local dir=$1
    mkdir -p "$dir"/{munge,spool,state,log}
    chmod 755 "$dir"
    # munged insists on a private key and directories only its owner can write.
    chmod 700 "$dir/munge"
    dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
    chmod 400 "$dir/munge/munge.key"
    munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.sock" \
        --pid-file="$dir/munge/munged.pid" --log-file="$dir/log/munged.log" \
        --seed-file="$dir/munge/munged.seed"
    # Clients (sbatch as the test user, srun inside jobs) talk to munged through
    # its socket: the socket must be reachable, the key must not.
    chmod 755 "$dir/munge"
    chmod 400 "$dir/munge/munge.key"

    local node host ctld_port slurmd_port
    host=$(hostname)
    # `slurmd -C` prints the node line as this machine really is, e.g.
    # NodeName=vm CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=24105
    node=$(slurmd -C | head -n 1)
    # The checks run 2-rank jobs side by side: declare at least FLODL_SLURM_MIN_CPUS
    # CPUs, default 2 (config_overrides lets slurmd accept more than it counts).
    local name cpus mem
    name=$(sed -n 's/^NodeName=\([^ ]*\).*/\1/p' <<<"$node")
    cpus=$(sed -n 's/.* CPUs=\([0-9]*\).*/\1/p' <<<"$node")
    mem=$(sed -n 's/.* RealMemory=\([0-9]*\).*/\1/p' <<<"$node")
    (( cpus >= ${FLODL_SLURM_MIN_CPUS:-2} )) || cpus=${FLODL_SLURM_MIN_CPUS:-2}
    ctld_port=$(_free_port)
    slurmd_port=$(_free_port)
    cat > "$dir/slurm.conf" <<EOF
ClusterName=flodltest
SlurmctldHost=$host(127.0.0.1)
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
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
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
NodeName=$name CPUs=$cpus RealMemory=$mem NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    export SLURM_CONF=$dir/slurm.conf
    slurmctld -f "$SLURM_CONF"
    slurmd -f "$SLURM_CONF"
    # Ready when the node is idle (slurmd registered with slurmctld).
    local i
    for i in $(seq 60); do
        if sinfo -h -N -o '%t' 2>/dev/null | grep -qx idle; then
            return 0
        fi
        sleep 0.5
    done
    echo "cluster_up: the node did not become idle in 30 s:" >&2
    sinfo -N -l >&2 || true
    tail -n 20 "$dir/log/slurmctld.log" "$dir/log/slurmd.log" >&2 || true
    return 1
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
    local dir=$1
    _stop_pidfile "$dir/slurmd.pid"
    _stop_pidfile "$dir/slurmctld.pid"
    _stop_pidfile "$dir/munge/munged.pid"
}
