"""The recurrent block's Conv1D at the training shapes: XLA's autodiff against the Triton backward
of ``pallas_kernels.conv1d`` (``model.conv1d_impl``).

    python scripts/bench/bench_conv1d.py [--shapes 16x2048x2048,16x2048x2560] [--docs 3]
        [--iters 20]

Per shape (rows B x length T x channels D: Griffin 400M's and 1.3B's RG-LRU width), bfloat16, 4
taps, rows packed with ``--docs`` documents each: ``layers.Conv1D`` forward + backward (the
gradients of the input, the taps and the bias), against its bytes floor: the forward reads ``x``
and writes ``y`` (2 B T D elements), the backward reads ``dy`` and ``x`` and writes ``dx``
(3 B T D), at the copy ceiling measured in the run (``timing.copy_ceiling``). Before
timing, both paths' gradients are compared with XLA's autodiff in float32 on the device.
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


def conv_step(impl, width, dtype):
  """``(params, x, pos, dy) -> (dparams, dx)`` of ``layers.Conv1D`` with ``impl``."""
  conv = layers.Conv1D(width, 4, rngs=nnx.Rngs(0), dtype=dtype, impl=impl)
  graphdef, params = nnx.split(conv)

  def loss(params, x, pos, dy):
    y = nnx.merge(graphdef, params)(x, pos)[0]
    return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))
  return jax.jit(jax.grad(loss, (0, 1))), params


def packed_positions(batch, length, docs):
  """Segment positions of rows holding ``docs`` documents of equal length each."""
  return jnp.broadcast_to(jnp.arange(length) % -(-length // docs), (batch, length))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shapes", default="16x2048x2048,16x2048x2560",
                      help="B x T x D, comma-separated")
  parser.add_argument("--docs", type=int, default=3, help="documents per row")
  parser.add_argument("--iters", type=int, default=20)
  args = parser.parse_args()
  dev = jax.devices()[0]
  ceiling = copy_ceiling() / 1e12
  print(f"{dev.device_kind}, jax {jax.__version__}, bfloat16, {args.docs} documents a row, copy "
        f"ceiling {ceiling:.2f} TB/s")
  print("| B x T x D | XLA autodiff (ms) | Triton backward (ms) | bytes floor (ms) | floor reached "
        "(XLA / Triton) | max rel. error vs XLA float32 (XLA / Triton) |")
  print("|---|---|---|---|---|---|")
  for shape in args.shapes.split(","):
    b, t, d = map(int, shape.split("x"))
    keys = jax.random.split(jax.random.PRNGKey(b + t + d), 2)
    x = jax.random.normal(keys[0], (b, t, d), jnp.bfloat16)
    dy = jax.random.normal(keys[1], (b, t, d), jnp.bfloat16)
    pos = packed_positions(b, t, args.docs)
    f32 = lambda a: a.astype(jnp.float32)
    want_step, params = conv_step("xla", d, jnp.float32)
    want = want_step(params, f32(x), pos, f32(dy))
    times, errors = [], []
    for impl in ("xla", "pallas"):
      step, params = conv_step(impl, d, jnp.bfloat16)
      got = step(params, x, pos, dy)
      errors.append(max(float(jnp.linalg.norm(f32(g) - w) / jnp.linalg.norm(w))
                        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want))))
      times.append(time_fn(step, params, x, pos, dy, iters=args.iters))
    floor = 5 * b * t * d * 2 / (ceiling * 1e12) * 1e3
    print(f"| {b} x {t} x {d} | {times[0]:.3f} | {times[1]:.3f} | {floor:.3f} | "
          f"{floor / times[0]:.0%} / {floor / times[1]:.0%} | {errors[0]:.1e} / {errors[1]:.1e} |",
          flush=True)


if __name__ == "__main__":
  main()
