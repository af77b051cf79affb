"""scripts/bench/tpu_presets.py --table from hand-made row reports: a row whose compile stopped
before writing its report is shown as failed with its exit status."""

import json
import os

from helpers import run_script


def test_table_shows_a_row_without_a_report_as_failed(tmp_path):
  for index, code in ((0, 2), (1, 3)):  # a bad config, an error: no OUT/ROW.json written
    with open(tmp_path / f"{index}.status.json", "w") as f:
      json.dump({"exit": code, "wall_s": 6.0, "command": [], "stderr": ["error: ..."]}, f)
  proc = run_script(os.path.join("bench", "tpu_presets.py"), "--out", str(tmp_path), "--table")
  rows = [line for line in proc.stdout.splitlines() if line.startswith("| 0 ") or
          line.startswith("| 1 ")]
  assert len(rows) == 2, proc.stdout
  assert "| failed (2) |" in rows[0] and rows[0].endswith("| 0.1 min |")
  assert "| failed (3) |" in rows[1]
