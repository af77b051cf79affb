"""The TPU-pod launcher, up to the point where a real pod is needed: the gcloud commands it
issues (recorded by a stand-in gcloud on PATH) copy the code to every worker and start the
exact training command there."""

import os
import stat
import subprocess

from helpers import ROOT


def test_tpu_pod_launcher_issues_the_documented_commands(tmp_path):
  log = tmp_path / "gcloud.log"
  fake = tmp_path / "bin" / "gcloud"
  fake.parent.mkdir()
  fake.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$*" >> {log}\n')
  fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
  env = dict(os.environ, PATH=f"{fake.parent}:{os.environ['PATH']}")
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
  assert "pip install -q 'jax[tpu]' -e ." in ssh
  # The training arguments arrive intact, quoted for the remote shell.
  assert ("python3 scripts/train.py --config configs/griffin.py:7b --workdir /mnt/b/run\\ 1 "
          "--config.zero=1") in ssh


def test_tpu_pod_launcher_usage_error():
  proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "launch_tpu_pod.sh")],
                        capture_output=True, text=True)
  assert proc.returncode == 2 and proc.stderr.startswith("usage:")
