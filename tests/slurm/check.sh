#!/usr/bin/env bash
# The job scripts under a real single-node Slurm: bash tests/slurm/check.sh
#
# Starts a throw-away Slurm on this machine (cluster.sh) and submits, as a normal
# user, each of jobs/slurm-*.sbatch with the documented CPU-only overrides
# (sbatch --gpus-per-task=0 --ntasks-per-node=2 --cpus-per-task=1). The jobs run side
# by side; what each left is checked: its state and exit code (`scontrol show job`),
# every attempt as `sacct -c` shows it (from jobcomp/filetxt: no slurmdbd), the world size in
# metrics.h5, the epochs, rounds and checkpoints, and its log.
#
#   slurm-one-node     started over a stale MPICH slab under its own KVS name (left by
#                      a job whose ranks were killed; flodl_mpi/runtime/stale_shm.py): completes
#   slurm-multi-node   completes (on one node; --exclusive=user, so that it runs beside them;
#                      only where the two-node part did not run, which covers it)
#   preemptible, four times, each with the paced model (paced_model.py):
#     natural          Slurm's own --signal=B:USR1@60 before a --time=2 limit
#     scancel --batch  `scancel --batch --signal=USR1` once epoch 1 is done (only where
#                      the two-node part did not run, which does the same on two nodes)
#     start-up USR1    `scancel --signal=USR1` (no --batch: to the ranks) while they
#                      start, once their stop handler is in place, before training
#     bad input        a missing --data file: exit 2, FAILED, not requeued
#   The first three end in one requeue (exit 4) and a resumed run that completes,
#   with the rounds 0..R-1 continuous across the attempts.
#
# Beside it, the same scripts on a two-node Slurm (tests/slurm/two_nodes.sh, its
# report printed at the end): nodea and nodeb, each slurmd on a host of its own (the
# multi-host harness's namespaces, tests/multinode/cluster.py), 2 nodes x 2 tasks:
#   slurm-multi-node   completes; metrics.h5 and every rank name its host and node
#                      (nodea, nodea, nodeb, nodeb); the model the same bits on every rank
#   preemptible        stopped in training (`scancel --batch --signal=USR1`), requeued,
#                      resumed on both nodes: completes, the same bits on every rank and
#                      the same final model as the uninterrupted multi-node run of the
#                      same options
# Where the hosts cannot be made (no namespaces), it prints "SKIP two nodes: <why>".
# FLODL_SLURM_PART=two-nodes runs only that part, =one-node only the rest.
#
# Prints one line per check, "PASS <name>: ..." or "FAIL <name>: ...", then
# "slurm checks: P passed, F failed (T s)"; exits 0 when all passed, 1 when one
# failed, 2 when it could not start. Everything is torn down on exit (the
# daemons, the test user's jobs and shared memory, the temporary directory;
# FLODL_SLURM_KEEP=1 keeps the directory to look at). FLODL_SLURM_CYCLES=N (default
# 1) lets the natural flow be preempted N times before it may finish (about 2
# minutes more per cycle; by hand: the suite keeps 1).
#
# Needs: root, Slurm and munge installed (tests/slurm/install.sh), the project's
# virtual environment ($FLODL_VENV, default <repo>/.venv). Jobs run as the user
# flodltest (created when missing, removed again at the end); where a directory
# on the way to the venv or its Python is closed to other users (a pyenv under
# /root), flodltest gets traverse permission on it for the test's duration.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
venv=${FLODL_VENV:-$repo/.venv}
user=flodltest
cycles=${FLODL_SLURM_CYCLES:-1}
part=${FLODL_SLURM_PART:-all}
# The run shape: 2 ranks of 1 core each, the built-in digits data.
cpu_only=(--gpus-per-task=0 --ntasks-per-node=2 --cpus-per-task=1)
ranks=2
# All the jobs at once (8 of 2 CPUs): the node is declared with at least 16 CPUs.
node_cpus=16

die() { echo "check.sh: $*" >&2; exit 2; }
case $part in all|one-node|two-nodes) ;; *) die "FLODL_SLURM_PART=$part: all, one-node or two-nodes" ;; esac
[ "$(id -u)" = 0 ] || die "needs root (to start slurmd and to run jobs as $user)"
for cmd in munged slurmctld slurmd sbatch scontrol sacct; do
    command -v "$cmd" >/dev/null || die "$cmd not found: install Slurm first (tests/slurm/install.sh)"
done
[ -x "$venv/bin/python" ] || die "no virtual environment at $venv (set FLODL_VENV)"
. "$here/cluster.sh"

tmp=$(mktemp -d /tmp/flodl-slurm.XXXXXX)
work=$tmp/work   # where jobs are submitted from (each cluster its own: job ids start at 1 in each)
submit_on=()     # the prefix that runs a command where sbatch reaches slurmctld (on_host nodea)
job_env=()       # VAR=value for the jobs' environment (sbatch exports the submitter's)
created_user=0
granted=()   # directories where $user was given traverse permission
had_acl=()   # for each: 1 if it had an ACL of its own before

cleanup() {
    local status=$?
    set +e
    if [ -n "${SLURM_CONF:-}" ]; then
        scancel --user="$user" 2>/dev/null
        # Let the jobs' processes end before slurmd goes (KillWait is 10 s).
        for _ in $(seq 30); do
            [ -z "$(squeue -h -u "$user" -o %i 2>/dev/null)" ] && break
            sleep 1
        done
    fi
    if [ -n "$two_pid" ]; then   # the two-node part takes its hosts down as it ends
        kill "$two_pid" 2>/dev/null
        wait "$two_pid" 2>/dev/null
    fi
    hosts_cluster_down "$tmp/hosts"
    cluster_down "$tmp/cluster"
    local i
    for i in "${!granted[@]}"; do
        if [ "${had_acl[i]}" = 1 ]; then
            setfacl -x "u:$user" "${granted[i]}" 2>/dev/null
        else
            setfacl -b "${granted[i]}" 2>/dev/null   # back to the plain mode bits
        fi
    done
    # MPICH slabs the test user's killed ranks left (the stale-slab check makes one):
    # a later Slurm counting job ids from 1 again must not meet them.
    find /dev/shm -maxdepth 1 -user "$user" -name 'mpich_*' -delete 2>/dev/null
    if [ "$created_user" = 1 ]; then
        if pgrep -u "$user" >/dev/null; then
            echo "check.sh: processes of $user still run; keeping the user:" >&2
            pgrep -a -u "$user" >&2
        else
            userdel -r "$user" 2>/dev/null
        fi
        rm -rf "/tmp/torchinductor_$user"   # torch's cache, made at import
    fi
    if [ "${FLODL_SLURM_KEEP:-0}" = 1 ]; then
        echo "check.sh: kept $tmp"
    else
        rm -rf "$tmp"
    fi
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---- the test user and what it needs to read ---------------------------------
if ! id "$user" >/dev/null 2>&1; then
    useradd --create-home --shell /bin/bash "$user"
    created_user=1
fi
as_user() {
    # A clean environment: nothing of root's (VIRTUAL_ENV, PYTHONPATH) leaks into the jobs.
    "${submit_on[@]}" runuser -u "$user" -- env -i HOME="/home/$user" USER="$user" LOGNAME="$user" \
        PATH=/usr/local/bin:/usr/bin:/bin SLURM_CONF="$SLURM_CONF" FLODL_VENV="$venv" "${job_env[@]}" \
        bash -c "cd '$work' && $1"
}
user_can() { runuser -u "$user" -- test "$@"; }
# Give $user traverse permission on each directory on the way to $1 that denies it.
grant_path() {
    local path=$1 d=/ part
    local IFS=/
    for part in ${path#/}; do
        d=${d%/}/$part
        [ -d "$d" ] || break
        if ! user_can -x "$d"; then
            command -v setfacl >/dev/null || die "$user cannot reach $d and setfacl is missing (apt-get install acl)"
            if [ -n "$(getfacl -p --skip-base "$d" 2>/dev/null)" ]; then had_acl+=(1); else had_acl+=(0); fi
            setfacl -m "u:$user:x" "$d"
            granted+=("$d")
        fi
    done
}
grant_path "$(readlink -f "$venv/bin/python")"
grant_path "$venv/lib"
grant_path "$repo/flodl_mpi"
user_can -r "$repo/flodl_mpi/__init__.py" || die "$user cannot read $repo/flodl_mpi"

mkdir -p "$tmp/work"
cp -r "$repo/jobs" "$tmp/work/"
cp "$here/paced_model.py" "$tmp/work/"
cat > "$tmp/work/killer.sbatch" <<'EOF'
#!/usr/bin/env bash
#SBATCH --output=flodl-mpi-%j.out
# Two ranks start MPI and are killed (no MPI_Finalize): MPICH's slab stays behind.
source "$FLODL_VENV/bin/activate"
# (First, like flodl-mpi, they clear a slab an earlier cluster's job with this id left.)
srun --mpi=pmi2 python -c 'from flodl_mpi.cli.main import _clear_stale_shm; _clear_stale_shm()
from mpi4py import MPI; import os, signal; MPI.COMM_WORLD.Barrier(); os.kill(os.getpid(), signal.SIGKILL)'
EOF
chown -R "$user:" "$tmp/work"
chmod 755 "$tmp"

start=$(date +%s)

# ---- helpers -----------------------------------------------------------------
passed=0
failed=0
ok() { echo "PASS $1: $2"; passed=$((passed + 1)); }
bad() { echo "FAIL $1: $2"; failed=$((failed + 1)); }
check() {  # check NAME DETAIL CONDITION...
    local name=$1 detail=$2; shift 2
    if "$@"; then ok "$name" "$detail"; else bad "$name" "$detail"; fi
}
elapsed() { echo $(( $(date +%s) - start )); }

submit() {  # submit SBATCH-ARGS...: prints the job id
    local out
    out=$(as_user "sbatch --parsable $*") || { echo "sbatch $* failed: $out" >&2; return 1; }
    echo "${out%%;*}"
}
job_field() {  # job_field JOB FIELD: one field of `scontrol show job`
    scontrol show job "$1" 2>/dev/null | tr ' ' '\n' | sed -n "s/^$2=//p" | head -n 1
}
log_of() { echo "$work/flodl-mpi-$1.out"; }
final_state() {  # final_state STATE: true for a state a job ends in
    case $1 in COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY|BOOT_FAIL|DEADLINE|PREEMPTED) return 0 ;; esac
    return 1
}
# Every attempt of JOB as sacct shows it (jobcomp/filetxt), in order: "STATE:EXIT ..."
attempts() {
    sacct -c -n -P -j "$1" -o State,ExitCode 2>/dev/null | tr '|' ':' | tr '\n' ' ' | sed 's/ $//'
}
# The DerivedExitCode of JOB's last attempt (the highest exit code of any of its steps).
derived() { sacct -c -n -P -j "$1" -o DerivedExitCode 2>/dev/null | tail -n 1; }
inspect() { "$venv/bin/python" "$here/inspect_run.py" "$work/runs/$1" "${@:2}"; }
field() { "$venv/bin/python" -c 'import json, sys; print(json.loads(sys.argv[1]).get(sys.argv[2]))' "$1" "$2"; }
# The name MPICH gives its slab for PMI KVS name $1 on node 0 (flodl_mpi/runtime/stale_shm.py).
slab_name() {
    "$venv/bin/python" -c 'import sys; from flodl_mpi.runtime.stale_shm import segment_prefixes
print(segment_prefixes(sys.argv[1])[0] + "0")' "$1"
}
init_failed() {  # init_failed JOB: a rank failed inside MPI_Init (the others may wait there)
    grep -q "Fatal error in internal_Init_thread" "$(log_of "$1")" 2>/dev/null
}
# The pids of JOB's ranks (its step's flodl-mpi processes) whose SIGUSR1 handler is in place.
ranks_catching_usr1() {
    local pid mask
    for pid in $(pgrep -u "$user" -f "flodl-mpi train" || true); do
        [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = srun ] && continue   # srun's own command line
        tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | grep -qx "SLURM_JOB_ID=$1" || continue
        tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | grep -qx "SLURM_STEP_ID=0" || continue
        mask=$(sed -n 's/^SigCgt:\s*//p' "/proc/$pid/status" 2>/dev/null)
        [ -n "$mask" ] && (( 0x$mask & (1 << 9) )) && echo "$pid"   # bit 9: signal 10, SIGUSR1
    done
    return 0
}

wait_job() {  # wait_job JOB LIMIT: until JOB is in a final state; prints the state
    local job=$1 limit=$2 state="" t
    t=$(date +%s)
    while (( $(date +%s) - t < limit )); do
        state=$(job_field "$job" JobState)
        if init_failed "$job" && [ "$state" = RUNNING ]; then
            scancel "$job"
            echo "MPI_INIT_FAILED"
            return 0
        fi
        if final_state "$state"; then echo "$state"; return 0; fi
        sleep 1
    done
    echo "TIMEOUT_WAITING($state)"
}

# ---- two nodes ---------------------------------------------------------------------
two_nodes_ran=0   # 1 where the two-node part's hosts could be made (it covers two of the jobs below)
two_pid=""        # the two-node part, running beside the single-node one
if [ "$part" = two-nodes ]; then
    . "$here/two_nodes.sh"
    two_node_checks
    echo "slurm checks: $passed passed, $failed failed ($(elapsed) s)"
    [ "$failed" = 0 ]
    exit
elif [ "$part" = all ]; then
    . "$here/two_nodes.sh"
    # In a subshell of its own (its client commands, SLURM_CONF and work directory are its
    # own), beside the single-node part: most of either is waiting (start-up, signals,
    # requeues). Its report is counted at the end; it says whether its hosts came up.
    (
        trap 'hosts_cluster_down "$tmp/hosts"' EXIT
        trap 'exit 143' TERM
        trap 'exit 130' INT
        two_node_checks
    ) > "$tmp/two-nodes.report" 2>&1 &
    two_pid=$!
    for _ in $(seq 240); do
        [ -s "$tmp/two-nodes.state" ] && break
        kill -0 "$two_pid" 2>/dev/null || break
        sleep 0.25
    done
    [ "$(cat "$tmp/two-nodes.state" 2>/dev/null)" = ran ] && two_nodes_ran=1
fi

# ---- the single-node cluster ---------------------------------------------------------
t0=$(date +%s)
FLODL_SLURM_MIN_CPUS=$node_cpus cluster_up "$tmp/cluster" || die "the single-node Slurm did not start"
echo "check.sh: Slurm $(sinfo -V | awk '{print $2}') up in $(( $(date +%s) - t0 )) s; $(sinfo -h -N -o '%N %c CPUs')"

# ---- submit everything (the jobs run side by side) ----------------------------
paced=(--model paced_model.py:paced_mlp --keep-checkpoints 100)
natural_epochs=$((8 * cycles))
manual_epochs=3
startup_epochs=2
# Slurm checks time limits every 30 s, so with --time=2 and @60, USR1 comes 30 to 60 s
# after the start, within the paced run's first epochs. The harness raises the time
# limit once the job has been requeued $cycles time(s), so that it finishes.
natural=$(submit "${cpu_only[*]} --export=ALL,FLODL_PACED_ATTEMPTS=$cycles --time=2 --signal=B:USR1@60 jobs/slurm-preemptible.sbatch ${paced[*]} --epochs $natural_epochs")
# A head start: the other jobs are submitted once its ranks are training (or after
# 60 s), so that their start-up does not slow its own and the signal lands in training.
for _ in $(seq 120); do
    grep -q "flodl-mpi .*: $ranks ranks" "$(log_of "$natural")" 2>/dev/null && break
    sleep 0.5
done
# A job whose ranks start MPI and are killed: its slab stays in /dev/shm.
killer=$(submit "${cpu_only[*]} killer.sbatch")
# Held until the killer's slab is planted under its own KVS name.
declare -A job_of
job_of[slurm-one-node]=$(submit "${cpu_only[*]} --hold jobs/slurm-one-node.sbatch --epochs 1")
# --exclusive=user: the script asks for whole nodes, which would hold it (and, as the
# oldest pending job, every job after it) until all other test jobs are done.
plain=(slurm-one-node)
manual=""
if [ "$two_nodes_ran" = 0 ]; then   # else the two-node part ran both, on two nodes
    job_of[slurm-multi-node]=$(submit "${cpu_only[*]} --nodes=1 --exclusive=user jobs/slurm-multi-node.sbatch --epochs 1")
    plain+=(slurm-multi-node)
    manual=$(submit "${cpu_only[*]} --time=10 jobs/slurm-preemptible.sbatch ${paced[*]} --epochs $manual_epochs")
fi
startup=$(submit "${cpu_only[*]} --time=10 jobs/slurm-preemptible.sbatch ${paced[*]} --epochs $startup_epochs")
badinput=$(submit "${cpu_only[*]} --time=10 jobs/slurm-preemptible.sbatch --data missing.h5 --epochs 1")
echo "check.sh: submitted killer $killer, one-node ${job_of[slurm-one-node]}, multi-node ${job_of[slurm-multi-node]:-(on two nodes)}," \
    "natural $natural, scancel --batch ${manual:-(on two nodes)}, start-up $startup, bad input $badinput"

# ---- act on the jobs as their moments come --------------------------------------
planted=""        # the stale slab put under the one-node job's name
natural_done=0    # the natural flow's time limit raised after $cycles requeues
manual_done=0     # scancel --batch sent (or not wanted here: no $manual)
[ -n "$manual" ] || manual_done=1
startup_done=0    # scancel (no --batch) sent to the starting ranks
startup_note=""
t0=$(date +%s)
while (( $(date +%s) - t0 < 300 + 150 * cycles )); do
    if [ -z "$planted" ] && final_state "$(job_field "$killer" JobState)"; then
        seed=/dev/shm/$(slab_name "$killer.0")
        one=${job_of[slurm-one-node]}
        check "stale slab left" "killed ranks of job $killer left $seed (MPICH's name for KVS $killer.0)" test -f "$seed"
        planted=/dev/shm/$(slab_name "$one.0")
        if [ -f "$seed" ]; then cp "$seed" "$planted" && chown "$user:" "$planted"; fi
        scontrol release "$one"
    fi
    for job in "$natural" $manual "$startup"; do   # a failed MPI start: end the job now, not at its limit
        if init_failed "$job" && [ "$(job_field "$job" JobState)" = RUNNING ]; then scancel "$job"; fi
    done
    if (( natural_done == 0 )) && [ "$(job_field "$natural" Restarts)" -ge "$cycles" ] 2>/dev/null; then
        scontrol update JobId="$natural" TimeLimit=10
        natural_done=1
    fi
    if (( manual_done == 0 )) && grep -q "epoch 1/" "$(log_of "$manual")" 2>/dev/null; then
        as_user "scancel --batch --signal=USR1 $manual"
        manual_done=1
    fi
    if (( startup_done == 0 )) && [ "$(job_field "$startup" Restarts)" = 0 ]; then
        pids=$(ranks_catching_usr1 "$startup")
        if [ "$(wc -w <<<"$pids")" = "$ranks" ]; then
            # Before the first round: no epoch line yet (torch may still be loading).
            startup_note="ranks $(echo $pids) catch SIGUSR1; log so far: $(cat "$(log_of "$startup")" 2>/dev/null | wc -l) line(s)"
            as_user "scancel --signal=USR1 $startup"
            startup_done=1
        fi
    fi
    if [ -n "$planted" ] && (( natural_done && manual_done && startup_done )); then break; fi
    sleep 0.3
done
check "natural signal requeue" "job $natural: $(grep -m1 'got SIGUSR1' "$(log_of "$natural")" || echo "no USR1 seen by the script"), restarts $(job_field "$natural" Restarts)" \
    test "$natural_done" = 1
if [ -n "$manual" ]; then
    check "scancel --batch signal" "job $manual: $(grep -m1 'got SIGUSR1' "$(log_of "$manual")" || echo "epoch 1 never ended")" \
        test "$manual_done" = 1
fi
check "start-up signal" "job $startup: ${startup_note:-the ranks never caught SIGUSR1 while starting}" \
    test "$startup_done" = 1

# ---- the two plain jobs -------------------------------------------------------
for script in "${plain[@]}"; do
    job=${job_of[$script]}
    state=$(wait_job "$job" 300)
    info=$(inspect "$job")
    out=$(log_of "$job")
    check "$script state" "job $job $state, exit code $(job_field "$job" ExitCode); sacct: $(attempts "$job")" \
        test "$state/$(job_field "$job" ExitCode)/$(attempts "$job")" = "COMPLETED/0:0/COMPLETED:0:0"
    check "$script world size" "metrics.h5 world_size $(field "$info" world_size), $ranks ranks started" \
        test "$(field "$info" world_size)" = "$ranks"
    check "$script metrics" "epochs $(field "$info" epochs), rounds $(field "$info" rounds) continuous $(field "$info" rounds_continuous)" \
        test "$(field "$info" epochs)/$(field "$info" rounds_continuous)" = "[1]/True"
    check "$script checkpoints" "$(field "$info" checkpoints)" \
        grep -q "ckpt-e000001" <<<"$(field "$info" checkpoints)"
    check "$script done line" "$(grep -m1 'done:' "$out" || echo "no 'done:' line")" \
        grep -q "done: test accuracy" "$out"
    if [ "$state" != COMPLETED ]; then
        echo "---- $out"; tail -n 30 "$out" 2>/dev/null
    fi
done
check "stale slab removed" "job ${job_of[slurm-one-node]}: $(grep -m1 'removed /dev/shm' "$(log_of "${job_of[slurm-one-node]}")" || echo "no 'removed' line")" \
    grep -q "flodl-mpi: removed $planted: MPICH shared memory left by an earlier Slurm step" "$(log_of "${job_of[slurm-one-node]}")"

# ---- the preemptible flows ------------------------------------------------------
# check_resumed NAME JOB EPOCHS REQUEUES: completed after REQUEUES requeues on exit 4, rounds continuous.
check_resumed() {
    local name=$1 job=$2 epochs=$3 requeues=$4 state info out expected_sacct
    state=$(wait_job "$job" 300)
    info=$(inspect "$job")
    out=$(log_of "$job")
    # jobcomp/filetxt records a requeued attempt as PENDING (its state once requeued,
    # exit code 0:0); the last attempt's DerivedExitCode, the highest any step of the
    # job exited with, is the ranks' 4.
    expected_sacct="$(for _ in $(seq "$requeues"); do printf 'PENDING:0:0 '; done)COMPLETED:0:0"
    check "$name state" "job $job $state, exit code $(job_field "$job" ExitCode), restarts $(job_field "$job" Restarts)" \
        test "$state/$(job_field "$job" ExitCode)/$(job_field "$job" Restarts)" = "COMPLETED/0:0/$requeues"
    check "$name sacct" "attempts (State:ExitCode): $(attempts "$job"), expected $expected_sacct; derived exit code $(derived "$job")" \
        test "$(attempts "$job")/$(derived "$job")" = "$expected_sacct/4:0"
    check "$name requeued on exit 4" "$(grep -c 'requeueing job' "$out") requeue message(s): $(grep -m1 'requeueing job' "$out" || echo "none")" \
        test "$(grep -c "stopped and saved in runs/$job/checkpoints; requeueing job $job" "$out")" = "$requeues"
    check "$name resumed" "$(grep -m1 -E 'resuming from|no checkpoint in' "$out" || echo "no resume line")" \
        grep -q -E "resuming from ckpt|no checkpoint in runs/$job: starting a new run" "$out"
    check "$name world size" "metrics.h5 world_size $(field "$info" world_size)" \
        test "$(field "$info" world_size)" = "$ranks"
    # An uninterrupted sync run has ceil(ceil(samples / 32) / ranks) rounds per epoch:
    # the epoch's batches of 32 dealt round-robin to the ranks, one round per batch each.
    local samples rounds_per_epoch
    samples=$(sed -n 's/.* \([0-9]*\) train \/ .*/\1/p' "$out" | head -n 1)
    rounds_per_epoch=$(( ( (${samples:-0} + 31) / 32 + ranks - 1) / ranks ))
    check "$name rounds" "rounds $(field "$info" rounds) continuous $(field "$info" rounds_continuous), expected $((rounds_per_epoch * epochs)) = $rounds_per_epoch x $epochs epochs" \
        test "$(field "$info" rounds)/$(field "$info" rounds_continuous)" = "$((rounds_per_epoch * epochs))/True"
    check "$name epochs" "epochs $(field "$info" epochs)" \
        test "$(field "$info" epochs)" = "$("$venv/bin/python" -c "print(list(range(1, $epochs + 1)))")"
    check "$name checkpoint" "a graceful_shutdown checkpoint saved when stopped: $(field "$info" checkpoints)" \
        grep -q "graceful_shutdown" <<<"$(field "$info" checkpoints)"
    if [ "$state" != COMPLETED ]; then
        echo "---- $out"; tail -n 40 "$out" 2>/dev/null
    fi
}
check_resumed "natural signal" "$natural" "$natural_epochs" "$cycles"
[ -z "$manual" ] || check_resumed "scancel --batch" "$manual" "$manual_epochs" 1
check_resumed "start-up signal" "$startup" "$startup_epochs" 1
# The start-up stop came before any training: the stop rode the very first round.
check "start-up signal before training" "$(grep -m1 -E 'stopped on request|got SIG' "$(log_of "$startup")" || echo "no stop line")" \
    grep -q "stopped on request in epoch 1 at round 1;" "$(log_of "$startup")"

state=$(wait_job "$badinput" 300)
out=$(log_of "$badinput")
check "bad input state" "job $badinput $state, exit code $(job_field "$badinput" ExitCode), restarts $(job_field "$badinput" Restarts); sacct: $(attempts "$badinput")" \
    test "$state/$(job_field "$badinput" ExitCode)/$(job_field "$badinput" Restarts)/$(attempts "$badinput")" = "FAILED/2:0/0/FAILED:2:0"
check "bad input not requeued" "$(grep -m1 'not requeued' "$out" || echo "no 'not requeued' line")" \
    grep -q "flodl-mpi failed with exit status 2: not requeued" "$out"

if [ -n "$two_pid" ]; then
    status=0
    wait "$two_pid" || status=$?
    two_pid=""
    cat "$tmp/two-nodes.report"
    passed=$((passed + $(grep -c '^PASS ' "$tmp/two-nodes.report" || true)))
    failed=$((failed + $(grep -c '^FAIL ' "$tmp/two-nodes.report" || true)))
    [ "$status" = 0 ] || bad "two nodes ended" "the two-node part ended early (exit $status)"
fi
echo "slurm checks: $passed passed, $failed failed ($(elapsed) s)"
[ "$failed" = 0 ]
