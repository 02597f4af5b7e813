#!/usr/bin/env bash
# The job scripts under a real single-node Slurm: bash tests/slurm/check.sh
#
# Starts a throw-away Slurm on this machine (cluster.sh), submits each of
# jobs/slurm-*.sbatch as a normal user with the documented CPU-only overrides
# (sbatch --gpus-per-task=0 --ntasks-per-node=2 --cpus-per-task=1), and checks
# what each job left: its final state and exit code (`scontrol show job`, and
# every attempt in jobcomp/filetxt), the world size in metrics.h5, the epochs
# and checkpoints. Then the preemptible script twice: stopped by Slurm's own
# --signal=B:USR1 before a short time limit, and by `scancel --batch
# --signal=USR1`; each must end in one requeue and a resumed run that completes
# with the rounds 0..R-1 continuous across the two attempts.
#
# Prints one line per check, "PASS <name>: ..." or "FAIL <name>: ...", then
# "slurm checks: P passed, F failed"; exits 0 when all passed, 1 when one
# failed, 2 when it could not start. Everything is torn down on exit (the
# daemons, the test user's jobs, the temporary directory; FLODL_SLURM_KEEP=1
# keeps the directory to look at).
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
# The run shape: 2 ranks of 1 core each, the built-in digits data.
cpu_only=(--gpus-per-task=0 --ntasks-per-node=2 --cpus-per-task=1)
# One job on the node at a time (Slurm runs them in turn): two MPICH jobs starting
# side by side under srun once failed in MPI_Init ("Message truncated" in
# MPIDI_UCX_comm_set_vcis), and the test is about the scripts, not that.
one_at_a_time=(--exclusive)
ranks=2

die() { echo "check.sh: $*" >&2; exit 2; }
[ "$(id -u)" = 0 ] || die "needs root (to start slurmd and to run jobs as $user)"
for cmd in munged slurmctld slurmd sbatch scontrol; do
    command -v "$cmd" >/dev/null || die "$cmd not found: install Slurm first (tests/slurm/install.sh)"
done
[ -x "$venv/bin/python" ] || die "no virtual environment at $venv (set FLODL_VENV)"
. "$here/cluster.sh"

tmp=$(mktemp -d /tmp/flodl-slurm.XXXXXX)
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
    cluster_down "$tmp/cluster"
    local i
    for i in "${!granted[@]}"; do
        if [ "${had_acl[i]}" = 1 ]; then
            setfacl -x "u:$user" "${granted[i]}" 2>/dev/null
        else
            setfacl -b "${granted[i]}" 2>/dev/null   # back to the plain mode bits
        fi
    done
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
    runuser -u "$user" -- env -i HOME="/home/$user" USER="$user" LOGNAME="$user" \
        PATH=/usr/local/bin:/usr/bin:/bin SLURM_CONF="$SLURM_CONF" FLODL_VENV="$venv" \
        bash -c "cd '$tmp/work' && $1"
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
chown -R "$user:" "$tmp/work"
chmod 755 "$tmp"

# ---- the cluster -------------------------------------------------------------
start=$(date +%s)
cluster_up "$tmp/cluster" || die "the single-node Slurm did not start"
echo "check.sh: Slurm $(sinfo -V | awk '{print $2}') up in $(( $(date +%s) - start )) s; $(sinfo -h -N -o '%N %c CPUs')"

# ---- helpers -----------------------------------------------------------------
passed=0
failed=0
ok() { echo "PASS $1: $2"; passed=$((passed + 1)); }
bad() { echo "FAIL $1: $2"; failed=$((failed + 1)); }
check() {  # check NAME DETAIL CONDITION...
    local name=$1 detail=$2; shift 2
    if "$@"; then ok "$name" "$detail"; else bad "$name" "$detail"; fi
}

submit() {  # submit SBATCH-ARGS...: prints the job id
    local out
    out=$(as_user "sbatch --parsable $*") || { echo "sbatch $* failed: $out" >&2; return 1; }
    echo "${out%%;*}"
}
job_field() {  # job_field JOB FIELD: one field of `scontrol show job`
    scontrol show job "$1" 2>/dev/null | tr ' ' '\n' | sed -n "s/^$2=//p" | head -n 1
}
# Wait until JOB is in a final state (at most $2 s); prints the state.
wait_job() {
    local job=$1 limit=$2 state="" t0
    t0=$(date +%s)
    while (( $(date +%s) - t0 < limit )); do
        state=$(job_field "$job" JobState)
        # A rank that failed inside MPI_Init leaves the others waiting there until
        # the time limit (srun does not end the step for it): end the job now.
        if grep -q "Fatal error in internal_Init_thread" "$tmp/work/flodl-mpi-$job.out" 2>/dev/null &&
            [ "$state" = RUNNING ]; then
            scancel "$job"
            echo "MPI_INIT_FAILED"
            return 0
        fi
        case $state in
            COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY|BOOT_FAIL|DEADLINE|PREEMPTED)
                echo "$state"; return 0 ;;
        esac
        sleep 1
    done
    echo "TIMEOUT_WAITING($state)"
}
wait_restarts() {  # wait_restarts JOB N LIMIT: until the job was requeued N times
    local t0
    t0=$(date +%s)
    while (( $(date +%s) - t0 < $3 )); do
        [ "$(job_field "$1" Restarts)" -ge "$2" ] 2>/dev/null && return 0
        case $(job_field "$1" JobState) in COMPLETED|FAILED|CANCELLED|TIMEOUT) return 1 ;; esac
        sleep 1
    done
    return 1
}
# The states of every attempt of JOB, in order, from jobcomp/filetxt.
attempts() {
    sed -n "s/^JobId=$1 .*JobState=\([A-Z_]*\) .*ExitCode=\([0-9:]*\).*/\1:\2/p" "$tmp/cluster/log/jobcomp.txt" |
        tr '\n' ' '
}
inspect() { "$venv/bin/python" "$here/inspect_run.py" "$tmp/work/runs/$1"; }
field() { "$venv/bin/python" -c 'import json, sys; print(json.loads(sys.argv[1]).get(sys.argv[2]))' "$1" "$2"; }

# ---- 2. preemption: stopped, saved, requeued once, resumed, completed --------
# The paced model (paced_model.py) makes each epoch last at least 23 x 0.4 s,
# whatever the machine's speed, so a stop always lands before the last epoch.
cp "$here/paced_model.py" "$tmp/work/"
chown "$user:" "$tmp/work/paced_model.py"
paced=(--model paced_model.py:paced_mlp --keep-checkpoints 100)
natural_epochs=8
manual_epochs=3

# check_resumed NAME JOB EPOCHS: the job completed after one requeue, with continuous rounds.
check_resumed() {
    local name=$1 job=$2 epochs=$3 state info out
    state=$(wait_job "$job" 480)
    info=$(inspect "$job")
    out="$tmp/work/flodl-mpi-$job.out"
    check "$name state" "job $job $state, exit code $(job_field "$job" ExitCode), restarts $(job_field "$job" Restarts); attempts: $(attempts "$job")" \
        test "$state/$(job_field "$job" ExitCode)/$(job_field "$job" Restarts)" = "COMPLETED/0:0/1"
    check "$name requeued on exit 4" "$(grep -m1 'requeueing job' "$out" || echo "no requeue message")" \
        grep -q "stopped and saved in runs/$job/checkpoints; requeueing job $job" "$out"
    check "$name resumed" "$(grep -m1 -E 'resuming from|nothing to resume' "$out" || echo "no resume line")" \
        grep -q -E "resuming from ckpt|nothing to resume" "$out"
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
        test "$(field "$info" epochs)" = "$("$venv/bin/python" -c "print(list(range($epochs)))")"
    check "$name checkpoint" "a graceful_shutdown checkpoint saved when stopped: $(field "$info" checkpoints)" \
        grep -q "graceful_shutdown" <<<"$(field "$info" checkpoints)"
    if [ "$state" != COMPLETED ]; then
        echo "---- flodl-mpi-$job.out"; tail -n 40 "$out" 2>/dev/null
    fi
}

# 2a. Slurm's own warning signal, as in the script: --time=2 with
# --signal=B:USR1@60. Slurm checks time limits every 30 s, so USR1 comes 30 to
# 60 s after the start, within the paced run's first epochs. The requeued
# attempt gets a longer limit so that it finishes.
natural=$(submit "${cpu_only[*]} ${one_at_a_time[*]} --time=2 --signal=B:USR1@60 jobs/slurm-preemptible.sbatch ${paced[*]} --epochs $natural_epochs")
# 2b. A manual stop through the batch shell once training is under way (after epoch 1).
manual=$(submit "${cpu_only[*]} ${one_at_a_time[*]} --time=10 jobs/slurm-preemptible.sbatch ${paced[*]} --epochs $manual_epochs")
# ---- 1. one node and "multi-node" (on one node): queued after the preemptible jobs
declare -A job_of
for script in slurm-one-node slurm-multi-node; do
    job_of[$script]=$(submit "${cpu_only[*]} ${one_at_a_time[*]} --nodes=1 jobs/$script.sbatch --epochs 1") ||
        bad "$script" "not submitted"
done
# Act on the preemptible jobs as their moments come (the other jobs run meanwhile).
natural_requeued=0
manual_signalled=0
t0=$(date +%s)
init_failed() {  # init_failed JOB: a rank failed inside MPI_Init (the others wait there)
    grep -q "Fatal error in internal_Init_thread" "$tmp/work/flodl-mpi-$1.out" 2>/dev/null
}
while (( $(date +%s) - t0 < 480 )) && (( natural_requeued == 0 || manual_signalled == 0 )); do
    if (( natural_requeued == 0 )) && init_failed "$natural"; then scancel "$natural"; natural_requeued=2; fi
    if (( manual_signalled == 0 )) && init_failed "$manual"; then scancel "$manual"; manual_signalled=2; fi
    if (( natural_requeued == 0 )) && [ "$(job_field "$natural" Restarts)" -ge 1 ] 2>/dev/null; then
        scontrol update JobId="$natural" TimeLimit=10
        natural_requeued=1
    fi
    if (( manual_signalled == 0 )) && grep -q "epoch 1/" "$tmp/work/flodl-mpi-$manual.out" 2>/dev/null; then
        as_user "scancel --batch --signal=USR1 $manual"
        manual_signalled=1
    fi
    sleep 0.5
done
check "natural signal requeue" "job $natural: $(grep -m1 'got SIGUSR1' "$tmp/work/flodl-mpi-$natural.out" || echo "no USR1 seen by the script")" \
    test "$natural_requeued" = 1
check "scancel --batch signal" "job $manual: $(grep -m1 'got SIGUSR1' "$tmp/work/flodl-mpi-$manual.out" || echo "epoch 1 never ended")" \
    test "$manual_signalled" = 1
# ---- the two plain jobs -------------------------------------------------------
for script in slurm-one-node slurm-multi-node; do
    job=${job_of[$script]:-}
    [ -n "$job" ] || continue
    state=$(wait_job "$job" 480)
    info=$(inspect "$job")
    check "$script state" "job $job $state, exit code $(job_field "$job" ExitCode)" \
        test "$state/$(job_field "$job" ExitCode)" = "COMPLETED/0:0"
    check "$script world size" "metrics.h5 world_size $(field "$info" world_size), $ranks ranks started" \
        test "$(field "$info" world_size)" = "$ranks"
    check "$script metrics" "epochs $(field "$info" epochs), rounds $(field "$info" rounds) continuous $(field "$info" rounds_continuous)" \
        test "$(field "$info" epochs)/$(field "$info" rounds_continuous)" = "[0]/True"
    check "$script checkpoints" "$(field "$info" checkpoints)" \
        grep -q "ckpt-e000001" <<<"$(field "$info" checkpoints)"
    check "$script done line" "$(grep -m1 'done:' "$tmp/work/flodl-mpi-$job.out" || echo "no 'done:' line")" \
        grep -q "done: test accuracy" "$tmp/work/flodl-mpi-$job.out"
    if [ "$state" != COMPLETED ]; then
        echo "---- flodl-mpi-$job.out"; tail -n 30 "$tmp/work/flodl-mpi-$job.out" 2>/dev/null
    fi
done


check_resumed "natural signal" "$natural" "$natural_epochs"
check_resumed "scancel --batch" "$manual" "$manual_epochs"

echo "slurm checks: $passed passed, $failed failed ($(( $(date +%s) - start )) s)"
[ "$failed" = 0 ]
