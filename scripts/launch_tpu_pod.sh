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
# PYTHON is the workers' interpreter (default python3), a word their shell expands (so
# PYTHON='~/venv/bin/python' is each worker's venv); it must be Python 3.11+ (setup.py), which
# every worker is checked for before anything is copied (exit 2 otherwise).
# The repository is copied to every worker with `gcloud compute tpus tpu-vm scp`; the run is
# started with `gcloud compute tpus tpu-vm ssh --worker=all` inside a detached tmux session
# named "train" on each worker (its output appended to ~/train.log). The training arguments
# travel in a script file inside the copy (train_command.sh), quoted once for the bash that
# runs it, so they arrive verbatim ($HOME, quotes, spaces). The workdir must be storage every
# worker sees (e.g. a gcsfuse mount of a bucket). Rerunning the same line resumes from the
# latest checkpoint in the workdir; a preempted slice gets SIGTERM and saves first, and so does
# a run still going when the line is rerun (the launcher waits up to STOP_TIMEOUT seconds,
# default 900, for it to save and end before it replaces the code).
set -euo pipefail
usage="usage: $0 TPU_NAME ZONE [PROJECT] -- TRAIN_ARGS..."
# The separator is required: without it a training flag could be taken for the project.
if [[ $# -ge 3 && $3 == "--" ]]; then
  tpu=$1; zone=$2; project=""; shift 3
elif [[ $# -ge 4 && $4 == "--" ]]; then
  tpu=$1; zone=$2; project=$3; shift 4
else
  echo "$usage" >&2
  exit 2
fi
workdir_given=0
for arg in "$@"; do
  case $arg in --workdir|--workdir=?*) workdir_given=1 ;; esac
done
if (( ! workdir_given )); then
  echo "error: no --workdir among the training arguments: give one on storage every worker" \
       "sees (e.g. a gcsfuse mount of a bucket); each would train into its own ./workdir" >&2
  exit 2
fi
python=${PYTHON:-python3}
stop_timeout=${STOP_TIMEOUT:-900}
if ! [[ $stop_timeout =~ ^[0-9]+$ ]]; then
  echo "error: STOP_TIMEOUT=$stop_timeout must be a whole number of seconds" >&2
  exit 2
fi
root="$(cd "$(dirname "$0")/.." && pwd)"
# gcloud takes the command's flags after the command (`tpu-vm --zone Z ssh` is refused).
flags=(--zone "$zone")
if [[ -n $project ]]; then flags+=(--project "$project"); fi
gcloud_tpu=(gcloud compute tpus tpu-vm)

if [[ ${SKIP_COMPILE_CHECK:-0} != 1 ]]; then
  accelerator=${ACCELERATOR_TYPE:-$("${gcloud_tpu[@]}" describe "$tpu" "${flags[@]}" \
      --format='value(acceleratorType)' || true)}  # (its error, then ours below)
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

# Runs a command on every worker; a worker's failure stops the launcher with gcloud's status.
on_workers() {
  local status=0
  "${gcloud_tpu[@]}" ssh "$tpu" "${flags[@]}" --worker=all --command "$1" || status=$?
  if [[ $status != 0 ]]; then
    echo "error: $2 failed on a worker of $tpu (gcloud ssh exited $status)" >&2
    exit "$status"
  fi
}

# Every worker's interpreter first: stock TPU VM images (Ubuntu 22.04) have Python 3.10.
# ($python is not quoted for the workers' shell: it expands it, as documented above.)
need="is not Python 3.11+ (install one and set PYTHON, e.g. PYTHON=python3.11)"
on_workers "
  if ! $python -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo \"error: worker \$(hostname): PYTHON=$python $need\" >&2
    exit 2
  fi" "the Python check"

staging=$(mktemp -d)
trap 'rm -rf "$staging"' EXIT
{
  echo '#!/usr/bin/env bash'
  echo '# Written by scripts/launch_tpu_pod.sh: the training command, each argument quoted once.'
  echo 'cd "$(dirname "$0")"'
  echo '# (the run in the background, its id in ~/train.pid: a relaunch stops it by SIGTERM)'
  printf '%s scripts/train.py' "$python"
  printf ' %q' "$@"
  echo ' > >(tee -a ~/train.log) 2>&1 &'
  echo 'echo $! > ~/train.pid'
  echo 'wait $!'
} > "$staging/train_command.sh"
tar -czf "$staging/recurrentgemma_jax.tgz" -C "$root" --exclude=.git --exclude=runs \
    --exclude=workdir --exclude=./train_command.sh . -C "$staging" train_command.sh
"${gcloud_tpu[@]}" scp "$staging/recurrentgemma_jax.tgz" "$tpu":~/ "${flags[@]}" --worker=all
# The tmux command names only the script, so no argument is parsed by another shell; a session
# gone right after its start (the command could not run) fails the launcher.
# A run still going on a worker (a relaunch) is stopped first as a preemption would: SIGTERM,
# and every worker's run saves the same step; only once it has ended is its code replaced.
on_workers "
  set -e
  pid=\$(cat ~/train.pid 2>/dev/null || true)
  if [[ -n \$pid ]] && grep -qs scripts/train.py /proc/\$pid/cmdline; then
    echo \"worker \$(hostname): stopping the run there (SIGTERM: it saves its step first)\"
    kill -TERM \$pid
    for ((i = 0; i < $stop_timeout; i++)); do
      grep -qs scripts/train.py /proc/\$pid/cmdline || break
      sleep 1
    done
    if grep -qs scripts/train.py /proc/\$pid/cmdline; then
      echo \"error: worker \$(hostname): the run there did not stop within $stop_timeout s\" \\
           \"(STOP_TIMEOUT); nothing started\" >&2
      exit 3
    fi
  fi
  tmux kill-session -t train 2>/dev/null || true
  mkdir -p ~/recurrentgemma_jax && tar -xzf ~/recurrentgemma_jax.tgz -C ~/recurrentgemma_jax
  cd ~/recurrentgemma_jax
  $python -m pip install -q -e '.[tpu]'
  tmux new-session -d -s train 'bash ~/recurrentgemma_jax/train_command.sh'
  sleep 1
  tmux has-session -t train" "the start (its output: ~/train.log there)"
echo "started on every worker of $tpu; follow with: ${gcloud_tpu[*]} ssh $tpu ${flags[*]}" \
     "--worker=0 --command 'tail -f ~/train.log'"
