"""The TPU-pod launcher, up to the point where a real pod is needed: the gcloud commands it
issues (to a stand-in gcloud on PATH that parses them as gcloud does and runs ssh's command
on stand-in workers) copy the code to every worker and start the exact training command there,
after compiling the step for the slice's topology here."""

import os
import signal
import stat
import subprocess
import time

import pytest

from helpers import ROOT, script_env


# gcloud as it parses a `compute tpus tpu-vm` line: the command first, then its flags (a flag
# before the command is refused, as real gcloud does), --zone required. With WORKERS set, `scp`
# copies into each stand-in worker's home and `ssh --command` runs the string there through
# bash, as ssh does; otherwise ssh only records.
_GCLOUD = r"""#!/usr/bin/env bash
printf "%s\0" "$*" >> "$GCLOUD_LOG"  # a line may hold newlines
if [[ "$1 $2 $3" != "compute tpus tpu-vm" ]]; then echo "ERROR: unknown command" >&2; exit 2; fi
case $4 in
  describe|scp|ssh) ;;
  *) echo "ERROR: (gcloud.compute.tpus.tpu-vm) unrecognized arguments: $4" >&2; exit 2 ;;
esac
sub=$4; shift 4
command=""; zone=""; positional=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --command) command=$2; shift 2 ;;
    --zone) zone=$2; shift 2 ;;
    --project) shift 2 ;;
    --*) shift ;;
    *) positional+=("$1"); shift ;;
  esac
done
if [[ -z $zone ]]; then
  echo "ERROR: (gcloud.compute.tpus.tpu-vm.$sub) argument --zone: Must be specified." >&2
  exit 2
fi
if [[ $sub == describe ]]; then echo v5litepod-4; exit 0; fi
status=0
for home in ${WORKERS:-}; do
  if [[ $sub == scp ]]; then cp "${positional[0]}" "$home/"; fi
  if [[ $sub == ssh ]]; then
    (cd "$home" && HOME=$home PATH="$WORKER_BIN:$PATH" bash -c "$command") || status=$?
  fi
done
exit $status
"""

# tmux on a worker: new-session runs its command through sh -c in the background, as a session
# that ends with the command.
_TMUX = r"""#!/usr/bin/env bash
case $1 in
  kill-session) exit 1 ;;
  new-session) rm -f "$HOME/tmux.ended"
               (sh -c "$5"; touch "$HOME/tmux.ended") > "$HOME/tmux.out" 2>&1 & ;;
  has-session) [[ ! -e $HOME/tmux.ended ]] ;;
esac
"""

# A worker's interpreters: python3 is a stock image's 3.10, python3.11 a good one. train.py
# writes its arguments, NUL-separated, and stays up TRAIN_SECONDS (default 3; or exits at once
# with TRAIN_EXITS set, a run that could not start); a SIGTERM makes it "save" and exit 0, or
# with TRAIN_IGNORES_TERM set, nothing (a run that does not stop).
_PYTHON = r"""#!/usr/bin/env bash
case $1 in
  -c) [[ $(basename "$0") == python3.11 ]]; exit ;;
  -m) exit 0 ;;
  scripts/train.py)
    shift; printf '%s\0' "$@" > "$HOME/argv"
    if [[ -n ${TRAIN_EXITS:-} ]]; then exit 1; fi
    if [[ -n ${TRAIN_IGNORES_TERM:-} ]]; then trap '' TERM; else
      trap 'sleep 1; echo "saved $RUN" >> "$HOME/events"; kill $!; exit 0' TERM; fi
    echo "started $RUN" >> "$HOME/events"
    sleep "${TRAIN_SECONDS:-3}" & wait $!; wait $! ;;
esac
"""

_ARGS = ["--config", "configs/griffin.py:7b", "--workdir", "/mnt/b/run 1", "--config.zero=1",
         "--config.data.tokenizer=$HOME/tok.model", 'say "hi"', "it's", "`id` *", "a\nb", ""]


def _executable(path, text):
  path.parent.mkdir(exist_ok=True)
  path.write_text(text)
  path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _calls(log):
  return log.read_text().split("\0")[:-1] if log.exists() else []


def _pod(tmp_path, args, workers=2, **env):
  """Runs the launcher (no compile check) against stand-in workers; returns the process, the
  gcloud lines and the worker directories."""
  homes = [tmp_path / f"worker{i}" for i in range(workers)]
  for home in homes:
    home.mkdir(exist_ok=True)  # (a relaunch: the same workers)
  _executable(tmp_path / "bin" / "gcloud", _GCLOUD)
  for name, text in (("tmux", _TMUX), ("python3", _PYTHON), ("python3.11", _PYTHON)):
    _executable(tmp_path / "worker_bin" / name, text)
  log = tmp_path / "gcloud.log"
  full_env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
  full_env.update(PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", SKIP_COMPILE_CHECK="1",
                  GCLOUD_LOG=str(log), WORKER_BIN=str(tmp_path / "worker_bin"),
                  WORKERS=" ".join(map(str, homes)), **env)
  proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "launch_tpu_pod.sh"), *args],
                        env=full_env, capture_output=True, text=True, timeout=120)
  return proc, _calls(log), homes


def test_tpu_pod_launcher_starts_the_exact_arguments_on_every_worker(tmp_path):
  proc, calls, homes = _pod(tmp_path, ["my-pod", "us-central2-b", "my-project", "--", *_ARGS],
                            PYTHON="python3.11")
  assert proc.returncode == 0, proc.stderr
  assert "started on every worker of my-pod" in proc.stdout
  check, scp, start = calls
  assert check.startswith("compute tpus tpu-vm ssh my-pod --zone us-central2-b "
                          "--project my-project --worker=all --command")
  assert scp.startswith("compute tpus tpu-vm scp ")
  assert scp.endswith("my-pod:~/ --zone us-central2-b --project my-project --worker=all")
  assert "python3.11 -m pip install -q -e '.[tpu]'" in start  # jax[tpu] at the project's jax
  for home in homes:
    # Every argument as given: not expanded, split or re-quoted by a shell on the way.
    for _ in range(50):
      if (home / "argv").exists():
        break
      time.sleep(0.1)
    assert (home / "argv").read_text().split("\0")[:-1] == _ARGS
    script = (home / "recurrentgemma_jax" / "train_command.sh").read_text()
    assert "\npython3.11 scripts/train.py " in script  # PYTHON, the one the check passed


def test_tpu_pod_launcher_fails_when_the_run_does_not_start(tmp_path):
  proc, _, _ = _pod(tmp_path, ["my-pod", "us-central2-b", "--", *_ARGS], workers=1,
                    PYTHON="python3.11", TRAIN_EXITS="1")
  assert proc.returncode != 0 and "started on every worker" not in proc.stdout
  assert "error: the start (its output: ~/train.log there) failed on a worker of my-pod" in (
      proc.stderr)


def test_tpu_pod_launcher_refuses_a_worker_python_older_than_3_11(tmp_path):
  proc, calls, _ = _pod(tmp_path, ["my-pod", "us-central2-b", "--", *_ARGS], workers=1)
  assert proc.returncode == 2, proc.stderr
  assert "PYTHON=python3 is not Python 3.11+ (install one and set PYTHON" in proc.stderr
  assert len(calls) == 1  # nothing copied or installed


def test_a_relaunch_stops_the_running_run_and_waits_for_its_save(tmp_path):
  # The run started first is still going when the line is rerun: it gets SIGTERM (as in a
  # preemption, the step saved) and has ended before the code is replaced and the new one
  # starts. (tmux kill-session would have sent it SIGHUP, and the untar replaced its code.)
  args = ["my-pod", "us-central2-b", "--", *_ARGS]
  first, _, [home] = _pod(tmp_path, args, workers=1, PYTHON="python3.11", TRAIN_SECONDS="60",
                          RUN="1")
  assert first.returncode == 0, first.stderr
  for _ in range(50):
    if (home / "events").exists():
      break
    time.sleep(0.1)
  again, _, _ = _pod(tmp_path, args, workers=1, PYTHON="python3.11", TRAIN_SECONDS="3", RUN="2")
  assert again.returncode == 0, again.stderr
  assert "stopping the run there (SIGTERM: it saves its step first)" in again.stdout
  for _ in range(50):
    if (home / "events").read_text().count("\n") >= 3:
      break
    time.sleep(0.1)
  assert (home / "events").read_text().splitlines() == ["started 1", "saved 1", "started 2"]


def test_a_relaunch_starts_nothing_while_the_old_run_does_not_stop(tmp_path):
  args = ["my-pod", "us-central2-b", "--", *_ARGS]
  first, _, [home] = _pod(tmp_path, args, workers=1, PYTHON="python3.11", TRAIN_SECONDS="30",
                          TRAIN_IGNORES_TERM="1", RUN="1")
  assert first.returncode == 0, first.stderr
  again, _, _ = _pod(tmp_path, args, workers=1, PYTHON="python3.11", STOP_TIMEOUT="2", RUN="2")
  assert again.returncode == 3, again.stderr
  assert "the run there did not stop within 2 s (STOP_TIMEOUT); nothing started" in again.stderr
  assert (home / "events").read_text().splitlines() == ["started 1"]
  pid = int((home / "train.pid").read_text())
  os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("args", [[], ["my-pod", "zone", "proj"],
                                  ["my-pod", "zone", "--config", "c.py"],
                                  ["my-pod", "zone", "proj", "extra", "--", "--config", "c.py"]])
def test_tpu_pod_launcher_usage_error(args):
  proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "launch_tpu_pod.sh"), *args],
                        capture_output=True, text=True)
  assert proc.returncode == 2 and proc.stderr.startswith("usage:"), proc.stderr


def test_tpu_pod_launcher_needs_a_workdir_every_worker_shares(tmp_path):
  proc, calls, _ = _pod(tmp_path, ["my-pod", "zone", "--", "--config", "configs/hawk.py"])
  assert proc.returncode == 2 and calls == [], proc.stderr
  assert proc.stderr.startswith("error: no --workdir among the training arguments")


# A model whose TPU compile takes seconds.
TINY = ["--config.model.family=hawk", "--config.model.width=64", "--config.model.lru_width=64",
        "--config.model.num_layers=2", "--config.model.num_gate_blocks=2",
        "--config.model.mlp_expanded_width=128", "--config.seq_len=128",
        "--config.batch_size=8"]


def _launch(tmp_path, *train_args):
  """Runs the launcher with the stand-in gcloud (recording only; my-pod is a v5litepod-4);
  returns the process and the gcloud command lines."""
  log = tmp_path / "gcloud.log"
  _executable(tmp_path / "bin" / "gcloud", _GCLOUD)
  env = script_env(PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", GCLOUD_LOG=str(log))
  env.pop("SKIP_COMPILE_CHECK", None)
  env.pop("WORKERS", None)
  proc = subprocess.run(
      ["bash", os.path.join(ROOT, "scripts", "launch_tpu_pod.sh"), "my-pod", "us-central2-b",
       "--", "--workdir", "/mnt/b/run", *TINY, *train_args],
      env=env, capture_output=True, text=True, timeout=600)
  return proc, _calls(log)


def test_tpu_pod_launcher_compiles_for_the_slice_then_starts_a_run_that_fits(tmp_path):
  proc, calls = _launch(tmp_path)
  assert proc.returncode == 0, proc.stderr
  assert calls[0] == ("compute tpus tpu-vm describe my-pod --zone us-central2-b "
                      "--format=value(acceleratorType)")
  assert "compiling the training step for my-pod (v5litepod-4)" in proc.stdout
  assert "HBM per chip, training step" in proc.stdout and ": fits" in proc.stdout
  assert "ssh my-pod --zone us-central2-b --worker=all" in calls[1]  # the Python check
  assert " scp " in calls[2] and "ssh my-pod --zone us-central2-b --worker=all" in calls[3]


def test_tpu_pod_launcher_refuses_a_run_that_does_not_fit(tmp_path):
  # A 16M-token float32 embedding with its AdamW state: over a v5e chip's 16 GiB.
  proc, calls = _launch(tmp_path, "--config.model.vocab_size=16000000")
  assert proc.returncode == 1, proc.stderr
  assert len(calls) == 1 and " describe " in f" {calls[0]} "  # nothing copied or started
  assert "error: does not fit on v5e-4" in proc.stderr
  assert "not starting the run on my-pod" in proc.stderr


# train.py on a GPU node: records its start and a SIGTERM, after which it exits 0 (as train.py
# does once it has saved).
# With FAILS set, process FAILS exits 3 at once (a run that crashed).
_TRAINER = r"""#!/usr/bin/env bash
trap 'echo "$JAX_PROCESS_ID saved" >> "$TRAIN_LOG"; kill $!; exit 0' TERM
echo "$JAX_PROCESS_ID $CUDA_VISIBLE_DEVICES $JAX_NUM_PROCESSES $JAX_COORDINATOR_ADDRESS $*" \
    "in $PWD" >> "$TRAIN_LOG"
if [[ ${FAILS:-} == "$JAX_PROCESS_ID" ]]; then sleep 1; exit 3; fi
sleep 60 & wait $!
echo "$JAX_PROCESS_ID was never stopped" >> "$TRAIN_LOG"
"""


def _gpus(tmp_path, *args, **env):
  _executable(tmp_path / "bin" / "python3", _TRAINER)
  _executable(tmp_path / "bin" / "nvidia-smi",  # a node whose driver is not loaded
              "#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate'\nexit 9\n")
  full_env = {k: v for k, v in os.environ.items()
              if not k.startswith(("SLURM_", "GPUS_PER_NODE", "NNODES", "NODE_RANK", "COORD"))}
  full_env.update(PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}",
                  TRAIN_LOG=str(tmp_path / "train.log"), **env)
  return subprocess.Popen(["bash", os.path.join(ROOT, "scripts", "launch_gpus.sh"), *args],
                          env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          cwd=tmp_path)  # (relative paths are the caller's)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_gpu_launcher_passes_a_signal_on_and_waits_for_every_process(tmp_path, sig):
  proc = _gpus(tmp_path, "--workdir", "runs/x", GPUS_PER_NODE="3", COORDINATOR_PORT="23456")
  log = tmp_path / "train.log"
  for _ in range(100):
    if log.exists() and len(log.read_text().splitlines()) == 3:
      break
    time.sleep(0.1)
  train_py = os.path.join(ROOT, "scripts", "train.py")
  assert sorted(log.read_text().splitlines()) == [
      f"{i} {i} 3 localhost:23456 {train_py} --workdir runs/x in {tmp_path}" for i in range(3)]
  proc.send_signal(sig)
  _, err = proc.communicate(timeout=30)
  assert proc.returncode == 0, err
  # Every process got the signal and had saved before the launcher exited.
  assert sorted(log.read_text().splitlines()[3:]) == [f"{i} saved" for i in range(3)]


def test_gpu_launcher_stops_the_others_when_one_process_fails(tmp_path):
  # GPUS_PER_NODE=08: a leading zero is decimal (bash read it as octal and started nothing).
  proc = _gpus(tmp_path, "--workdir", "runs/x", GPUS_PER_NODE="08", FAILS="1")
  _, err = proc.communicate(timeout=30)
  assert proc.returncode == 3, err
  assert err == ("error: process 1 (GPU 1) exited 3; stopping the others on this node "
                 "(SIGTERM: they save)\n")
  lines = (tmp_path / "train.log").read_text().splitlines()
  assert len(lines) == 8 + 7 and sorted(lines[8:]) == [f"{i} saved" for i in (0, *range(2, 8))]


@pytest.mark.parametrize("env,error", [
    ({"GPUS_PER_NODE": "0"}, "error: GPUS_PER_NODE=0 must be a positive integer"),
    ({}, "error: no GPUs found (nvidia-smi --list-gpus); set GPUS_PER_NODE to start anyway"),
    ({"GPUS_PER_NODE": "2", "NNODES": "2", "NODE_RANK": "1"},
     "error: NNODES=2 needs COORDINATOR=<node0-host>:PORT (or a SLURM job)"),
    ({"GPUS_PER_NODE": "2", "NNODES": "2", "NODE_RANK": "2", "COORDINATOR": "h:1"},
     "error: NODE_RANK=2 must be 0 to 1 (NNODES=2)")])
def test_gpu_launcher_refuses_a_node_it_cannot_start(tmp_path, env, error):
  proc = _gpus(tmp_path, "--workdir", "runs/x", **env)
  _, err = proc.communicate(timeout=30)
  assert (proc.returncode, err) == (2, error + "\n")
  assert not (tmp_path / "train.log").exists()  # nothing started
