#!/usr/bin/env bash
# Installs the package on every worker of a TPU VM pod slice, then starts the same training
# command on all of them (JAX finds the pod's coordinator itself).
#
#   scripts/launch_tpu_pod.sh TPU_NAME ZONE [PROJECT] -- --config configs/griffin.py:7b \
#       --workdir /mnt/bucket/runs/g7b --config.mesh.model=8 --config.zero=1 \
#       --config.data.source=tfds --config.data.tfds_name=c4/en:3.1.0 \
#       --config.data.tfds_data_dir=gs://BUCKET/tfds
#
# First, here, the training step is compiled for the slice's topology (scripts/compile_tpu.py,
# libtpu's compile-only devices: `pip install -e '.[tpu]'` on this machine): a run that does not
# fit in the chips' HBM, or does not compile, is not started (exit 1, or 2 for a bad config).
# The slice's accelerator type (v5p-128, v5litepod-16, ...) is read with `gcloud compute tpus
# tpu-vm describe`, or taken from ACCELERATOR_TYPE; SKIP_COMPILE_CHECK=1 skips the check.
#
# The repository is copied to every worker with `gcloud compute tpus tpu-vm scp`; the run is
# started with `gcloud compute tpus tpu-vm ssh --worker=all` inside a detached tmux session
# named "train" on each worker (logs: ~/train.log). The workdir must be storage every worker
# sees (e.g. a gcsfuse mount of a bucket). Rerunning the same line resumes from the
# latest checkpoint in the workdir; a preempted slice gets SIGTERM and saves first.
set -euo pipefail
if [[ $# -lt 3 ]]; then
  echo "usage: $0 TPU_NAME ZONE [PROJECT] -- TRAIN_ARGS..." >&2
  exit 2
fi
tpu=$1; zone=$2; shift 2
project_flag=()
if [[ $1 != "--" ]]; then project_flag=(--project "$1"); shift; fi
[[ $1 == "--" ]] && shift
root="$(cd "$(dirname "$0")/.." && pwd)"
gcloud_tpu=(gcloud compute tpus tpu-vm "${project_flag[@]}" --zone "$zone")

if [[ ${SKIP_COMPILE_CHECK:-0} != 1 ]]; then
  accelerator=${ACCELERATOR_TYPE:-$("${gcloud_tpu[@]}" describe "$tpu" \
      --format='value(acceleratorType)')}
  if [[ -z $accelerator ]]; then
    echo "error: no accelerator type for $tpu (set ACCELERATOR_TYPE, e.g. v5p-128)" >&2
    exit 2
  fi
  echo "compiling the training step for $tpu ($accelerator) before starting it"
  status=0
  # (from the repository root, as on the workers: config paths are relative to it)
  (cd "$root" && python3 scripts/compile_tpu.py --topology "$accelerator" "$@") || status=$?
  if [[ $status != 0 ]]; then
    echo "error: not starting the run on $tpu: the compile check exited $status" \
         "(SKIP_COMPILE_CHECK=1 starts it anyway)" >&2
    exit "$status"
  fi
fi

tar -C "$root" --exclude=.git --exclude=runs --exclude=workdir -czf /tmp/recurrentgemma_jax.tgz .
"${gcloud_tpu[@]}" scp /tmp/recurrentgemma_jax.tgz "$tpu":~/ --worker=all
"${gcloud_tpu[@]}" ssh "$tpu" --worker=all --command "
  set -e
  mkdir -p ~/recurrentgemma_jax && tar -xzf ~/recurrentgemma_jax.tgz -C ~/recurrentgemma_jax
  cd ~/recurrentgemma_jax
  python3 -m pip install -q -e '.[tpu]'
  tmux kill-session -t train 2>/dev/null || true
  tmux new-session -d -s train \"python3 scripts/train.py $(printf '%q ' "$@") 2>&1 | tee ~/train.log\"
"
echo "started on every worker of $tpu; follow with: ${gcloud_tpu[*]} ssh $tpu --worker=0 --command 'tail -f ~/train.log'"
