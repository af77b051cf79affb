"""Mosaic GPU forward scan vs the Triton forward scan vs the HBM copy ceiling, in one run.

    python scripts/bench/bench_scan_mgpu.py --out DIR [--ts 8192,2048,32768] [--iters 20]
        [--mgpu 32:256:4:2,16:256:8:2] [--triton 256:4:32:1,256:4:16:3] [--no-check]

First checks ``scan_mosaic_gpu.linear_scan_mgpu`` (y and h_last, forward and reverse) against
the float64 ``linear_scan_reference`` on ragged shapes, for every Mosaic GPU config; then times
at B=8, D=2560, bfloat16 x and a, float32 carry, h0 = 0: our Triton ``linear_scan`` forward
(the default config and the ``--triton`` variants, ``block_d:warps:chunk:prefetch``) and the
Mosaic GPU kernel for each ``--mgpu`` config (``rows:block_d:stages:y_stages``). Times are
``timing.time_fn`` (median of --iters timings of 5 back-to-back calls); "% ceiling" is the byte
floor (read x and a, write y: 3 bf16 [B, T, D] arrays) over the time, over the PyTorch 2 GiB
device-to-device copy ceiling measured in the same run. Every variant runs in its own
try/except, so one failure does not stop the rest.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import subprocess
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp
import numpy as np

import bench_scan  # pylint: disable=g-import-not-at-top
from pallas_kernels import dispatch
from pallas_kernels.rg_lru import blocked as scan_core, gpu_mosaic as scan_mosaic_gpu
from pallas_kernels.rg_lru import reference as scan_reference, scan as scan_linear
from timing import time_fn  # pylint: disable=g-import-not-at-top  (scripts/bench/)

B, D = bench_scan.B, bench_scan.D


def short_error(e: BaseException) -> str:
  tb = traceback.format_exception(type(e), e, e.__traceback__)
  text = "".join(tb[-3:])
  return text[-2500:]


def parse_mgpu(spec):
  rows, block_d, stages, y_stages = map(int, spec.split(":"))
  return dict(rows=rows, block_d=block_d, stages=stages, y_stages=y_stages)


def mgpu_fn(cfg):
  return jax.jit(functools.partial(scan_mosaic_gpu.linear_scan_mgpu, **cfg))


def triton_fn(spec):
  if spec == "default":  # the Triton forward, whatever dispatch.scan_config picks on this GPU
    config = dataclasses.replace(dispatch.scan_config(), gpu_forward="triton")
  else:
    block_d, warps, chunk, prefetch = map(int, spec.split(":"))
    config = scan_core.ScanConfig(backend="gpu", gpu_block_d=block_d, gpu_num_warps=warps,
                                  gpu_chunk=chunk, gpu_prefetch=prefetch)
  return jax.jit(lambda x, a, h0: scan_linear.linear_scan_with_config(x, a, h0, False, config))


def check(cfgs):
  """Max relative errors of y and h_last against the float64 reference; returns ok flags."""
  shapes = [(2, 257, 200, jnp.float32, False), (3, 1000, 2560, jnp.bfloat16, False),
            (3, 1000, 2560, jnp.bfloat16, True), (1, 1, 128, jnp.float32, False),
            (2, 4100, 384, jnp.bfloat16, False), (2, 4096, 512, jnp.bfloat16, True)]
  results = {}
  for name, cfg in cfgs.items():
    ok = True
    for (b, t, d, dtype, reverse) in shapes:
      inp = bench_scan.make_inputs(jax.random.PRNGKey(t + d), t, dtype, b, d)
      x, a = inp["x"], inp["a"]
      h0 = jax.random.normal(jax.random.PRNGKey(7), (b, d), jnp.float32)
      tag = f"check mgpu {name} {(b, t, d, dtype.__name__, reverse)}"
      try:
        y, h_last = jax.block_until_ready(
            mgpu_fn(dict(cfg, reverse=reverse))(x, a, h0))
        with jax.enable_x64(True):
          f64 = bench_scan.f64
          ref = scan_reference.linear_scan_reference(f64(x), f64(a), f64(h0), reverse=reverse)
          ey, eh = bench_scan.rel_errors((y, h_last), ref)
        tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
        good = ey < tol and eh < 1e-5 and bool(np.all(np.isfinite(np.asarray(y, np.float32))))
        ok &= good
        print(f"{tag}: y rel err {ey:.2e}, h_last rel err {eh:.2e} {'OK' if good else 'FAIL'}",
              flush=True)
      except Exception as e:  # pylint: disable=broad-except
        ok = False
        print(f"{tag}: ERROR\n{short_error(e)}", flush=True)
    results[name] = ok
  return results


def vjp_check():
  """linear_scan_with_config with the Mosaic GPU forward (gpu_forward="mosaic"), forward and
  backward (Triton), against the float64 reference."""
  config = scan_core.ScanConfig(backend="gpu", gpu_forward="mosaic")
  try:
    bench_scan.check_scan_vjp(
        "linear_scan gpu_forward=mosaic",
        lambda x, a, h, r: scan_linear.linear_scan_with_config(x, a, h, r, config),
        jax.random.PRNGKey(1), [(2, 257, 200, jnp.float32, False),
                                (3, 1000, 2560, jnp.bfloat16, True)])
  except Exception as e:  # pylint: disable=broad-except
    print(f"vjp check: ERROR\n{short_error(e)}", flush=True)
    return False
  return True


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--ts", default="8192,2048,32768")
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--mgpu", default="32:256:4:2,16:256:8:2,32:256:5:2,64:128:4:2,"
                      "32:128:4:2")
  parser.add_argument("--triton", default="256:4:32:1,256:4:16:3,256:4:32:2")
  parser.add_argument("--no-check", action="store_true")
  parser.add_argument("--vjp", action="store_true",
                      help="also check and time linear_scan (custom VJP) with the Mosaic GPU "
                      "forward against the all-Triton default, forward + backward")
  parser.add_argument("--check-only", default="",
                      help="comma-separated subset of --mgpu configs to check (default: all)")
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  device = jax.devices()[0]
  date = subprocess.run(["date"], capture_output=True, text=True).stdout.strip()
  print(f"jax {jax.__version__}, {device.device_kind}, {date}", flush=True)
  mgpu_specs = [s for s in args.mgpu.split(",") if s]
  cfgs = {s: parse_mgpu(s) for s in mgpu_specs}
  checked = {}
  if not args.no_check:
    subset = args.check_only.split(",") if args.check_only else mgpu_specs
    checked = check({s: cfgs[s] for s in subset})
  if args.vjp:
    checked["vjp gpu_forward=mosaic"] = vjp_check()
  ceiling = bench_scan.copy_ceiling_tbps(args.iters)
  print(f"HBM copy ceiling: {ceiling:.2f} TB/s", flush=True)

  variants = [("triton default", lambda: triton_fn("default"))]
  variants += [(f"triton {s}", functools.partial(triton_fn, s))
               for s in args.triton.split(",") if s]
  variants += [(f"mgpu {s}", functools.partial(mgpu_fn, cfgs[s])) for s in mgpu_specs]
  if args.vjp:
    for fwd in ("triton", "mosaic"):
      config = scan_core.ScanConfig(backend="gpu", gpu_forward=fwd)
      f = lambda x, a, h0, config=config: scan_linear.linear_scan_with_config(x, a, h0, False,
                                                                              config)
      variants.append((f"linear_scan gpu_forward={fwd} fwd", lambda f=f: jax.jit(f)))
      variants.append((f"linear_scan gpu_forward={fwd} fwd+bwd",
                       lambda f=f: bench_scan.vjp_fn(f, 3)))
  rows = []
  for t in map(int, args.ts.split(",")):
    inp = bench_scan.make_inputs(jax.random.PRNGKey(t), t)
    x, a = inp["x"], inp["a"]
    h0 = jnp.zeros((B, D), jnp.float32)
    for name, make in variants:
      both = name.endswith("fwd+bwd")
      # Bytes: forward reads x, a and writes y; the backward also reads dy, a, y, writes dx, da.
      floor_bytes = (8 if both else 3) * bench_scan.units(t)
      call_args = (x, a, h0, inp["dy"]) if both else (x, a, h0)
      try:
        f = make()
        start = time.perf_counter()
        jax.block_until_ready(f(*call_args))
        first_s = time.perf_counter() - start
        ms = time_fn(f, *call_args, iters=args.iters)
      except Exception as e:  # pylint: disable=broad-except
        print(f"T={t} {name}: ERROR\n{short_error(e)}", flush=True)
        continue
      pct = 100 * floor_bytes / (ms * 1e-3) / (ceiling * 1e12)
      rows.append(dict(T=t, name=name, ms=ms, pct=pct, first_call_s=first_s))
      print(f"T={t} {name}: {ms:.3f} ms, {floor_bytes / ms / 1e9:.2f} TB/s, {pct:.1f}% of "
            f"ceiling (first call {first_s:.1f} s)", flush=True)
      with open(os.path.join(args.out, "bench_scan_mgpu.json"), "w") as fh:
        json.dump(dict(device=device.device_kind, jax=jax.__version__, date=date,
                       ceiling_tbps=ceiling, checked=checked, rows=rows), fh, indent=1)

  lines = [f"Device: {device.device_kind}, jax {jax.__version__}, {date}.",
           f"Command: `python scripts/bench/{os.path.basename(__file__)} {' '.join(sys.argv[1:])}`.",
           f"HBM ceiling (PyTorch 2 GiB device-to-device copy): {ceiling:.2f} TB/s.",
           f"Correctness (mgpu configs vs float64 reference): {checked}", "",
           "| T | kernel | ms | % of ceiling |", "|---|---|---|---|"]
  lines += [f"| {r['T']} | {r['name']} | {r['ms']:.3f} | {r['pct']:.1f}% |" for r in rows]
  table = "\n".join(lines)
  with open(os.path.join(args.out, "bench_scan_mgpu.md"), "w") as fh:
    fh.write(table + "\n")
  print(table)


if __name__ == "__main__":
  main()
