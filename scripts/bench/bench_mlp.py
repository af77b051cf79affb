"""The gated MLP at the training shapes: XLA's autodiff of the GeLU gating against the Triton
backward of ``pallas_kernels.mlp`` (``model.mlp_impl``).

    python scripts/bench/bench_mlp.py [--rows 32768] [--shapes 1536x4608,2048x6144] [--iters 20]

Per shape (width D x expanded width M, 400M and 1.3B presets), bfloat16, ``--rows`` tokens:

- ``gating``: ``gelu(up_0 + b_0) * (up_1 + b_1)``, forward + backward (gradients of ``up`` and the
  bias), against its bytes floor: the forward reads ``up`` and writes ``h`` (3 N M elements),
  the backward reads ``dh`` and ``up`` and writes ``dup`` (5 N M), at the copy ceiling measured
  in the run (a jitted ``x + 1``). XLA's autodiff also writes and reads the tanh (2 N M more).
- ``block``: the whole ``model.MLPBlock`` (up-projection, gating, down-projection), forward +
  backward (gradients of the input and the parameters): what a training step sees.

Before timing, the kernel's gradients are compared with XLA's autodiff in float32 on the device.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.mlp import gating
from recurrentgemma_jax import model as model_lib
from timing import copy_ceiling, time_fn  # pylint: disable=g-import-not-at-top  (scripts/bench/)


def gating_step(fn):
  """``h`` and the gradients of ``up`` and the bias for the cotangent ``dh``: the forward and
  the backward a training step runs."""
  def step(up, bias, dh):
    h, vjp = jax.vjp(fn, up, bias)
    return h, vjp(dh.astype(h.dtype))
  return jax.jit(step)


def block_step(impl, width, expanded):
  block = model_lib.MLPBlock(width, expanded, rngs=nnx.Rngs(0), final_init_scale=1.0,
                             param_dtype=jnp.float32, dtype=jnp.bfloat16, impl=impl)
  graphdef, params = nnx.split(block)

  def loss(params, x, dy):
    y = nnx.merge(graphdef, params)(x)
    return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))
  return jax.jit(jax.grad(loss, (0, 1))), params



def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rows", type=int, default=32768, help="tokens (batch x length)")
  parser.add_argument("--shapes", default="1536x4608,2048x6144", help="D x M, comma-separated")
  parser.add_argument("--iters", type=int, default=20)
  args = parser.parse_args()
  dev = jax.devices()[0]
  ceiling = copy_ceiling() / 1e12
  print(f"{dev.device_kind}, jax {jax.__version__}, {args.rows} rows, bfloat16, copy ceiling "
        f"{ceiling:.2f} TB/s")
  print("| D x M | what | XLA autodiff (ms) | Triton backward (ms) | bytes floor (ms) | floor reached "
        "(XLA / Triton) | max rel. error vs XLA float32 |")
  print("|---|---|---|---|---|---|---|")
  for shape in args.shapes.split(","):
    d, m = map(int, shape.split("x"))
    n = args.rows
    keys = jax.random.split(jax.random.PRNGKey(d + m), 4)
    up = jax.random.normal(keys[0], (n, 2, m), jnp.bfloat16)
    bias = (0.1 * jax.random.normal(keys[1], (2, m))).astype(jnp.bfloat16)
    dh = jax.random.normal(keys[2], (n, m), jnp.bfloat16)

    # The kernel's gradients against XLA's autodiff of the same function in float32.
    f32 = lambda a: a.astype(jnp.float32)
    want = gating_step(gating.forward)(f32(up), f32(bias), f32(dh))
    kernel = functools.partial(gating.gated_gelu, interpret=jax.default_backend() == "cpu")
    got = gating_step(kernel)(up, bias, dh)
    err = max(float(jnp.linalg.norm(f32(g) - w) / jnp.linalg.norm(w))
              for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)))

    floor = 8 * n * m * 2 / (ceiling * 1e12) * 1e3
    times = [time_fn(gating_step(fn), up, bias, dh, iters=args.iters)
             for fn in (gating.forward, kernel)]
    print(f"| {d} x {m} | gating, fwd + bwd | {times[0]:.3f} | {times[1]:.3f} | {floor:.3f} | "
          f"{floor / times[0]:.0%} / {floor / times[1]:.0%} | {err:.1e} |", flush=True)

    x = jax.random.normal(keys[3], (n // 2048, 2048, d), jnp.bfloat16)
    dy = jax.random.normal(keys[0], x.shape, jnp.bfloat16)
    block_times = []
    for impl in ("xla", "pallas"):
      step, params = block_step(impl, d, m)
      block_times.append(time_fn(step, params, x, dy, iters=args.iters))
    print(f"| {d} x {m} | MLP block, fwd + bwd | {block_times[0]:.3f} | {block_times[1]:.3f} | "
          f"- | - | - |", flush=True)


if __name__ == "__main__":
  main()
