"""The TPU-pod launcher, up to the point where a real pod is needed: the gcloud commands it
issues (recorded by a stand-in gcloud on PATH) copy the code to every worker and start the
exact training command there, after compiling the step for the slice's topology here."""

import os
import stat
import subprocess

from helpers import ROOT, script_env


def test_tpu_pod_launcher_issues_the_documented_commands(tmp_path):
  log = tmp_path / "gcloud.log"
  fake = tmp_path / "bin" / "gcloud"
  fake.parent.mkdir()
  fake.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$*" >> {log}\n')
  fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
  env = dict(os.environ, PATH=f"{fake.parent}:{os.environ['PATH']}", SKIP_COMPILE_CHECK="1")
  proc = subprocess.run(
      ["bash", os.path.join(ROOT, "scripts", "launch_tpu_pod.sh"), "my-pod", "us-central2-b",
       "my-project", "--", "--config", "configs/griffin.py:7b", "--workdir", "/mnt/b/run 1",
       "--config.zero=1"], env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  scp, *ssh_lines = log.read_text().strip().splitlines()
  ssh = "\n".join(ssh_lines)
  assert scp.startswith("compute tpus tpu-vm --project my-project --zone us-central2-b scp")
  assert scp.endswith("my-pod:~/ --worker=all")
  assert "ssh my-pod --worker=all --command" in ssh
  assert "pip install -q -e '.[tpu]'" in ssh  # jax[tpu] at the project's jax version
  # The training arguments arrive intact, quoted for the remote shell.
  assert ("python3 scripts/train.py --config configs/griffin.py:7b --workdir /mnt/b/run\\ 1 "
          "--config.zero=1") in ssh


def test_tpu_pod_launcher_usage_error():
  proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "launch_tpu_pod.sh")],
                        capture_output=True, text=True)
  assert proc.returncode == 2 and proc.stderr.startswith("usage:")


# A model whose TPU compile takes seconds.
TINY = ["--config.model.family=hawk", "--config.model.width=64", "--config.model.lru_width=64",
        "--config.model.num_layers=2", "--config.model.num_gate_blocks=2",
        "--config.model.mlp_expanded_width=128", "--config.seq_len=128",
        "--config.batch_size=8"]


def _launch(tmp_path, *train_args):
  """Runs the launcher with a stand-in gcloud that describes my-pod as a v5litepod-4; returns
  the process and the gcloud command lines."""
  log = tmp_path / "gcloud.log"
  fake = tmp_path / "bin" / "gcloud"
  fake.parent.mkdir()
  fake.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$*" >> {log}\n'
                  'if [[ " $* " == *" describe "* ]]; then echo v5litepod-4; fi\n')
  fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
  env = script_env(PATH=f"{fake.parent}:{os.environ['PATH']}")
  env.pop("SKIP_COMPILE_CHECK", None)
  proc = subprocess.run(
      ["bash", os.path.join(ROOT, "scripts", "launch_tpu_pod.sh"), "my-pod", "us-central2-b",
       "--", "--workdir", "/mnt/b/run", *TINY, *train_args],
      env=env, capture_output=True, text=True, timeout=600)
  return proc, log.read_text().strip().splitlines() if log.exists() else []


def test_tpu_pod_launcher_compiles_for_the_slice_then_starts_a_run_that_fits(tmp_path):
  proc, calls = _launch(tmp_path)
  assert proc.returncode == 0, proc.stderr
  assert calls[0] == ("compute tpus tpu-vm --zone us-central2-b describe my-pod "
                      "--format=value(acceleratorType)")
  assert "compiling the training step for my-pod (v5litepod-4)" in proc.stdout
  assert "HBM per chip, training step" in proc.stdout and ": fits" in proc.stdout
  assert " scp " in calls[1] and "ssh my-pod --worker=all" in "\n".join(calls[2:])


def test_tpu_pod_launcher_refuses_a_run_that_does_not_fit(tmp_path):
  # A 16M-token float32 embedding with its AdamW state: over a v5e chip's 16 GiB.
  proc, calls = _launch(tmp_path, "--config.model.vocab_size=16000000")
  assert proc.returncode == 1, proc.stderr
  assert len(calls) == 1 and " describe " in f" {calls[0]} "  # nothing copied or started
  assert "error: does not fit on v5e-4" in proc.stderr
  assert "not starting the run on my-pod" in proc.stderr
