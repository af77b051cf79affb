"""scripts/bench/timing.py's GPU clock sampler: nvidia-smi's lines summarised, a real subprocess
(a stand-in nvidia-smi on PATH) started and stopped around a block, and no sampler where there is
no nvidia-smi."""

import os
import stat
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "bench"))

import timing  # pylint: disable=g-import-not-at-top,wrong-import-position


def test_clock_summary_reads_the_samples_and_skips_what_it_cannot_read():
  lines = ["1590, 683.5, 0x0000000000000004",
           "1980, 120.0, 0x0000000000000000",
           "1365, 700.1, 0x0000000000000005",   # power cap with another reason beside it
           "[N/A], 650.0, 0x0000000000000004",  # no clock: skipped
           "1620, 690.0",                       # cut short by the kill: skipped
           ""]
  s = timing.clock_summary(lines)
  assert s["samples"] == 3
  assert s["sm_clock_mhz"] == 1590.0 and s["sm_clock_min_mhz"] == 1365.0
  assert abs(s["power_w"] - (683.5 + 120.0 + 700.1) / 3) < 1e-9
  assert abs(s["power_capped"] - 2 / 3) < 1e-9
  assert timing.clock_summary(["[Not Supported], [N/A], [N/A]"]) is None
  assert timing.clock_summary([]) is None


def _fake_smi(directory, line, args_file):
  path = os.path.join(directory, "nvidia-smi")
  with open(path, "w") as f:
    f.write(f'#!/bin/sh\necho "$@" > {args_file}\n'
            f'while true; do echo "{line}"; sleep 0.02; done\n')
  os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)


def test_gpu_clocks_samples_a_running_nvidia_smi(tmp_path, monkeypatch):
  args_file = tmp_path / "args"
  _fake_smi(str(tmp_path), "1605, 691.25, 0x0000000000000004", args_file)
  monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1234,1")
  with timing.GpuClocks(period_ms=20) as clocks:
    time.sleep(0.5)
  s = clocks.summary()
  assert s is not None and s["samples"] >= 2
  assert s["sm_clock_mhz"] == 1605.0 and s["power_capped"] == 1.0
  assert abs(s["power_w"] - 691.25) < 1e-9
  args = args_file.read_text().split()
  assert "--id=GPU-1234" in args and "--loop-ms=20" in args
  assert any(a.startswith("--query-gpu=clocks.sm,power.draw,") for a in args)
  assert clocks._proc is None  # pylint: disable=protected-access  (the sampler was stopped)


def test_gpu_clocks_without_nvidia_smi_runs_the_block_unsampled(tmp_path, monkeypatch):
  monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no nvidia-smi
  ran = False
  with timing.GpuClocks() as clocks:
    ran = True
  assert ran and clocks.summary() is None


def test_clock_cell_marks_the_power_cap():
  capped = timing.clock_summary(["1590, 683.5, 0x4", "1620, 690.0, 0x4", "1980, 300.0, 0x0"])
  assert timing.clock_cell(capped) == "1620 MHz, 558 W (cap)"
  free = timing.clock_summary(["1980, 300.4, 0x0", "1965, 310.0, 0x4"])
  assert timing.clock_cell(free) == "1972 MHz, 305 W (cap)"  # half the samples: still marked
  assert timing.clock_cell(timing.clock_summary(["1980, 300.4, 0x0"])) == "1980 MHz, 300 W"
  assert timing.clock_cell(None) == "-"
