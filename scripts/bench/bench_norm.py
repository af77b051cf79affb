"""A pre-norm block's RMSNorm at the training shapes: XLA's autodiff against the Triton backward
of ``pallas_kernels.norm`` (``model.norm_impl``).

    python scripts/bench/bench_norm.py [--shapes 32768x1536,32768x2048] [--iters 20]

Per shape (rows N x width D: Griffin 400M's and 1.3B's residual stream), bfloat16:
``layers.RMSNorm.with_skip`` forward + backward (the gradients of ``x``, the skip's included,
and of the scale), against its bytes floor: the forward reads ``x`` and writes the normalised
rows (2 N D elements), the backward reads ``x``, the normalised rows' and the skip's gradients
and writes ``x``'s (4 N D), at the copy ceiling measured in the run (``timing.copy_ceiling``).
Before timing, both paths' gradients are compared with XLA's autodiff in float32 on the device.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp
from flax import nnx

from recurrentgemma_jax import layers
from timing import copy_ceiling, time_fn  # pylint: disable=g-import-not-at-top  (scripts/bench/)


def norm_step(impl, width):
  """``(params, x, ds, dn) -> (dparams, dx)`` of ``layers.RMSNorm.with_skip`` with ``impl``."""
  graphdef, params = nnx.split(layers.RMSNorm(width, impl=impl))

  def loss(params, x, ds, dn):
    skip, n = nnx.merge(graphdef, params).with_skip(x)
    f32 = jnp.float32
    return jnp.sum(skip.astype(f32) * ds.astype(f32)) + jnp.sum(n.astype(f32) * dn.astype(f32))
  return jax.jit(jax.grad(loss, (0, 1))), params


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shapes", default="32768x1536,32768x2048", help="N x D, comma-separated")
  parser.add_argument("--iters", type=int, default=20)
  args = parser.parse_args()
  dev = jax.devices()[0]
  ceiling = copy_ceiling() / 1e12
  print(f"{dev.device_kind}, jax {jax.__version__}, bfloat16, copy ceiling {ceiling:.2f} TB/s")
  print("| N x D | XLA autodiff (ms) | Triton backward (ms) | bytes floor (ms) | floor reached "
        "(XLA / Triton) | max rel. error vs XLA float32 (XLA / Triton) |")
  print("|---|---|---|---|---|---|")
  for shape in args.shapes.split(","):
    n, d = map(int, shape.split("x"))
    keys = jax.random.split(jax.random.PRNGKey(n + d), 4)
    x, ds, dn = (jax.random.normal(k, (n, d), jnp.bfloat16) for k in keys[:3])
    f32 = lambda a: a.astype(jnp.float32)
    want_step, params = norm_step("xla", d)
    params = jax.tree.map(lambda p: 0.1 * jax.random.normal(keys[3], p.shape, p.dtype), params)
    want = want_step(params, f32(x), f32(ds), f32(dn))
    times, errors = [], []
    for impl in ("xla", "pallas"):
      step, _ = norm_step(impl, d)
      got = step(params, x, ds, dn)
      errors.append(max(float(jnp.linalg.norm(f32(g) - w) / jnp.linalg.norm(w))
                        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want))))
      times.append(time_fn(step, params, x, ds, dn, iters=args.iters))
    floor = 6 * n * d * 2 / (ceiling * 1e12) * 1e3
    print(f"| {n} x {d} | {times[0]:.3f} | {times[1]:.3f} | {floor:.3f} | "
          f"{floor / times[0]:.0%} / {floor / times[1]:.0%} | {errors[0]:.1e} / {errors[1]:.1e} |",
          flush=True)


if __name__ == "__main__":
  main()
