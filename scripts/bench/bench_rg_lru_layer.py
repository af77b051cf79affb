"""The RG-LRU layer on a GPU: XLA gating + the Pallas scan against the fused layer kernel
(``pallas_kernels.rg_lru.fused``, the model's GPU default) with its Triton forward and with its
Mosaic GPU forward (the default on Hopper), forward and forward+backward, at one shape
(default: the Griffin-400M layer, B=16, T=2048, D=2048, bf16).

  python scripts/bench/bench_rg_lru_layer.py [--batch 16] [--seq_len 2048] [--width 2048] [--iters 20]

Prints the bytes floors (x and both gate logits read and y written forward; those, dy and h read
and three gradients written backward; at 3.0 TB/s) and the median time per call of each row
(5 back-to-back calls per timing, as in a training step).
"""

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position

from pallas_kernels import dispatch  # pylint: disable=g-import-not-at-top,wrong-import-position
from pallas_kernels.rg_lru import fused as rg_lru_fused  # pylint: disable=g-import-not-at-top,wrong-import-position
from recurrentgemma_jax import recurrent, scan as scan_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from timing import time_fn  # pylint: disable=g-import-not-at-top,wrong-import-position


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

  def timed(f, *xs):
    return time_fn(f, *xs, iters=args.iters, calls=5, warmup=2)

  def unfused(x, gx, ga, p):
    nx, a = recurrent.gated_inputs(x, gx, ga, p, reset)
    return scan_lib.linear_scan(nx, a, h0, impl="pallas")[0]

  def fused(config):
    return lambda x, gx, ga, p: rg_lru_fused.rg_lru_with_config(
        x, gx, ga, p, reset.astype(jnp.float32), h0, config)[0]

  def chunked(x, gx, ga, p):  # the model's call: the time-chunked schedule where it applies
    return rg_lru_fused.rg_lru(x, gx, ga, p, reset, h0)[0]

  def fwd_bwd(f):
    def run(*xs):
      _, vjp = jax.vjp(f, *xs)
      return vjp(dy)
    return jax.jit(f), jax.jit(run)

  floor_fwd, floor_both = (4 * b * t * d * 2 / 3.0e9, 12 * b * t * d * 2 / 3.0e9)
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; B={b} T={t} D={d} bfloat16; "
        f"bytes floors at 3.0 TB/s: fwd {floor_fwd:.3f} ms, fwd+bwd {floor_both:.3f} ms")
  default = dispatch.scan_config()
  config = dataclasses.replace(default, **rg_lru_fused.gpu_block(b, d))
  rows = [("XLA gating + Pallas scan", unfused, False),  # (name, layer, MOSAIC_FORWARD)
          ("fused, Triton forward", fused(config), False),
          ("fused, Mosaic GPU forward (the default on Hopper)", fused(config), True),
          (f"rg_lru (the model's call: {rg_lru_fused.time_chunks(b, t, d)} time chunks)",
           chunked, True)]
  print("| RG-LRU layer | fwd (ms) | fwd % floor | fwd+bwd (ms) | fwd+bwd % floor |\n"
        "|---|---|---|---|---|")
  for name, f, mosaic in rows:
    rg_lru_fused.MOSAIC_FORWARD = mosaic
    try:
      fwd, both = fwd_bwd(f)
      t_fwd, t_both = timed(fwd, x, gx, ga, a_param), timed(both, x, gx, ga, a_param)
      print(f"| {name} | {t_fwd:.3f} | {floor_fwd / t_fwd:.0%} | {t_both:.3f} | "
            f"{floor_both / t_both:.0%} |", flush=True)
    except Exception as e:  # pylint: disable=broad-except  (a block shape Triton rejects)
      print(f"| {name} | error: {str(e)[:200]} | |", flush=True)


if __name__ == "__main__":
  main()
