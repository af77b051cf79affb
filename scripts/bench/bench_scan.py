"""Benchmarks the RG-LRU scan kernels on a GPU against recurrentgemma 1.0.1 and XLA.

    python scripts/bench/bench_scan.py --out DIR [--ts 2048,8192,32768] [--check] [--sweep 256:4,256:4:32:evict_first]

Rows (B=8, D=2560, bfloat16 inputs, float32 carry), forward and forward+backward (the VJP with a
random cotangent for y): our ``linear_scan`` and fused ``rg_lru``; recurrentgemma's
``recurrentgemma.jax.scan.linear_scan`` with LINEAR_NATIVE, ASSOCIATIVE_NATIVE and LINEAR_PALLAS
(``unroll=128``, as its RG-LRU layer calls it; skipped if the package is missing); the RG-LRU layer in plain JAX (XLA, associative scan). The
HBM ceiling is a PyTorch device-to-device copy measured in the same run; each row's "% HBM" is
its byte floor (each input read once, each output written once) over its time, over that
ceiling. Times are the median of --iters timings after warm-up, each of 5 back-to-back calls
ended by block_until_ready (per call). ``--check`` first compares the GPU kernels with the float64 reference on
small odd shapes; ``--sweep`` picks the GPU kernels' block shape by timing the forward scan.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import types

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp
import numpy as np

from pallas_kernels import dispatch
from pallas_kernels.rg_lru import blocked as scan_core, fused as rg_lru_fused
from pallas_kernels.rg_lru import reference as scan_reference, scan as scan_linear
from timing import time_fn  # pylint: disable=g-import-not-at-top  (scripts/bench/)

B, D = 8, 2560


def copy_ceiling_tbps(iters):
  """Bytes read + written per second by a 2 GiB device-to-device copy through PyTorch."""
  import torch  # pylint: disable=g-import-not-at-top
  src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda").random_(0, 255)
  dst = torch.empty_like(src)
  for _ in range(3):
    dst.copy_(src)
  times = []
  for _ in range(iters):
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    times.append(begin.elapsed_time(end) * 1e-3)
  del src, dst
  torch.cuda.empty_cache()
  return 2 * (2 << 30) / statistics.median(times) / 1e12


def vjp_fn(f, n_args):
  """``(args..., dy) -> grads`` of ``f(*args)[0]``: the forward and the backward, as trained."""
  def run(*args_and_dy):
    args, dy = args_and_dy[:n_args], args_and_dy[n_args]
    return jax.vjp(lambda *a: f(*a)[0], *args)[1](dy)
  return jax.jit(run)


def associative_scan(x, a, h0=None):
  """The XLA baseline's scan: ``lax.associative_scan`` in float32."""
  x, a = x.astype(jnp.float32), a.astype(jnp.float32)
  if h0 is not None:
    x = x.at[:, 0].add(a[:, 0] * h0)
  combine = lambda l, r: (l[0] * r[0], r[0] * l[1] + r[1])
  _, h = jax.lax.associative_scan(combine, (a, x), axis=1)
  return h, h[:, -1]


def make_inputs(key, T, dtype=jnp.bfloat16, b=None, d=None):
  b, d = b or B, d or D
  ks = jax.random.split(key, 7)
  normal = lambda k: jax.random.normal(k, (b, T, d), jnp.float32).astype(dtype)
  x, dy, gx, ga = normal(ks[0]), normal(ks[1]), normal(ks[2]), normal(ks[3])
  a = jax.random.uniform(ks[4], (b, T, d), jnp.float32, 0.5, 1.0).astype(dtype)
  a_param = jax.random.normal(ks[5], (d,), jnp.float32)
  reset = (jax.random.uniform(ks[6], (b, T)) < 1 / 64).at[:, 0].set(True)
  return dict(x=x, a=a, dy=dy, gx=gx, ga=ga, a_param=a_param, reset=reset)


def units(T):
  """Bytes of one bfloat16 [B, T, D] array."""
  return B * T * D * 2


def bench_rows(T, iters, rg_scan, config):
  """[(name, fwd_ms, fwd_bwd_ms, fwd_bytes, fwd_bwd_bytes)] at sequence length T."""
  inp = make_inputs(jax.random.PRNGKey(T), T)
  x, a, dy = inp["x"], inp["a"], inp["dy"]
  rows = []

  def add(name, f, args, fwd_units, fwd_bwd_units):
    try:
      fwd = time_fn(jax.jit(f), *args, iters=iters)
      both = time_fn(vjp_fn(f, len(args)), *args, dy, iters=iters)
    except Exception as e:  # pylint: disable=broad-except  (a failing baseline is reported)
      print(f"  T={T} {name}: FAILED {type(e).__name__}: {str(e)[:3000]}", flush=True)
      fwd = both = float("nan")
    rows.append((name, fwd, both, fwd_units * units(T), fwd_bwd_units * units(T)))
    print(f"  T={T} {name}: {fwd:.3f} / {both:.3f} ms", flush=True)

  # Scan: read x, a, write y; backward reads dy, a, y and writes dx, da.
  zeros = jnp.zeros((B, D), jnp.float32)
  add("ours linear_scan",
      lambda x, a: scan_linear.linear_scan_with_config(x, a, zeros, False, config), (x, a), 3, 8)
  if rg_scan is not None:
    scan_mod, common = rg_scan
    for kind in ("LINEAR_NATIVE", "ASSOCIATIVE_NATIVE", "LINEAR_PALLAS"):
      scan_type = getattr(common.ScanType, kind)
      # unroll=128 as recurrentgemma's RG-LRU layer calls it (only LINEAR_NATIVE reads it).
      f = lambda x, a, s=scan_type: scan_mod.linear_scan(x, a, scan_type=s, unroll=128)
      add(f"recurrentgemma {kind}", f, (x, a), 3, 8)
  # Layer: read x and both gate logits, write y; backward reads dy, x, logits, y and writes
  # the three input gradients (the reset flags and a_param are negligible).
  layer_args = (x, inp["gx"], inp["ga"], inp["a_param"])
  reset = inp["reset"]
  reset_f32 = reset.astype(jnp.float32)
  add("ours rg_lru (fused)",
      lambda x, gx, ga, p: rg_lru_fused.rg_lru_with_config(x, gx, ga, p, reset_f32, zeros, config),
      layer_args, 4, 12)
  add("XLA rg_lru (associative)",
      lambda x, gx, ga, p: scan_reference.rg_lru_reference(x, gx, ga, p, reset,
                                                           scan_fn=associative_scan),
      layer_args, 4, 12)
  return rows


CHECK_SHAPES = [(2, 257, 200, jnp.float32, False), (3, 1000, 2560, jnp.bfloat16, True),
                (1, 1, 7, jnp.float32, False)]


def f64(v):
  return jnp.asarray(np.asarray(v, np.float64))


def check_scan_vjp(name, scan, key, shapes=CHECK_SHAPES):
  """``scan(x, a, h0, reverse) -> (y, h_last)`` and its VJP vs the float64 reference on
  ``shapes`` ``(b, t, d, dtype, reverse)``; raises on a mismatch."""
  for (b, t, d, dtype, reverse) in shapes:
    inp = make_inputs(key, t, dtype, b, d)
    h0 = jax.random.normal(key, (b, d), jnp.float32)
    got = jax.vjp(lambda x, a, h: scan(x, a, h, reverse), inp["x"], inp["a"], h0)
    grads = got[1]((inp["dy"], jnp.ones((b, d), jnp.float32)))
    with jax.enable_x64(True):
      ref = jax.vjp(lambda x, a, h: scan_reference.linear_scan_reference(x, a, h, reverse=reverse),
                    f64(inp["x"]), f64(inp["a"]), f64(h0))
      ref_grads = ref[1]((f64(inp["dy"]), jnp.ones((b, d), jnp.float64)))
      _report(name, (b, t, d, dtype.__name__, reverse), got[0] + grads, ref[0] + ref_grads, dtype)


def check(key):
  """GPU kernels vs the float64 reference on small odd shapes; raises on a mismatch."""
  check_scan_vjp("linear_scan", lambda x, a, h, r: scan_linear.linear_scan(x, a, h, reverse=r),
                 key)
  for (b, t, d, dtype, _) in CHECK_SHAPES:
    inp = make_inputs(key, t, dtype, b, d)
    h0 = jax.random.normal(key, (b, d), jnp.float32)
    layer = (inp["x"], inp["gx"], inp["ga"], inp["a_param"])
    got = jax.vjp(lambda *v: rg_lru_fused.rg_lru(*v, inp["reset"], h0), *layer)
    grads = got[1]((inp["dy"], jnp.ones((b, d), jnp.float32)))
    with jax.enable_x64(True):
      ref = jax.vjp(lambda *v: scan_reference.rg_lru_reference(*v, inp["reset"], f64(h0)),
                    *map(f64, layer))
      ref_grads = ref[1]((f64(inp["dy"]), jnp.ones((b, d), jnp.float64)))
      _report("rg_lru", (b, t, d, dtype.__name__), got[0] + grads, ref[0] + ref_grads, dtype)


def rel_errors(got, ref):
  """Relative L2 error of each array of ``got`` against ``ref``."""
  return [float(np.linalg.norm(np.asarray(g, np.float64) - np.asarray(r))
                / max(np.linalg.norm(np.asarray(r)), 1e-30)) for g, r in zip(got, ref)]


def _report(name, shape, got, ref, dtype):
  tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
  errs = rel_errors(got, ref)
  print(f"check {name} {shape}: max rel err {max(errs):.2e}", flush=True)
  if not max(errs) < tol:
    raise AssertionError(f"{name} {shape}: errors {errs}")


def sweep(iters, candidates):
  """Times the forward scan kernel at T=8192 for each ``(block_d, num_warps)``; returns the
  fastest as a ScanConfig (the other kernels take the same block shape)."""
  T = 8192
  inp = make_inputs(jax.random.PRNGKey(0), T)
  zeros = jnp.zeros((B, D), jnp.float32)
  results = []
  for candidate in candidates:
    block_d, warps, chunk, eviction = (list(candidate) + [None, None])[:4]
    config = scan_core.ScanConfig(backend="gpu", gpu_block_d=int(block_d),
                                  gpu_num_warps=int(warps), gpu_chunk=int(chunk) if chunk else None,
                                  gpu_eviction=eviction or None)
    f = jax.jit(lambda x, a, h0, config=config: scan_linear.linear_scan_with_config(
        x, a, h0, False, config))
    start = time.perf_counter()
    jax.block_until_ready(f(inp["x"], inp["a"], zeros))
    compile_s = time.perf_counter() - start
    ms = time_fn(f, inp["x"], inp["a"], zeros, iters=iters)
    results.append((ms, str(config), config))
    print(f"  sweep scan fwd {':'.join(map(str, candidate))}: {ms:.3f} ms "
          f"({3 * units(T) / ms / 1e9:.2f} TB/s; first call {compile_s:.1f} s)", flush=True)
  ms, _, config = min(results)
  print(f"BEST {config}: {ms:.3f} ms", flush=True)
  return config


def import_recurrentgemma_scan():
  """``(recurrentgemma.jax.scan, recurrentgemma.common)``, or None if not installed."""
  try:
    import jax.experimental.shard_map  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    # Newer jax dropped this alias, which recurrentgemma 1.0.1 imports at module level; its
    # single-device scans timed here never call it.
    shim = types.ModuleType("jax.experimental.shard_map")
    shim.shard_map = jax.shard_map
    sys.modules[shim.__name__] = shim
  try:
    from recurrentgemma import common  # pylint: disable=g-import-not-at-top
    from recurrentgemma.jax import scan  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    print(f"recurrentgemma not importable ({e}): its rows are skipped")
    return None
  return scan, common


def plot(rows_by_t, path):
  import matplotlib  # pylint: disable=g-import-not-at-top
  import matplotlib.ticker  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  names = [r[0] for r in next(iter(rows_by_t.values()))]
  ts = sorted(rows_by_t)
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
  for ax, col, title in ((axes[0], 1, "forward"), (axes[1], 2, "forward + backward")):
    for i, name in enumerate(names):
      ax.plot(ts, [rows_by_t[t][i][col] for t in ts], marker="o", label=name)
    ax.set(xscale="log", yscale="log", xlabel="T", ylabel="ms", title=title)
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xticks(ts, [str(t) for t in ts])
    ax.grid(True, which="both", alpha=0.3)
  axes[1].legend(fontsize=7)
  fig.suptitle(f"RG-LRU scan, B={B}, D={D}, bfloat16")
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def write_table(out, device, ceiling, iters, rows_by_t):
  date = subprocess.run(["date"], capture_output=True, text=True).stdout.strip()
  lines = [f"Device: {device.device_kind}, jax {jax.__version__}, {date}.",
           f"Command: `python scripts/bench/{os.path.basename(__file__)} {' '.join(sys.argv[1:])}`.",
           f"HBM ceiling (PyTorch 2 GiB device-to-device copy, read + write): {ceiling:.2f} TB/s.",
           f"B={B}, D={D}, bfloat16; ms per call, median of {iters} timings of 5 back-to-back "
           "calls; % HBM = byte floor / time / ceiling.",
           "", "| T | implementation | fwd ms | fwd % HBM | fwd+bwd ms | fwd+bwd % HBM |",
           "|---|---|---|---|---|---|"]
  pct = lambda nbytes, ms: 100 * nbytes / (ms * 1e-3) / (ceiling * 1e12)
  for t, rows in rows_by_t.items():
    for name, fwd, both, fwd_bytes, both_bytes in rows:
      lines.append(f"| {t} | {name} | {fwd:.3f} | {pct(fwd_bytes, fwd):.0f}% | {both:.3f} | "
                   f"{pct(both_bytes, both):.0f}% |")
  table = "\n".join(lines)
  with open(os.path.join(out, "bench_scan.md"), "w") as f:
    f.write(table + "\n")
  with open(os.path.join(out, "bench_scan.json"), "w") as f:
    json.dump(dict(device=device.device_kind, date=date, ceiling_tbps=ceiling, rows=rows_by_t),
              f, indent=1)
  return table


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--ts", default="2048,8192,32768")
  parser.add_argument("--iters", type=int, default=30)
  parser.add_argument("--check", action="store_true")
  parser.add_argument("--sweep", default="",
                      help="block_d:num_warps[:chunk[:eviction]] candidates for the GPU kernels, "
                      "e.g. 128:4,256:4:32:evict_first")
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  device = jax.devices()[0]
  print(f"jax {jax.__version__}, {device.device_kind}", flush=True)
  if args.check:
    check(jax.random.PRNGKey(1))
  ceiling = copy_ceiling_tbps(args.iters)
  print(f"HBM copy ceiling: {ceiling:.2f} TB/s", flush=True)
  config = dispatch.scan_config()
  if args.sweep:
    candidates = [tuple(c.split(":")) for c in args.sweep.split(",")]
    config = sweep(args.iters, candidates)
  rg_scan = import_recurrentgemma_scan()
  rows_by_t = {}
  for t in map(int, args.ts.split(",")):
    rows_by_t[t] = bench_rows(t, args.iters, rg_scan, config)
    table = write_table(args.out, device, ceiling, args.iters, rows_by_t)  # kept if cut short
  print(f"GPU kernel config: {config}")
  print(table)
  try:
    plot(rows_by_t, os.path.join(args.out, "bench_scan.png"))
  except ImportError:
    print("matplotlib not importable: no plot")


if __name__ == "__main__":
  main()
