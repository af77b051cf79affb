"""The Triton RMSNorm (``pallas_kernels.norm``) against XLA's fusions, in one run on a GPU.

    python scripts/bench/bench_norm.py [--rows 32768] [--widths 1536,2048,2560] [--iters 20]

First checks the kernel (``interpret=False``) against the float64 reference on odd shapes,
forward and gradients; then times, for ``[rows, D]`` bfloat16 activations and a float32 scale,
the forward and the forward + backward (a VJP with a random cotangent) of the kernel and of
``rms_norm_reference`` under ``jax.jit`` (what ``model.norm_impl=xla`` runs). "% floor" is the
byte floor over the time over the copy ceiling measured in the same run (a jitted ``x + 1``):
the forward reads x and writes y, the forward + backward also reads x and dy and writes dx
(5 arrays of ``[rows, D]`` bfloat16).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp
import numpy as np

import bench_decode  # pylint: disable=g-import-not-at-top  (scripts/bench/: copy_ceiling)
from pallas_kernels import norm
from timing import time_fn  # pylint: disable=g-import-not-at-top


def check() -> bool:
  ok = True
  for shape, dtype, tol in [((3, 37, 96), jnp.float32, 1e-5), ((2, 5, 1536), jnp.bfloat16, 5e-3),
                            ((1, 1, 2560), jnp.float32, 1e-5), ((1000, 2048), jnp.bfloat16, 5e-3)]:
    k = jax.random.split(jax.random.PRNGKey(sum(shape)), 3)
    x = jax.random.normal(k[0], shape, jnp.float32).astype(dtype)
    scale = 0.5 * jax.random.normal(k[1], shape[-1:], jnp.float32)
    dy = jax.random.normal(k[2], shape, jnp.float32).astype(dtype)
    y, vjp = jax.vjp(lambda x, s: norm.rms_norm(x, s), x, scale)
    dx, ds = vjp(dy)
    with jax.enable_x64(True):
      f64 = lambda a: jnp.asarray(np.asarray(a, np.float64))
      y_ref, vjp_ref = jax.vjp(norm.rms_norm_reference, f64(x), f64(scale))
      dx_ref, ds_ref = vjp_ref(f64(dy))
    errors = []
    for got, want in ((y, y_ref), (dx, dx_ref), (ds, ds_ref)):
      got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
      errors.append(np.linalg.norm(got - want) / np.linalg.norm(want))
    good = errors[0] < tol and errors[1] < tol and errors[2] < 1e-4
    ok &= good
    print(f"check {shape} {dtype.__name__}: y {errors[0]:.1e} dx {errors[1]:.1e} "
          f"dscale {errors[2]:.1e} {'OK' if good else 'FAIL'}", flush=True)
  return ok


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=32768)
  parser.add_argument("--widths", default="1536,2048,2560")
  parser.add_argument("--iters", type=int, default=20)
  args = parser.parse_args()
  date = subprocess.run(["date"], capture_output=True, text=True).stdout.strip()
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {date}", flush=True)
  checked = check()
  ceiling = bench_decode.copy_ceiling(jax, 2**30)
  print(f"copy ceiling {ceiling / 1e12:.2f} TB/s", flush=True)
  lines = ["| D | implementation | fwd ms | fwd % floor | fwd+bwd ms | fwd+bwd % floor |",
           "|---|---|---|---|---|---|"]
  for d in map(int, args.widths.split(",")):
    k = jax.random.split(jax.random.PRNGKey(d), 3)
    x = jax.random.normal(k[0], (args.rows, d), jnp.float32).astype(jnp.bfloat16)
    scale = jax.random.normal(k[1], (d,), jnp.float32)
    dy = jax.random.normal(k[2], (args.rows, d), jnp.float32).astype(jnp.bfloat16)
    unit = args.rows * d * 2  # bytes of one [rows, D] bfloat16 array
    for name, f in (("xla", norm.rms_norm_reference), ("pallas", norm.rms_norm)):
      fwd = jax.jit(lambda x, s, f=f: f(x, s).astype(x.dtype))
      both = jax.jit(lambda x, s, dy, f=f: jax.vjp(lambda x, s: f(x, s).astype(x.dtype), x, s)[1](dy))
      ms_f = time_fn(fwd, x, scale, iters=args.iters)
      ms_b = time_fn(both, x, scale, dy, iters=args.iters)
      pf = 100 * 2 * unit / (ms_f * 1e-3) / ceiling
      pb = 100 * 5 * unit / (ms_b * 1e-3) / ceiling
      lines.append(f"| {d} | {name} | {ms_f:.3f} | {pf:.0f}% | {ms_b:.3f} | {pb:.0f}% |")
      print(lines[-1], flush=True)
  print(f"\nrows {args.rows}, bfloat16 x, float32 scale; checked: {checked}; "
        f"copy ceiling {ceiling / 1e12:.2f} TB/s\n" + "\n".join(lines))


if __name__ == "__main__":
  main()
