"""train.py's fit check: before anything is allocated or written, the compiled steps' memory
against the devices' (here a simulated small limit, --config.memory_limit_gib); a run that does
not fit exits 2 with one line naming a setting that fits, found by compiling it."""

import re

from helpers import run_script

FEW_STEPS = ["--config.total_steps=2", "--config.eval_every=0"]


def test_a_run_that_does_not_fit_names_a_setting_that_does(tmp_path):
  workdir = tmp_path / "run"
  limit = "--config.memory_limit_gib=0.1"  # the default model's step needs ~290 MiB
  proc = run_script("train.py", "--workdir", str(workdir), limit, *FEW_STEPS, check=False)
  assert proc.returncode == 2, proc.stderr[-2000:]
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr
  assert re.match(r"error: does not fit: the training step needs [\d.]+ MiB per device, "
                  r"102\.4 MiB available: use ", lines[0]), lines[0]
  assert not workdir.exists()  # nothing written
  flags = re.findall(r"--config\.[\w.]+=\w+", lines[0])
  assert any(f.startswith("--config.optimizer.grad_accum_steps=") for f in flags), flags
  # The suggestion, applied, passes the check and trains.
  run_script("train.py", "--workdir", str(workdir), limit, *FEW_STEPS, *flags)
  assert (workdir / "checkpoints" / "2").is_dir()


def test_parameters_and_optimizer_state_larger_than_the_limit_are_refused_at_once(tmp_path):
  proc = run_script("train.py", "--workdir", str(tmp_path / "run"),
                    "--config.memory_limit_gib=0.001", *FEW_STEPS, check=False)
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines() == [
      line for line in proc.stderr.strip().splitlines()
      if line.startswith("error: does not fit: the parameters and optimizer state alone need")]
  assert "--config.zero=3 over at least" in proc.stderr
  assert "compiling alternatives" not in proc.stdout
