# The job scripts on a two-node Slurm (sourced by tests/slurm/check.sh, which runs two_node_checks).
#
# nodea and nodeb are hosts of their own on this machine (tests/slurm/cluster.sh's
# hosts_cluster_up: the multi-host harness's UTS, mount and network namespaces, a bridge
# between them), one slurmd on each, slurmctld and munged on nodea. Jobs are submitted on
# nodea, as the test user, from a directory of their own, with the CPU-only overrides and
# --nodes=2: 2 nodes x 2 tasks. Both jobs run the paced digits model
# (tests/slurm/paced_model.py) with the same options, each rank writing its final model
# (FLODL_STATE_DIR):
#
#   slurm-multi-node   not paced: runs through; the reference
#   preemptible        paced in its first attempt; `scancel --batch --signal=USR1` once
#                      epoch 1 is done, so it stops in training, saves, exits 4 and requeues
#                      itself; the resumed attempt completes
#
# Checked: both completed (the preemptible after exactly one requeue); metrics.h5's hosts
# and every rank's own host name and SLURMD_NODENAME are nodea, nodea, nodeb, nodeb; the
# log names the node leaders' Allreduce across 2 nodes; the model is the same bits on every
# rank; the rounds are continuous across the attempts; the preemptible's final model is the
# multi-node run's, bit for bit (a stop and resume on two nodes changes nothing).
#
# The jobs' environment adds UCX_TLS=tcp,self UCX_NET_DEVICES=eth0 (the job script's "TCP
# only" setting, without sm): the hosts share one kernel, and UCX's shared-memory transports
# would move the bytes between hosts behind the link's back (the multi-host harness does the
# same).

two_node_checks() {
    local t multi preempt info minfo signalled=0 hosts4 log
    t=$(date +%s)
    work=$tmp/two-nodes
    mkdir -p "$work"
    cp -r "$repo/jobs" "$here/paced_model.py" "$work/"
    chown -R "$user:" "$work"
    local status=0
    FLODL_SLURM_MIN_CPUS=$node_cpus hosts_cluster_up "$tmp/hosts" 2 2>"$tmp/hosts.err" || status=$?
    if [ "$status" = 3 ]; then
        echo skip > "$tmp/two-nodes.state"
        echo "SKIP two nodes: $(tail -n 1 "$tmp/hosts.err")"
        work=$tmp/work
        return 0
    elif [ "$status" != 0 ]; then
        echo failed > "$tmp/two-nodes.state"
        bad "two nodes up" "the two-node Slurm did not start: $(tail -n 5 "$tmp/hosts.err" | tr '\n' ' ')"
        hosts_cluster_down "$tmp/hosts"
        work=$tmp/work
        return 0
    fi
    # Client commands reach slurmctld from a host: the check's helpers call these.
    scontrol() { on_host nodea scontrol "$@"; }
    squeue() { on_host nodea squeue "$@"; }
    scancel() { on_host nodea scancel "$@"; }
    sinfo() { on_host nodea sinfo "$@"; }
    submit_on=(on_host nodea)
    job_env=(UCX_TLS=tcp,self UCX_NET_DEVICES=eth0)
    two_nodes_ran=1
    echo ran > "$tmp/two-nodes.state"
    ok "two nodes up" "Slurm $(sinfo -V | awk '{print $2}') in $(( $(date +%s) - t )) s: $(sinfo -h -N -o '%N@%o' | tr '\n' ' ')"

    local args=(--model paced_model.py:paced_mlp --keep-checkpoints 100 --epochs 3)
    local two=("${cpu_only[@]}" --nodes=2)
    # --exclusive=user: as shipped (--exclusive) it would hold the nodes until the other job is done.
    multi=$(submit "${two[*]} --exclusive=user --export=ALL,FLODL_PACED_ATTEMPTS=0,FLODL_STATE_DIR=$work/states/multi-node" \
        "jobs/slurm-multi-node.sbatch ${args[*]}")
    preempt=$(submit "${two[*]} --time=10 --export=ALL,FLODL_STATE_DIR=$work/states/preemptible" \
        "jobs/slurm-preemptible.sbatch ${args[*]}")
    echo "check.sh: two nodes: submitted multi-node $multi, preemptible $preempt"
    local t1
    t1=$(date +%s)
    while (( $(date +%s) - t1 < 300 )); do
        if init_failed "$preempt" && [ "$(job_field "$preempt" JobState)" = RUNNING ]; then scancel "$preempt"; break; fi
        if grep -q "epoch 1/" "$(log_of "$preempt")" 2>/dev/null; then
            as_user "scancel --batch --signal=USR1 $preempt"
            signalled=1
            break
        fi
        final_state "$(job_field "$preempt" JobState)" && break
        sleep 0.3
    done
    check "two nodes preemptible signal" "job $preempt: $(grep -m1 'got SIGUSR1' "$(log_of "$preempt")" || echo "epoch 1 never ended")" \
        test "$signalled" = 1

    hosts4="['nodea', 'nodea', 'nodeb', 'nodeb']"
    local job name state
    for name in multi-node preemptible; do
        job=$multi
        [ "$name" = preemptible ] && job=$preempt
        state=$(wait_job "$job" 300)
        log=$(log_of "$job")
        info=$(inspect "$job" --states "$work/states/$name" ${minfo:+--reference "$work/runs/$multi"})
        [ "$name" = multi-node ] && minfo=$info
        local restarts=0
        [ "$name" = preemptible ] && restarts=1
        check "two nodes $name state" "job $job $state, exit code $(job_field "$job" ExitCode), restarts $(job_field "$job" Restarts)" \
            test "$state/$(job_field "$job" ExitCode)/$(job_field "$job" Restarts)" = "COMPLETED/0:0/$restarts"
        check "two nodes $name hosts" "metrics.h5 hosts $(field "$info" hosts); each rank's host $(field "$info" state_hosts), node $(field "$info" state_nodes)" \
            test "$(field "$info" hosts)/$(field "$info" state_hosts)/$(field "$info" state_nodes)" = "$hosts4/$hosts4/$hosts4"
        check "two nodes $name across nodes" "$(grep -m1 -o "node leaders' MPI Allreduce across nodes ([^)]*)" "$work/runs/$job/train.log" 2>/dev/null || echo "no cross-node reduce in train.log")" \
            grep -q "node leaders' MPI Allreduce across nodes (2 nodes" "$work/runs/$job/train.log"
        check "two nodes $name identical" "the model the same bits on every rank: $(field "$info" identical)" \
            test "$(field "$info" identical)" = True
        check "two nodes $name rounds" "epochs $(field "$info" epochs), rounds $(field "$info" rounds) continuous $(field "$info" rounds_continuous)" \
            test "$(field "$info" epochs)/$(field "$info" rounds_continuous)" = "[1, 2, 3]/True"
        if [ "$state" != COMPLETED ]; then
            echo "---- $log"; tail -n 40 "$log" 2>/dev/null
        fi
    done
    check "two nodes preemptible requeued on exit 4" "$(grep -m1 'requeueing job' "$(log_of "$preempt")" || echo "no requeue message")" \
        test "$(grep -c "stopped and saved in runs/$preempt/checkpoints; requeueing job $preempt" "$(log_of "$preempt")")" = 1
    check "two nodes preemptible resumed" "$(grep -m1 -E 'resuming from' "$(log_of "$preempt")" || echo "no resume line")" \
        grep -q "resuming from ckpt" "$(log_of "$preempt")"
    check "two nodes preemptible equals the uninterrupted run" "final model bit for bit the multi-node job's ($multi): $(field "$info" equals_reference)" \
        test "$(field "$info" equals_reference)" = True

    scancel --user="$user" 2>/dev/null || true
    hosts_cluster_down "$tmp/hosts"
    unset -f scontrol squeue scancel sinfo
    unset SLURM_CONF
    submit_on=()
    job_env=()
    work=$tmp/work
    echo "check.sh: two nodes took $(( $(date +%s) - t )) s"
}
