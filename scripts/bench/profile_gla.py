"""Where the GPU time of chunk_gla forward + backward goes, from a jax.profiler trace.

    python scripts/bench/profile_gla.py --shape 2,8192,16,64 [--iters 3] [--top 25] [--fwd_only]
        [--variant fact]

Profiles ``--iters`` calls on bench_gla's inputs (bfloat16, K = V = Dh) and prints
``profile_summary.summarize``'s tables per call: time by kind of kernel and the top kernels.
"""

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # pylint: disable=g-import-not-at-top

import bench_gla  # pylint: disable=g-import-not-at-top
import profile_summary  # pylint: disable=g-import-not-at-top


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--shape", default="2,8192,16,64")
  ap.add_argument("--top", type=int, default=25)
  ap.add_argument("--iters", type=int, default=3)
  ap.add_argument("--fwd_only", action="store_true")
  ap.add_argument("--variant", default="fact", help="bench_gla's --intra variants: fact, xla, ...")
  args = ap.parse_args()
  bench_gla.set_variant(args.variant)
  q, k, v, g, do = bench_gla._inputs(tuple(map(int, args.shape.split(","))))  # pylint: disable=protected-access
  fwd, fwd_bwd = bench_gla._gla_fns()  # pylint: disable=protected-access
  fn, xs = (fwd, (q, k, v, g)) if args.fwd_only else (fwd_bwd, (q, k, v, g, do))
  jax.block_until_ready(fn(*xs))
  out = tempfile.mkdtemp()
  with jax.profiler.trace(out, create_perfetto_trace=True):
    for _ in range(args.iters):
      jax.block_until_ready(fn(*xs))
  print(f"chunk_gla {'forward' if args.fwd_only else 'forward + backward'} at {args.shape}, "
        f"per call:")
  print(profile_summary.summarize(out, steps=args.iters, top=args.top))


if __name__ == "__main__":
  main()
