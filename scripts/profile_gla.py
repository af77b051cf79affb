"""Per-kernel GPU time of chunk_gla forward+backward from a jax.profiler (perfetto) trace.

    python scripts/profile_gla.py --shape 2,8192,16,64 [--out DIR] [--top 25]

Prints the kernels by total device time per call (ms), their counts, and the sum.
"""

import argparse
import collections
import glob
import gzip
import json
import os
import tempfile

import jax
import jax.numpy as jnp

from pallas_kernels.chunk_gla import chunk_gla


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--shape", default="2,8192,16,64")
  ap.add_argument("--top", type=int, default=25)
  ap.add_argument("--iters", type=int, default=3)
  ap.add_argument("--fwd_only", action="store_true")
  args = ap.parse_args()
  b, t, h, d = map(int, args.shape.split(","))
  ks = jax.random.split(jax.random.key(0), 5)
  q, k, v, do = (jax.random.normal(kk, (b, t, h, d), jnp.bfloat16) for kk in ks[:4])
  g = jax.nn.log_sigmoid(jax.random.normal(ks[4], (b, t, h, d), jnp.float32) + 2.0).astype(
      jnp.bfloat16)
  if args.fwd_only:
    fn, xs = jax.jit(lambda q, k, v, g: chunk_gla(q, k, v, g)[0]), (q, k, v, g)
  else:
    fn = jax.jit(lambda q, k, v, g, do: jax.vjp(lambda *a: chunk_gla(*a)[0], q, k, v, g)[1](do))
    xs = (q, k, v, g, do)
  jax.block_until_ready(fn(*xs))
  out = tempfile.mkdtemp()
  with jax.profiler.trace(out, create_perfetto_trace=True):
    for _ in range(args.iters):
      jax.block_until_ready(fn(*xs))
  path = glob.glob(os.path.join(out, "**", "perfetto_trace.json.gz"), recursive=True)[0]
  data = json.load(gzip.open(path))
  events = data["traceEvents"] if isinstance(data, dict) else data
  procs = {e["pid"]: e["args"]["name"] for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  gpu = {p for p, n in procs.items() if "GPU" in n or "gpu" in n or "device" in n.lower()}
  gpu -= {p for p, n in procs.items() if "CPU" in n}
  threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
  names = sorted({n for (p, _), n in threads.items() if p in gpu})
  print("GPU threads:", names[:12])
  pick = [n for n in names if n == "XLA Ops"] or [n for n in names if "tream" in n]
  tot, cnt = collections.Counter(), collections.Counter()
  for e in events:
    if e.get("ph") == "X" and e.get("pid") in gpu:
      tname = threads.get((e["pid"], e.get("tid")), "")
      if tname not in pick:
        continue
      name = e.get("name", "?")[:90]
      tot[name] += e.get("dur", 0.0)
      cnt[name] += 1
  print(f"{args.shape}: {sum(tot.values()) / args.iters / 1e3:.3f} ms of kernels per call; "
        f"processes {sorted(procs[p] for p in gpu)}")
  for name, us in tot.most_common(args.top):
    print(f"  {us / args.iters / 1e3:8.3f} ms  x{cnt[name] // args.iters:3d}  {name}")


if __name__ == "__main__":
  main()
