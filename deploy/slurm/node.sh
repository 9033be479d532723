#!/usr/bin/env bash
# One node's part of a meshrl Slurm job; meshrl.sbatch runs it under srun, one task per node:
#   node.sh address        print this node's Slurm name and the address its services bind
#   node.sh coordinator    the coordinator (port MESHRL_PORT, state in MESHRL_STATE)
#   node.sh reward         a reward service
#   node.sh trainer        this node's ranks of the trainer: torchrun, rendezvous at MESHRL_RENDEZVOUS
#   node.sh rollout        rollout services: one per MESHRL_ROLLOUT_TP GPUs (vLLM), or one on CPU (hf)
# Each service logs to MESHRL_LOGS/<role>-<node>[-gpu<ids>].log. meshrl.sbatch sets the MESHRL_* variables
# this reads; the token reaches the services as MESHRL_TOKEN_FILE, never on a command line.
#
# Address: the IPv4 address of MESHRL_IFNAME when it is set; else the address the node's Slurm NodeAddr (the
# address slurmctld reaches the node at; its name when unset) resolves to, loopback excluded; else the first
# of `hostname -I`. Every service binds it, not 0.0.0.0.
#
# SIGTERM (scancel, or meshrl.sbatch's stop) reaches every process of the step at once: each service stops
# gracefully by itself (finishes its call in flight, deregisters); this script only waits for them.
set -euo pipefail

role=${1:?usage: node.sh address|coordinator|reward|trainer|rollout}
node=${SLURMD_NODENAME:-$(hostname -s)}

die() {
    echo "node.sh $role on $node: $*" >&2
    exit 1
}

node_address() {
    local address name
    if [[ -n ${MESHRL_IFNAME:-} ]]; then
        address=$(ip -o -4 addr show dev "$MESHRL_IFNAME" 2>/dev/null | awk '{split($4, a, "/"); print a[1]; exit}')
        [[ -n $address ]] || die "MESHRL_IFNAME=$MESHRL_IFNAME: no IPv4 address on that interface here"
    else
        name=$(scontrol show node "$node" --oneliner 2>/dev/null | sed -n 's/.* NodeAddr=\([^ ]*\).*/\1/p')
        address=$(getent ahostsv4 "${name:-$node}" | awk '$1 !~ /^127\./ {print $1; exit}')
        [[ -n $address ]] || address=$(hostname -I 2>/dev/null | awk '{print $1}')
        [[ -n $address ]] || die "no address: set MESHRL_IFNAME to the cluster network's interface"
    fi
    echo "$address"
}

# The GPUs this step may use: CUDA_VISIBLE_DEVICES as Slurm set it, else every GPU nvidia-smi lists.
gpus() {
    if [[ -n ${CUDA_VISIBLE_DEVICES+set} ]]; then
        [[ $CUDA_VISIBLE_DEVICES == NoDevFiles ]] || tr ',' ' ' <<<"$CUDA_VISIBLE_DEVICES"
    elif command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
        nvidia-smi --query-gpu=index --format=csv,noheader | tr '\n' ' '
    fi
}

address=$(node_address)
if [[ $role == address ]]; then
    echo "$node $address"
    exit 0
fi

python=${MESHRL_PYTHON:?set by meshrl.sbatch}
logs=${MESHRL_LOGS:?set by meshrl.sbatch}
read -r -a gpu_ids <<<"$(gpus)"
device=${MESHRL_DEVICE:-$([[ ${#gpu_ids[@]} -gt 0 ]] && echo cuda || echo cpu)}
common=(host="$address" coordinator="$MESHRL_COORDINATOR")
ports=${MESHRL_STATE:?set by meshrl.sbatch}/ports
# Each service serves /metrics on a port of its own choosing (metrics_port=0; a MESHRL_*_SETTINGS metrics_port
# wins) and writes the ports it got to $ports/ROLE@ADDRESS[-gpuIDS].json, from which meshrl.sbatch writes the
# job's Prometheus targets file.
export PYTHONUNBUFFERED=1

case $role in
coordinator)
    # shellcheck disable=SC2086  # settings are words: key=value ...
    exec "$python" -m services.coordinator host="$address" port="$MESHRL_PORT" state_dir="$MESHRL_STATE" \
        metrics_port=0 ports_file="$ports/coordinator@$address.json" ${MESHRL_COORDINATOR_SETTINGS:-} \
        >>"$logs/coordinator-$node.log" 2>&1
    ;;
reward)
    # shellcheck disable=SC2086
    exec "$python" -m services.reward "${common[@]}" metrics_port=0 ports_file="$ports/reward@$address.json" \
        ${MESHRL_REWARD_SETTINGS:-} >>"$logs/reward-$node.log" 2>&1
    ;;
trainer)
    ranks=${MESHRL_TRAINER_RANKS_PER_NODE:-$([[ $device == cuda ]] && echo "${#gpu_ids[@]}" || echo 1)}
    host=false  # the c10d rendezvous store runs on the first trainer node, whose address the endpoint names
    [[ ${MESHRL_RENDEZVOUS%:*} == "$address" ]] && host=true
    # shellcheck disable=SC2086
    exec "$python" -m torch.distributed.run --nnodes="$MESHRL_TRAINER_NODES" --nproc-per-node="$ranks" \
        --rdzv-backend=c10d --rdzv-endpoint="$MESHRL_RENDEZVOUS" --rdzv-id="meshrl-$SLURM_JOB_ID" \
        --rdzv-conf="is_host=$host" --local-addr="$address" \
        -m services.trainer "${common[@]}" device="$device" checkpoint_root="$MESHRL_STATE" \
        metrics_port=0 ports_file="$ports/trainer@$address.json" ${MESHRL_TRAINER_SETTINGS:-} \
        >>"$logs/trainer-$node.log" 2>&1
    ;;
rollout)
    if [[ $device == cpu ]]; then
        # shellcheck disable=SC2086
        "$python" -m services.rollout "${common[@]}" engine=hf device=cpu \
            metrics_port=0 ports_file="$ports/rollout@$address.json" ${MESHRL_ROLLOUT_SETTINGS:-} \
            >>"$logs/rollout-$node.log" 2>&1 &
    else
        tp=${MESHRL_ROLLOUT_TP:-1}
        (( ${#gpu_ids[@]} > 0 && ${#gpu_ids[@]} % tp == 0 )) \
            || die "${#gpu_ids[@]} GPUs (${gpu_ids[*]}) do not split into engines of MESHRL_ROLLOUT_TP=$tp"
        for ((first = 0; first < ${#gpu_ids[@]}; first += tp)); do
            visible=$(IFS=,; echo "${gpu_ids[*]:first:tp}")
            # shellcheck disable=SC2086
            CUDA_VISIBLE_DEVICES=$visible "$python" -m services.rollout "${common[@]}" engine=vllm \
                tensor_parallel_size="$tp" metrics_port=0 ports_file="$ports/rollout@$address-gpu${visible//,/_}.json" \
                ${MESHRL_ROLLOUT_SETTINGS:-} \
                >>"$logs/rollout-$node-gpu${visible//,/_}.log" 2>&1 &
        done
    fi
    trap '' TERM INT  # each service gets the signal too, and stops by itself: wait for them
    status=0
    for service in $(jobs -p); do
        wait "$service" || status=$?
    done
    exit "$status"
    ;;
*)
    die "unknown role (address, coordinator, reward, trainer, rollout)"
    ;;
esac
