"""The timing helpers of the benchmarks: device time per call of a jitted function, and the
copy ceiling that memory-bound rows are measured against."""

from __future__ import annotations

import statistics
import time

import jax


def time_fn(fn, *args, iters: int, calls: int = 5, warmup: int = 2) -> float:
  """Median over ``iters`` timings of ``calls`` back-to-back calls ended by block_until_ready,
  per call, in ms. Back-to-back dispatch keeps the host's launch gap out of kernel times;
  ``calls=1`` times whole programs (a training step, a decode loop) one at a time."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    outs = [fn(*args) for _ in range(calls)]
    jax.block_until_ready(outs)
    times.append((time.perf_counter() - start) / calls)
    del outs
  return 1e3 * statistics.median(times)


def copy_ceiling(nbytes: int = 1 << 30, iters: int = 10) -> float:
  """Bytes per second (read plus written) of a jitted ``x + 1`` over ``nbytes`` of bfloat16:
  the rate a memory-bound pass can reach on this device."""
  x = jax.numpy.zeros((nbytes // 2,), jax.numpy.bfloat16)
  ms = time_fn(jax.jit(lambda v: v + 1), x, iters=iters)
  return 2 * nbytes / ms * 1e3
