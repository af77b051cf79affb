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
# Each process sees one GPU (CUDA_VISIBLE_DEVICES) and joins the job through
# jax.distributed (JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, read by
# sharding/distributed.py). Every process runs the same command; the data pipeline gives each
# its share of the global batch. Rerunning the same line resumes from the last checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."

gpus_per_node=${GPUS_PER_NODE:-$(nvidia-smi --list-gpus | wc -l)}
nnodes=${NNODES:-${SLURM_NNODES:-1}}
node_rank=${NODE_RANK:-${SLURM_NODEID:-0}}
if [[ -z "${COORDINATOR:-}" ]]; then
  if [[ -n "${SLURM_JOB_NODELIST:-}" ]]; then
    COORDINATOR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1):12345"
  else
    COORDINATOR="localhost:12345"
  fi
fi

pids=()
for ((local_rank = 0; local_rank < gpus_per_node; local_rank++)); do
  CUDA_VISIBLE_DEVICES=$local_rank \
  JAX_COORDINATOR_ADDRESS=$COORDINATOR \
  JAX_NUM_PROCESSES=$((nnodes * gpus_per_node)) \
  JAX_PROCESS_ID=$((node_rank * gpus_per_node + local_rank)) \
    python3 scripts/train.py "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
