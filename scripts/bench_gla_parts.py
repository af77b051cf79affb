"""Times the pieces of chunk_gla's GPU path (gla_gpu) separately, to see where the time goes.

    python scripts/bench_gla_parts.py [--shape 2,8192,16,64] [--reps 5]

Each piece is its own jitted function on materialised inputs (so XLA cannot fuse across
pieces: the sum is an upper bound of the whole). Prints one line per piece, ms.
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from pallas_kernels import gla_gpu
from pallas_kernels.chunk_gla import chunk_gla

F32 = jnp.float32


def time_fn(f, args, reps, batch=5):
  jax.block_until_ready(f(*args))
  jax.block_until_ready(f(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(batch):
      out = f(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / batch)
  return statistics.median(times) * 1e3


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--shape", default="2,8192,16,64")
  ap.add_argument("--reps", type=int, default=5)
  args = ap.parse_args()
  b, t, h, d = map(int, args.shape.split(","))
  ks = jax.random.split(jax.random.key(0), 5)
  q, k, v, do = (jax.random.normal(kk, (b, t, h, d), jnp.bfloat16) for kk in ks[:4])
  g = jax.nn.log_sigmoid(jax.random.normal(ks[4], (b, t, h, d), F32) + 2.0).astype(jnp.bfloat16)
  s0 = jnp.zeros((b, h, d, d), F32)
  c, scale, dt = 64, d**-0.5, q.dtype
  mm = gla_gpu._mm
  chunks = lambda: gla_gpu._Chunks(q, k, g, None, scale, c)

  def state_inputs(q, k, v, g):
    ch = gla_gpu._Chunks(q, k, g, None, scale, c)
    return mm("...ck,...cv->...kv", ch.k.astype(F32) * ch.k_out, ch.tiles(v), dt)

  def scan(u, q, k, g):
    ch = gla_gpu._Chunks(q, k, g, None, scale, c)
    return ch.scan_states(u, s0, False, jax.default_backend() == "cpu")

  def attention(q, k, g):
    ch = gla_gpu._Chunks(q, k, g, None, scale, c)
    return gla_gpu._attention(ch.qs, ch.k.astype(F32), ch.b, ch.keep, dt).astype(dt)

  def out(q, k, v, g, starts, attn):
    ch = gla_gpu._Chunks(q, k, g, None, scale, c)
    o = mm("...ck,...kv->...cv", ch.qs * ch.q_in, starts, dt) + mm("...tu,...uv->...tv", attn,
                                                                   ch.tiles(v), dt)
    return ch.untile(o.astype(dt))

  def attn_grads(q, k, v, g, do):
    ch = gla_gpu._Chunks(q, k, g, None, scale, c)
    dattn = jnp.where(ch.keep, mm("...tv,...uv->...tu", ch.tiles(do), ch.tiles(v), dt), 0.0)
    return gla_gpu._attention_grads(dattn, ch.qs, ch.k.astype(F32), ch.b, dt)

  def diag_only(q, k, g):
    ch = gla_gpu._Chunks(q, k, g, None, scale, c)
    bsub = gla_gpu._split(ch.b)
    return jnp.sum(gla_gpu._split(ch.qs)[..., :, None, :] * gla_gpu._split(ch.k.astype(F32))[
        ..., None, :, :] * gla_gpu._diag_terms(bsub), axis=-1)

  def copy(x):
    return x * 2

  pieces = []
  u = jax.jit(state_inputs)(q, k, v, g)
  ends, _ = jax.jit(scan)(u, q, k, g)
  starts = jnp.concatenate([s0[:, :, None], ends[:, :, :-1]], axis=2)
  attn = jax.jit(attention)(q, k, g)
  pieces = [("copy q (x2, bf16 U)", copy, (q,)),
            ("fwd: b, U = (k exp(bC-b))^T v", state_inputs, (q, k, v, g)),
            ("fwd: scan over chunks (linear_scan)", scan, (u, q, k, g)),
            ("fwd: A (intra-chunk attention)", attention, (q, k, g)),
            ("fwd: A diagonal blocks only", diag_only, (q, k, g)),
            ("fwd: o = q_in S + A v", out, (q, k, v, g, starts, attn)),
            ("bwd: dq, dk through A", attn_grads, (q, k, v, g, do))]
  for mode in ("associative", "loop"):
    def scan_mode(u, q, k, g, mode=mode):
      gla_gpu.SCAN = mode
      try:
        return scan(u, q, k, g)
      finally:
        gla_gpu.SCAN = "pallas"
    pieces.append((f"fwd: scan over chunks ({mode})", scan_mode, (u, q, k, g)))
  fwd = jax.jit(lambda q, k, v, g: chunk_gla(q, k, v, g)[0])
  fb = jax.jit(lambda q, k, v, g, do: jax.vjp(lambda *a: chunk_gla(*a)[0], q, k, v, g)[1](do))
  pieces += [("total fwd", fwd, (q, k, v, g)), ("total fwd+bwd", fb, (q, k, v, g, do))]
  for name, fn, a in pieces:
    try:
      print(f"{args.shape} {name}: {time_fn(jax.jit(fn), a, args.reps):.3f} ms", flush=True)
    except Exception as e:  # keep going: one failing piece must not hide the others
      print(f"{args.shape} {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
  main()
