"""scripts/bench/compare_curves.py: a pair of loss curves against a noise reference."""

import json

from helpers import run_script


def _workdir(path, losses, held_out, eval_step=40):
  path.mkdir()
  with open(path / "metrics.jsonl", "w") as f:
    for step, loss in losses.items():
      f.write(json.dumps({"step": step, "loss": loss}) + "\n")
    f.write('{"step": 30, "loss": 9.0')  # a line cut short by a kill: skipped
    f.write("\n" + json.dumps({"step": eval_step, "eval_loss": held_out}) + "\n")
  return str(path)


def test_a_pair_within_and_beyond_the_noise(tmp_path):
  base = {10: 3.0, 20: 2.5, 40: 2.0}
  a = _workdir(tmp_path / "a", base, 2.00)
  b = _workdir(tmp_path / "b", {10: 3.01, 20: 2.52, 40: 2.0, 50: 1.9}, 2.01)  # 50: not shared
  f32 = _workdir(tmp_path / "f32", {10: 3.05, 20: 2.45, 40: 2.02}, 2.03)
  far = _workdir(tmp_path / "far", {10: 3.2, 20: 2.7, 40: 2.2}, 2.2)
  out = run_script("bench/compare_curves.py", f"--pair=now={a},previous={b}",
                   f"--noise=previous={b},float32={f32}").stdout
  assert "| 40 | 2.0000 | 2.0000 | 2.0200 |" in out and "| 50 |" not in out
  assert "pair now vs previous: training loss |diff| mean 0.0100, max 0.0200 over 3 steps; " \
         "held-out |diff| 0.0100" in out
  assert "noise previous vs float32: training loss |diff| mean 0.0433" in out
  assert out.strip().endswith("within noise: yes")
  proc = run_script("bench/compare_curves.py", f"--pair=now={far},previous={b}",
                    f"--noise=previous={b},float32={f32}", check=False)
  assert proc.returncode == 1 and proc.stdout.strip().endswith("within noise: no")
  empty = tmp_path / "empty"
  empty.mkdir()
  proc = run_script("bench/compare_curves.py", f"--pair=now={empty},previous={b}",
                    f"--noise=previous={b},float32={f32}", check=False)
  assert proc.returncode == 2 and proc.stderr.strip().startswith(
      f"error: --pair/--noise now={empty}: no training losses in")
