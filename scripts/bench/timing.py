"""The timing helpers of the benchmarks: device time per call of a jitted function, the copy
ceiling that memory-bound rows are measured against, the matmul ceiling beside the rated peak,
and the GPU's clock and power while a row runs."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile
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


def matmul_ceiling(n: int = 8192, seconds: float = 1.5) -> float:
  """FLOP/s of a jitted bfloat16 ``[n, n] x [n, n]`` matmul run back to back for about
  ``seconds`` (long enough for a GPU's power cap to set the clock, as it does through a decoding
  run): the rate compute-bound work can sustain on this device, beside the rated peak."""
  a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jax.numpy.bfloat16)
  matmul = jax.jit(lambda u, v: u @ v)
  once = time_fn(matmul, a, a, iters=1, calls=3)
  calls = max(1, int(seconds * 1e3 / max(once, 1e-3) / 5))
  ms = time_fn(matmul, a, a, iters=5, calls=calls)
  return 2 * n ** 3 / ms * 1e3


# nvidia-smi's bit for "throttled by the software power cap" in clocks_throttle_reasons.active.
SW_POWER_CAP = 0x4
_QUERY = "clocks.sm,power.draw,clocks_throttle_reasons.active"


def clock_summary(lines: list[str]) -> dict | None:
  """``{"samples", "sm_clock_mhz" (median), "sm_clock_min_mhz", "power_w" (mean),
  "power_capped" (share of samples throttled by the power cap)}`` from nvidia-smi's
  ``clocks.sm,power.draw,clocks_throttle_reasons.active`` lines (csv, noheader, nounits);
  None without a readable sample."""
  clocks, powers, capped = [], [], 0
  for line in lines:
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 3:
      continue
    try:
      clock, power, reasons = float(parts[0]), float(parts[1]), int(parts[2], 16)
    except ValueError:  # "[N/A]", "[Not Supported]" or a line cut short
      continue
    clocks.append(clock)
    powers.append(power)
    capped += bool(reasons & SW_POWER_CAP)
  if not clocks:
    return None
  return {"samples": len(clocks), "sm_clock_mhz": statistics.median(clocks),
          "sm_clock_min_mhz": min(clocks), "power_w": statistics.fmean(powers),
          "power_capped": capped / len(clocks)}


def clock_cell(summary: dict | None) -> str:
  """A table cell for ``clock_summary``'s result: "1605 MHz, 691 W (cap)", "(cap)" where the
  power cap throttled most samples; "-" without one."""
  if not summary:
    return "-"
  cap = " (cap)" if summary["power_capped"] >= 0.5 else ""
  return f"{summary['sm_clock_mhz']:.0f} MHz, {summary['power_w']:.0f} W{cap}"


class GpuClocks:
  """Samples the GPU's SM clock, board power and throttle reasons every ``period_ms``
  (``nvidia-smi --loop-ms``) while the ``with`` block runs; ``summary()`` after it. An H100 at
  its 700 W cap runs its SMs well below the 1830 MHz its bfloat16 peak assumes
  (docs/performance.md), so a row's MFU reads with its clock. The GPU sampled is the first of
  ``CUDA_VISIBLE_DEVICES`` (else GPU 0); without nvidia-smi the block runs unsampled and
  ``summary()`` is None."""

  def __init__(self, period_ms: int = 100):
    self.period_ms = period_ms
    self.lines: list[str] = []
    self._proc = None
    self._out = None

  def __enter__(self) -> "GpuClocks":
    exe = shutil.which("nvidia-smi")
    if exe is not None:
      gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip() or "0"
      self._out = tempfile.TemporaryFile("w+")
      self._proc = subprocess.Popen(
          [exe, f"--id={gpu}", f"--query-gpu={_QUERY}", "--format=csv,noheader,nounits",
           f"--loop-ms={self.period_ms}"], stdout=self._out, stderr=subprocess.DEVNULL)
    return self

  def __exit__(self, *exc) -> None:
    if self._proc is None:
      return
    self._proc.terminate()
    try:
      self._proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
      self._proc.kill()
      self._proc.wait()
    self._out.seek(0)
    self.lines = self._out.read().splitlines()
    self._out.close()
    self._proc = None

  def summary(self) -> dict | None:
    return clock_summary(self.lines)
