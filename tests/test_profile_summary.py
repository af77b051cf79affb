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


def test_our_triton_kernels_lower_with_the_names_the_summary_counts_as_pallas():
  # Lowered for CUDA on this CPU machine: each of our Triton kernels carries a name of its own
  # (two of them were both "_bwd_kernel" in a profile), and kind_of files every one under Pallas.
  import re  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import helpers  # pylint: disable=g-import-not-at-top
  from pallas_kernels import conv1d, gates, mlp, norm  # pylint: disable=g-import-not-at-top
  from pallas_kernels.rg_lru import blocked, fused  # pylint: disable=g-import-not-at-top

  f32, bf16 = jnp.float32, jnp.bfloat16
  spec = jax.ShapeDtypeStruct
  square = lambda outs: sum(jnp.sum(o.astype(f32) ** 2) for o in jax.tree.leaves(outs))
  cases = [
      (lambda x, w1, w2, b1, b2: gates.block_diagonal_with_skip(x, (w1, w2), (b1, b2)),
       (spec((256, 4 * 32), bf16), spec((4, 32, 32), f32), spec((4, 32, 32), f32),
        spec((4, 32), f32), spec((4, 32), f32))),
      (lambda x, s: norm.rms_norm_with_skip(x, s, eps=1e-6), (spec((64, 256), bf16),
                                                               spec((256,), f32))),
      (lambda x, w, b, doc: conv1d.causal_conv1d(x, w, b, doc),
       (spec((2, 64, 256), bf16), spec((4, 256), f32), spec((256,), f32),
        spec((2, 64), jnp.int32))),
      (lambda up, b: mlp.gated_gelu(up, b), (spec((64, 2, 256), bf16), spec((2, 256), f32))),
      (lambda x, gx, ga, a, reset, h0: fused.rg_lru_with_config(  # the Triton RG-LRU passes
          x, gx, ga, a, reset, h0, blocked.ScanConfig(backend="gpu")),
       (spec((2, 64, 256), bf16), spec((2, 64, 256), bf16), spec((2, 64, 256), bf16),
        spec((256,), f32), spec((2, 64), f32), spec((2, 256), f32))),
  ]
  names = []
  for fn, args in cases:
    floats = tuple(i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating))
    grad = jax.grad(lambda *a, fn=fn: square(fn(*a)), argnums=floats)
    names += re.findall(r'name = "(pallas_\w+)"', helpers.lower_for_cuda(grad, *args))
  assert set(names) == {"pallas_gates_fwd", "pallas_gates_dx", "pallas_gates_dw",
                        "pallas_rms_norm_bwd", "pallas_conv1d_bwd", "pallas_mlp_gating_bwd",
                        "pallas_rg_lru_forward_step", "pallas_rg_lru_backward_step"}
  for name in names:
    assert profile_summary.kind_of(name) == "Pallas / Triton", name
