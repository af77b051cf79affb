"""scripts/bench/profile_summary.py on a hand-made Perfetto trace: device streams counted once,
kinds, the device's idle time between kernels."""

import gzip
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "bench"))

import profile_summary  # pylint: disable=g-import-not-at-top,wrong-import-position


def write_trace(directory, events):
  os.makedirs(directory)
  with gzip.open(os.path.join(directory, "perfetto_trace.json.gz"), "wt") as f:
    json.dump({"traceEvents": events}, f)


def test_summary_counts_stream_kernels_once_and_groups_them(tmp_path):
  meta = [
      {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
      {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
      {"ph": "M", "pid": 2, "tid": 10, "name": "thread_name", "args": {"name": "Stream #14"}},
      {"ph": "M", "pid": 2, "tid": 11, "name": "thread_name", "args": {"name": "XLA Ops"}},
  ]

  def kernel(tid, name, ts, dur, op=None):
    return {"ph": "X", "pid": 2, "tid": tid, "ts": ts, "dur": dur, "name": name,
            "args": {"hlo_op": op} if op else {}}

  events = meta + [
      kernel(10, "nvjet_sm90_tst_256x128", 0, 3000, "custom-call.1"),
      kernel(10, "nvjet_sm90_tst_256x128", 5000, 3000, "custom-call.1"),
      kernel(10, "input_transpose_fusion_3", 9000, 1000),
      kernel(10, "cudnn_generated_fort_native_sdpa_sm90_flash_bprop", 11000, 2000),
      kernel(10, "_dw_kernel", 13000, 1000),  # a Pallas kernel inside a command buffer
      kernel(11, "custom-call.1", 0, 3000),  # the op-level line repeats the stream: not counted
      {"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 99000, "name": "host work"},
  ]
  write_trace(tmp_path / "plugins" / "profile" / "run", events)
  text = profile_summary.summarize(str(tmp_path), steps=2)
  assert text.startswith("device kernels: 5.00 ms per step over 2 step(s); "
                         "first-to-last kernel span 7.00 ms per step")
  # Idle between 3000-5000, 8000-9000 and 10000-11000 us (the XLA Ops line fills none of it).
  assert ("device idle within the span: 2.00 ms per step (3 gaps; the longest, ms: 2.00, "
          "1.00, 1.00)") in text
  assert "| matmul | 3.00 | 60.0% |" in text
  assert "| copy / transpose | 0.50 | 10.0% |" in text
  assert "| attention (cuDNN flash) | 1.00 | 20.0% |" in text
  assert "| Pallas / Triton | 0.50 | 10.0% |" in text
  assert "| `custom-call.1: nvjet_sm90_tst_256x128` | 1 | 3.000 | 60.0% |" in text
  assert "host work" not in text


def test_summary_names_a_directory_without_a_trace(tmp_path):
  try:
    profile_summary.summarize(str(tmp_path))
  except FileNotFoundError as e:
    assert str(tmp_path) in str(e) and "create_perfetto_trace=True" in str(e)
  else:
    raise AssertionError("no error for a directory without a trace")
