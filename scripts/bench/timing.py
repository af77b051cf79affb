"""The one timing helper of the benchmarks: device time per call of a jitted function."""

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
