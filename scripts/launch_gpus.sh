#!/usr/bin/env bash
# One training process per GPU, on one node or several (SLURM-compatible).
#
#   One node, all its GPUs:
#     scripts/launch_gpus.sh --config configs/griffin.py:400m --workdir runs/g400m --config.zero=1
#   Several nodes without SLURM: run the same line on every node with
#     NNODES=2 NODE_RANK=<0|1> COORDINATOR=<node0-host>:12345 scripts/launch_gpus.sh ...
#   Under SLURM (one task per node; this script starts one process per GPU of its node):
#     srun --nodes=2 --ntasks-per-node=1 --gpus-per-node=8 scripts/launch_gpus.sh ...
#
# GPUS_PER_NODE sets how many processes start on this node (default: the GPUs nvidia-smi
# lists); COORDINATOR_PORT is the coordinator's port where COORDINATOR is not given (node 0 of
# a SLURM job, or localhost on one node; default 12345).
# Each process sees one GPU (CUDA_VISIBLE_DEVICES) and joins the job through
# jax.distributed (JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, read by
# sharding/distributed.py). Every process runs the same command; the data pipeline gives each
# its share of the global batch. SIGTERM or SIGINT to this script is passed to every process as
# SIGTERM (each saves its step and exits 0) and the script waits for them, so a preempted job
# (a container whose first process is this script) saves. When a process fails (exits non-zero),
# the others on this node get SIGTERM too (they save; the job cannot go on without it) and the
# script exits with the failed one's status. Rerunning the same line resumes from the last
# checkpoint. Paths (--workdir, --config) are the caller's: relative ones start where the
# script is run from (the repository root in the lines above).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"

positive() { [[ $1 =~ ^[0-9]+$ ]] && (( 10#$1 > 0 )); }
if [[ -n ${GPUS_PER_NODE:-} ]]; then
  gpus_per_node=$GPUS_PER_NODE
  if ! positive "$gpus_per_node"; then
    echo "error: GPUS_PER_NODE=$gpus_per_node must be a positive integer" >&2
    exit 2
  fi
  gpus_per_node=$((10#$gpus_per_node))  # (08 is not octal)
else
  # (only "GPU n: ..." lines: a failing nvidia-smi prints its reason on stdout)
  gpus_per_node=$(nvidia-smi --list-gpus 2>/dev/null | grep -c '^GPU ') || gpus_per_node=0
  if [[ $gpus_per_node == 0 ]]; then
    echo "error: no GPUs found (nvidia-smi --list-gpus); set GPUS_PER_NODE to start anyway" >&2
    exit 2
  fi
fi
nnodes=${NNODES:-${SLURM_NNODES:-1}}
node_rank=${NODE_RANK:-${SLURM_NODEID:-0}}
if ! positive "$nnodes"; then
  echo "error: NNODES=$nnodes must be a positive integer" >&2
  exit 2
fi
nnodes=$((10#$nnodes))
if ! [[ $node_rank =~ ^[0-9]+$ ]] || (( 10#$node_rank >= nnodes )); then
  echo "error: NODE_RANK=$node_rank must be 0 to $((nnodes - 1)) (NNODES=$nnodes)" >&2
  exit 2
fi
node_rank=$((10#$node_rank))
port=${COORDINATOR_PORT:-12345}
if [[ -z "${COORDINATOR:-}" ]]; then
  if [[ -n "${SLURM_JOB_NODELIST:-}" ]]; then
    COORDINATOR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1):$port"
  elif (( nnodes > 1 )); then
    # localhost would be a different coordinator on every node: each would wait for the others.
    echo "error: NNODES=$nnodes needs COORDINATOR=<node0-host>:PORT (or a SLURM job)" >&2
    exit 2
  else
    COORDINATOR="localhost:$port"
  fi
fi

pids=()
# Background processes of a script ignore SIGINT, so both signals go on as SIGTERM, which
# train.py answers by saving.
stopping=0
forward() { stopping=1; kill -TERM "${pids[@]}" 2>/dev/null || true; }
trap forward TERM INT
for ((local_rank = 0; local_rank < gpus_per_node; local_rank++)); do
  CUDA_VISIBLE_DEVICES=$local_rank \
  JAX_COORDINATOR_ADDRESS=$COORDINATOR \
  JAX_NUM_PROCESSES=$((nnodes * gpus_per_node)) \
  JAX_PROCESS_ID=$((node_rank * gpus_per_node + local_rank)) \
    python3 "$root/scripts/train.py" "$@" &
  pids+=($!)
done
# Every second, the processes that ended (bash has reaped them: `kill -0` fails, `wait` gives
# the status at once); the first failure stops the rest.
status=0
running=("${!pids[@]}")  # local ranks
while (( ${#running[@]} )); do
  still=()
  for local_rank in "${running[@]}"; do
    pid=${pids[$local_rank]}
    if kill -0 "$pid" 2>/dev/null; then still+=("$local_rank"); continue; fi
    code=0
    wait "$pid" || code=$?
    if (( code != 0 && status == 0 )); then
      status=$code
      if (( ! stopping )); then
        echo "error: process $((node_rank * gpus_per_node + local_rank)) (GPU $local_rank)" \
             "exited $code; stopping the others on this node (SIGTERM: they save)" >&2
        forward
      fi
    fi
  done
  running=(${still[@]+"${still[@]}"})
  if (( ${#running[@]} )); then sleep 1; fi
done
exit $status
