"""Where the device time of a profiled JAX program goes, from a ``jax.profiler`` trace.

  python scripts/bench/profile_summary.py TRACE_DIR [--steps N] [--top 30]

Reads the newest ``perfetto_trace.json.gz`` under TRACE_DIR (written by
``jax.profiler.trace(TRACE_DIR, create_perfetto_trace=True)``), keeps the events of the device
processes (``/device:GPU:*``, ``/device:TPU:*``; their kernels) and prints, per step (the totals
divided by ``--steps``): the busy time of each device stream, the time by kind of kernel (matmul,
attention, Pallas/Triton, collectives, copies, other fusions) and the top kernels. Kernel names
are shown with their HLO op where the trace records it (``hlo_op``; XLA's GPU command buffers
hide it: profile with ``XLA_FLAGS=--xla_gpu_enable_command_buffer=`` to see it). This package's
Pallas kernels are named for what they do (``pallas_gates_dx``, ``pallas_rms_norm_bwd``,
``pallas_rg_lru_backward_step``, ...): their own lines in the table of kernels.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re

KINDS = (  # (kind, substrings of a lower-cased kernel or op name), first match wins
    ("collective", ("nccl", "all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                    "collective")),
    ("attention (cuDNN flash)", ("sdpa", "flash", "fmha", "dot_product_attention")),
    ("matmul", ("gemm", "cublas", "cutlass", "xmma", "nvjet", "wgmma", "convolution")),
    ("Pallas / Triton", ("triton", "pallas", "mosaic")),
    ("copy / transpose", ("copy", "transpose", "memcpy", "memset", "dynamic-update-slice",
                          "dynamic_update_slice", "concatenate", "slice")),
    ("reduce", ("reduce", "scatter")),
    ("fusion / elementwise", ("fusion", "loop", "input_", "wrapped", "convert")),
)


def kind_of(name: str) -> str:
  # Inside a command buffer a Pallas kernel shows only its name: ours "pallas_..." (matched
  # below), an unnamed one its Python function's ("_bwd_kernel", "_dw_kernel"; XLA's own
  # kernels never start with an underscore).
  if re.match(r"_\w*kernel", name.rsplit(": ", 1)[-1]):
    return "Pallas / Triton"
  low = name.lower()
  for kind, keys in KINDS:
    if any(k in low for k in keys):
      return kind
  return "other"


def load_events(trace_dir: str):
  paths = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"),
                           recursive=True), key=os.path.getmtime)
  if not paths:
    raise FileNotFoundError(f"{trace_dir}: no perfetto_trace.json.gz (profile with "
                            "jax.profiler.trace(DIR, create_perfetto_trace=True))")
  with gzip.open(paths[-1]) as f:
    data = json.load(f)
  return data["traceEvents"] if isinstance(data, dict) else data


def idle_line(intervals, steps: int, longest: int = 5) -> str:
  """Time within the kernel span when no stream runs a kernel, and its longest stretches."""
  gaps, end = [], None
  for start, stop in sorted(intervals):
    if end is not None and start > end:
      gaps.append(start - end)
    end = stop if end is None else max(end, stop)
  gaps.sort(reverse=True)
  shown = ", ".join(f"{g / 1e3:.2f}" for g in gaps[:longest]) or "none"
  return (f"device idle within the span: {sum(gaps) / 1e3 / steps:.2f} ms per step "
          f"({len(gaps)} gaps; the longest, ms: {shown})")


def summarize(trace_dir: str, steps: int = 1, top: int = 30) -> str:
  events = load_events(trace_dir)
  process = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
  thread = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
            if e.get("ph") == "M" and e.get("name") == "thread_name"}
  device_pids = {p for p, n in process.items() if "/device:" in n}
  # A device's kernels sit on its "Stream #N" lines (GPU); its "XLA Ops" / "XLA Modules" lines
  # repeat them at the op and module level. Count the streams where there are any, else the ops.
  keep = set()
  for pid in device_pids:
    names = {tid: n for (p, tid), n in thread.items() if p == pid}
    streams = {tid for tid, n in names.items() if "stream" in n.lower()}
    keep |= {(pid, tid) for tid in (streams or {t for t, n in names.items() if n == "XLA Ops"}
                                   or names)}
  by_op, by_kind, by_stream = (collections.Counter(), collections.Counter(),
                               collections.Counter())
  calls = collections.Counter()
  intervals = []  # (start, end) of every kernel counted
  for e in events:
    if e.get("ph") != "X" or (e.get("pid"), e.get("tid")) not in keep:
      continue
    stream = f"{process[e['pid']]} {thread.get((e['pid'], e.get('tid')), e.get('tid'))}"
    args = e.get("args") or {}
    op = str(args.get("hlo_op") or "")
    # The kernel's name; its HLO op beside it where that says more (not inside a command buffer).
    name = e["name"] if not op or op == e["name"] or op.startswith("command_buffer") \
        else f"{op}: {e['name']}"
    dur = float(e.get("dur", 0.0)) / 1e3  # ms
    by_op[name] += dur
    calls[name] += 1
    by_kind[kind_of(name)] += dur
    by_stream[stream] += dur
    intervals.append((e["ts"], e["ts"] + e.get("dur", 0.0)))
  if not by_op:
    return f"{trace_dir}: no device kernels in the trace (device processes: {sorted(process.values())})"
  total = sum(by_op.values())
  span = (min(s for s, _ in intervals), max(e for _, e in intervals))
  lines = [f"device kernels: {total / steps:.2f} ms per step over {steps} step(s); "
           f"first-to-last kernel span {(span[1] - span[0]) / 1e3 / steps:.2f} ms per step",
           "", idle_line(intervals, steps),
           "", "| stream | busy ms/step |", "|---|---|"]
  lines += [f"| {s} | {t / steps:.2f} |" for s, t in by_stream.most_common()]
  lines += ["", "| kind | ms/step | share |", "|---|---|---|"]
  lines += [f"| {k} | {t / steps:.2f} | {100 * t / total:.1f}% |" for k, t in by_kind.most_common()]
  # The same kernel in every layer (ops that differ only by their number) as one row.
  merged, merged_calls = collections.Counter(), collections.Counter()
  for name, t in by_op.items():
    key = re.sub(r"\.\d+(?=[:_ ]|$)", "", name)
    merged[key] += t
    merged_calls[key] += calls[name]
  lines += ["", f"| top {top} kernels, ops of every layer together | calls/step | ms/step | share |",
            "|---|---|---|---|"]
  for name, t in merged.most_common(top):
    shown = name if len(name) <= 110 else name[:107] + "..."
    lines.append(f"| `{shown}` | {merged_calls[name] / steps:g} | {t / steps:.3f} | "
                 f"{100 * t / total:.1f}% |")
  lines += ["", f"| top {top} kernels / ops | calls/step | ms/step | share |", "|---|---|---|---|"]
  for name, t in by_op.most_common(top):
    shown = name if len(name) <= 110 else name[:107] + "..."
    lines.append(f"| `{shown}` | {calls[name] / steps:g} | {t / steps:.3f} | "
                 f"{100 * t / total:.1f}% |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("trace_dir")
  parser.add_argument("--steps", type=int, default=1, help="steps the trace holds")
  parser.add_argument("--top", type=int, default=30)
  args = parser.parse_args()
  print(summarize(args.trace_dir, args.steps, args.top))


if __name__ == "__main__":
  main()
