"""The RG-LRU layer on a GPU: XLA gating + the Pallas scan (the model's default path) against the
fused layer kernel (``pallas_kernels.rg_lru.fused``) under several GPU block shapes, forward and
forward+backward, at one shape (default: the Griffin-400M layer, B=16, T=2048, D=2048, bf16).

  python scripts/bench/bench_rg_lru_layer.py [--batch 16] [--seq_len 2048] [--width 2048] [--iters 20]

Prints the bytes floor (x and both gate logits read and y written forward; those, dy and h read
and three gradients written backward; at 3.0 TB/s) and the median time per call of each row.
The fused layer's block shape for real runs is ``rg_lru.fused.gpu_block`` (the "auto" row).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position

from pallas_kernels.rg_lru import blocked as scan_core, fused as rg_lru_fused  # pylint: disable=g-import-not-at-top,wrong-import-position
from recurrentgemma_jax import recurrent, scan as scan_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from timing import time_fn  # pylint: disable=g-import-not-at-top,wrong-import-position

BLOCK_SHAPES = [("scan's shape (256 channels, 4 warps)", dict()),
                ("chunk 8", dict(gpu_chunk=8)),
                ("chunk 4", dict(gpu_chunk=4)),
                ("256 channels, 8 warps", dict(gpu_num_warps=8)),
                ("chunk 8, 8 warps", dict(gpu_chunk=8, gpu_num_warps=8)),
                ("128 channels, 4 warps, chunk 8", dict(gpu_block_d=128, gpu_chunk=8))]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--seq_len", type=int, default=2048)
  parser.add_argument("--width", type=int, default=2048)
  parser.add_argument("--iters", type=int, default=20)
  args = parser.parse_args()
  if jax.default_backend() != "gpu":
    sys.exit("error: bench_rg_lru_layer.py times the GPU kernels; no GPU backend here")
  b, t, d = args.batch, args.seq_len, args.width
  keys = jax.random.split(jax.random.PRNGKey(0), 5)
  x, gx, ga, dy = (jax.random.normal(keys[i], (b, t, d), jnp.bfloat16) for i in (0, 1, 2, 4))
  a_param = jax.random.normal(keys[3], (d,), jnp.float32)
  reset = jnp.zeros((b, t), bool).at[:, 0].set(True)
  h0 = jnp.zeros((b, d), jnp.float32)

  def timed(f, *xs):  # one call per timing, as in the recorded runs
    return time_fn(f, *xs, iters=args.iters, calls=1, warmup=1)

  def unfused(x, gx, ga, p):
    nx, a = recurrent.gated_inputs(x, gx, ga, p, reset)
    return scan_lib.linear_scan(nx, a, h0, impl="pallas")[0]

  def fused(config):
    return lambda x, gx, ga, p: rg_lru_fused.rg_lru_with_config(
        x, gx, ga, p, reset.astype(jnp.float32), h0, config)[0]

  def fwd_bwd(f):
    def run(*xs):
      _, vjp = jax.vjp(f, *xs)
      return vjp(dy)
    return jax.jit(f), jax.jit(run)

  floor_ms = (4 + 8) * b * t * d * 2 / 3.0e12 * 1e3
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; B={b} T={t} D={d} bfloat16; "
        f"bytes floor fwd+bwd {floor_ms:.3f} ms at 3.0 TB/s")
  rows = [("XLA gating + Pallas scan", unfused),
          ("fused, auto (gpu_block)", fused(scan_core.ScanConfig(
              backend="gpu", **rg_lru_fused.gpu_block(b, d))))]
  rows += [(f"fused, {name}", fused(scan_core.ScanConfig(backend="gpu", **cfg)))
           for name, cfg in BLOCK_SHAPES]
  print("| RG-LRU layer | fwd (ms) | fwd+bwd (ms) |\n|---|---|---|")
  for name, f in rows:
    try:
      fwd, both = fwd_bwd(f)
      print(f"| {name} | {timed(fwd, x, gx, ga, a_param):.3f} | "
            f"{timed(both, x, gx, ga, a_param):.3f} |", flush=True)
    except Exception as e:  # pylint: disable=broad-except  (a block shape Triton rejects)
      print(f"| {name} | error: {str(e)[:200]} | |", flush=True)


if __name__ == "__main__":
  main()
