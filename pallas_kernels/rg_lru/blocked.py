"""One sequential-scan driver for all the RG-LRU kernels, dispatched to a TPU or a GPU kernel.

Every kernel here (the linear scan, its backward, the fused RG-LRU layer and its backward) is
the same loop: walk the time axis of ``[B, T, D]`` streams in scan order, keep float32 carries of
shape ``[B, D]`` on chip, and at each step call a per-step function on one time row:

    carries, outputs = step(carries, inputs)

``inputs`` is, in this order: one row of each stream; the row of the ``lookahead`` stream at the
*next* scan position (its boundary value at the last position); one value of each ``rows``
stream (``[B, T]`` per-token scalars); each ``params`` vector (``[D]``, constant over b and t).
All are float32 and broadcast against a ``[.., block_d]`` row. ``outputs`` are written at the
current time row. The step function is pure jnp elementwise arithmetic, so the same function
traces into the Mosaic (TPU) and the Triton (GPU) kernel bodies.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Sequence

import jax

from pallas_kernels.rg_lru import gpu
from pallas_kernels.rg_lru import tpu

Step = Callable[[tuple, tuple], tuple[tuple, tuple]]


@dataclasses.dataclass(frozen=True)
class ScanConfig:
  """Which kernel runs and its block sizes (static: part of the jit cache key).

  ``backend`` is ``"tpu"`` (Mosaic; TPU interpret mode when ``interpret``) or ``"gpu"`` (Triton;
  Pallas' generic interpreter when ``interpret``). The ``gpu_*`` fields of None pick the tuned
  defaults of ``rg_lru.gpu``.
  """

  backend: str = "tpu"
  interpret: bool = False
  block_b: int = 8
  block_t: int = 128
  block_d: int = 256
  gpu_block_d: int | None = None
  gpu_chunk: int | None = None
  gpu_num_warps: int | None = None
  gpu_eviction: str | None = None  # Triton eviction policy of the row loads and stores
  gpu_prefetch: int | None = None  # chunks loaded ahead of the one being computed (default 1)
  # The linear scan's forward on GPU: "triton" (blocked_scan) or "mosaic" (gpu_mosaic: TMA
  # pipeline, Hopper and newer; shapes it does not support fall back to Triton).
  # dispatch.scan_config picks "mosaic" on Hopper and newer (measured faster,
  # docs/kernels.md), "triton" before.
  gpu_forward: str = "triton"


def blocked_scan(
    step: Step,
    streams: Sequence[jax.Array],
    carries0: Sequence[jax.Array],
    *,
    out_dtypes: Sequence,
    reverse: bool,
    config: ScanConfig,
    lookahead: tuple[jax.Array, jax.Array] | None = None,
    rows: Sequence[jax.Array] = (),
    params: Sequence[jax.Array] = (),
) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
  """Runs ``step`` over time; see the module docstring.

  Args:
    step: the per-step function.
    streams: ``[B, T, D]`` arrays (any float dtype), one row each per step.
    carries0: ``[B, D]`` float32 initial carries.
    out_dtypes: one dtype per ``[B, T, D]`` output of ``step``.
    reverse: walk ``t = T-1 .. 0`` instead of ``0 .. T-1``.
    config: backend and block sizes.
    lookahead: ``(stream [B, T, D], boundary [B, D])``: the stream is read at the next scan
      position (``t+1``, or ``t-1`` when ``reverse``); at the last position ``boundary`` is used.
    rows: ``[B, T]`` per-token scalars.
    params: ``[D]`` per-channel vectors.

  Returns:
    ``(outputs, carries)``: the ``[B, T, D]`` outputs and the final ``[B, D]`` float32 carries.
  """
  # The kernel is named by its step ("pallas_rg_lru_forward_step"): a profile tells the
  # passes apart.
  step_name = re.sub(r"\W", "", getattr(step, "__name__", "")).strip("_")
  name = f"pallas_rg_lru_{step_name or 'scan'}"
  kwargs = dict(out_dtypes=tuple(out_dtypes), reverse=reverse, config=config,
                lookahead=lookahead, rows=tuple(rows), params=tuple(params), name=name)
  if config.backend == "gpu":
    return gpu.gpu_scan(step, tuple(streams), tuple(carries0), **kwargs)
  return tpu.tpu_scan(step, tuple(streams), tuple(carries0), **kwargs)
