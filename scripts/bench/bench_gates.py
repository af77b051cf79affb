"""The RG-LRU's two block-diagonal gates at the training shapes: XLA's batched matmul against the
Triton kernels of ``pallas_kernels.gates`` (``model.gate_impl``).

    python scripts/bench/bench_gates.py [--shapes 32768x16x128,16384x16x160] [--iters 20]

Per shape (rows N x blocks H x block width B; Griffin 400M's 16 x 128 at 16 x 2048 rows, 1.3B's
16 x 160 at 8 x 2048 rows), bfloat16: ``recurrent.RGLRU.gates`` forward + backward (``x``
passed through beside both gates' logits; the gradients of ``x``, both weights and both biases),
against its bytes floor: the forward reads ``x`` and writes two gates (3 N D elements), the
backward reads ``x``, both gates' gradients and the skip's and writes ``x``'s (5 N D), at the
copy ceiling measured in the run (``timing.copy_ceiling``). Its FLOP floor (12 N D B at the
dense bfloat16 peak) is printed beside it. Before timing, both paths' gradients are compared
with XLA's in float32 on the device.
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

from recurrentgemma_jax import flops, recurrent
from timing import copy_ceiling, time_fn  # pylint: disable=g-import-not-at-top  (scripts/bench/)


def gates_step(impl, width, blocks, dtype):
  """``(params, x, ds, dgx, dga) -> (dparams, dx)`` of ``RGLRU.gates`` with ``impl``."""
  module = recurrent.RGLRU(width, blocks, rngs=nnx.Rngs(0), gate_impl=impl, dtype=dtype)
  graphdef, params = nnx.split(module)

  def loss(params, x, ds, dgx, dga):
    outs = nnx.merge(graphdef, params).gates(x)
    f32 = jnp.float32
    return sum(jnp.sum(o.astype(f32) * c.astype(f32)) for o, c in zip(outs, (ds, dgx, dga)))
  return jax.jit(jax.grad(loss, (0, 1))), params


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shapes", default="32768x16x128,16384x16x160",
                      help="N x H x B (rows, blocks, block width), comma-separated")
  parser.add_argument("--iters", type=int, default=20)
  args = parser.parse_args()
  dev = jax.devices()[0]
  ceiling = copy_ceiling() / 1e12
  peak = flops.device_peak_flops(dev)
  print(f"{dev.device_kind}, jax {jax.__version__}, bfloat16, copy ceiling {ceiling:.2f} TB/s")
  print("| N x H x B | XLA (ms) | Triton kernels (ms) | bytes floor (ms) | FLOP floor (ms) | "
        "floor reached (XLA / Triton) | max rel. error vs XLA float32 (XLA / Triton) |")
  print("|---|---|---|---|---|---|---|")
  for shape in args.shapes.split(","):
    n, h, b = map(int, shape.split("x"))
    d = h * b
    keys = jax.random.split(jax.random.PRNGKey(n + d), 5)
    x, ds, dgx, dga = (jax.random.normal(k, (n, d), jnp.bfloat16) for k in keys[:4])
    f32 = lambda a: a.astype(jnp.float32)
    want_step, params = gates_step("xla", d, h, jnp.float32)
    params = jax.tree.map(lambda p: 0.1 * jax.random.normal(keys[4], p.shape, p.dtype), params)
    want = want_step(params, f32(x), f32(ds), f32(dgx), f32(dga))
    times, errors = [], []
    for impl in ("xla", "pallas"):
      step, _ = gates_step(impl, d, h, jnp.bfloat16)
      got = step(params, x, ds, dgx, dga)
      errors.append(max(float(jnp.linalg.norm(f32(g) - w) / jnp.linalg.norm(w))
                        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want))))
      times.append(time_fn(step, params, x, ds, dgx, dga, iters=args.iters))
    floor = 8 * n * d * 2 / (ceiling * 1e12) * 1e3
    flop_floor = 12 * n * d * b / peak * 1e3 if peak else float("nan")
    print(f"| {n} x {h} x {b} | {times[0]:.3f} | {times[1]:.3f} | {floor:.3f} | "
          f"{flop_floor:.3f} | {floor / times[0]:.0%} / {floor / times[1]:.0%} | "
          f"{errors[0]:.1e} / {errors[1]:.1e} |", flush=True)


if __name__ == "__main__":
  main()
